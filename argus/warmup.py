"""Compile the numba kernels of the worker and the importer ahead of their first use.

The diagnosis and decoding kernels are compiled by numba on their first call and cached next to their modules
(``__pycache__/*.nbi``, ``*.nbc``); a process that finds the cache loads them in milliseconds. Without it, the
first windows of a fresh install wait about a minute of CPU for the compiler, and every process that starts
before the cache is written compiles them again. ``python -m argus.warmup`` (run by ``scripts/setup`` and in a
container image's build) diagnoses small simulated jobs in process and decodes their records by columns, which
calls each kernel with the types the stream uses, and says how long it took.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from argus.producers.faults import Fault
from argus.producers.seed_cases import paper_case
from argus.producers.simulator import JobSimulator
from argus.streams.job_intake import JobIntake
from argus.streams.offline import diagnose_records
from argus.topics import RECORD_OF, Topic

__all__ = ["warm"]

log = logging.getLogger(__name__)

#: Jobs whose diagnosis reaches every detector: compute, collective and pipeline faults, a host stall.
_CASES = (Fault.COMPUTE_STRAGGLER, Fault.LINK_DEGRADATION, Fault.PP_LAST_STAGE_SLOW, Fault.HOST_JIT_STALL)
#: The topics whose records are also decoded from their wire bytes.
_WIRE = (Topic.STEPS, Topic.PHASES, Topic.KERNELS)


def warm(steps: int = 12) -> float:
    """Diagnose one small simulated job per case of ``_CASES`` (``steps`` steps each) and decode their records'
    wire bytes as the agents do (steps and phases by columns, kernel and phase batches one by one), compiling
    (or loading) every kernel on the way; returns the seconds it took."""
    t0 = time.monotonic()
    for fault in _CASES:
        records = list(JobSimulator(paper_case(fault, job_id=f"warmup-{fault.value.lower()}", steps=steps)).records())
        diagnose_records(r.record for r in records)
        messages = [(r.topic, r.record.encode()) for r in records if r.topic in _WIRE]
        JobIntake().decode([m for m in messages if m[0] is not Topic.KERNELS])  # the job agent's columns
        for topic, payload in messages:  # the compressor's kernel batches, one phase batch at a time
            if topic is not Topic.STEPS:
                RECORD_OF[topic].decode(payload)
    took = time.monotonic() - t0
    log.info("numba kernels compiled or loaded in %.1f s", took)
    return took


def main(argv: list[str] | None = None) -> int:
    """``python -m argus.warmup``: warm the caches, print the time on one line (no arguments; any other is a
    usage error, exit 2)."""
    argparse.ArgumentParser(prog="python -m argus.warmup", description=__doc__.split("\n\n")[0]).parse_args(argv)
    took = warm()
    sys.stdout.write(f"argus: diagnosis kernels ready ({took:.1f} s)\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
