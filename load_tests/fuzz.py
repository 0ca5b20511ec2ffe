"""Fuzzing for minutes, with new inputs each run: the Avro codec, the Kineto importer and the stream routers.

Each case draws its input from its own seed (printed with every failure), so any failure is reproduced by
``python load_tests/fuzz.py --target T --case-seed N``. A case ends in one of:

* ``ok``: the input was taken (a record decoded and round-trips, a trace imported, the routers took it all);
* ``clean``: refused the documented way: ``SchemaError`` from the codec, ``ArgusError`` from the importer, a
  mutated record that its own ``check()`` refuses before any router sees it (as the agents' decoding does);
* ``escape``: any other exception, or a decoded record that does not encode back to itself;
* ``hang``: the case ran past ``--case-timeout`` seconds;
* ``contained`` (routers): a record that passed its checks raised inside a router, which dead-lettered it
  and rebuilt the job's state: no escape, but worth a look (the failures list them).

Targets:

* ``codec``: the encoding of a sample record, mutated (bits flipped, bytes cut, inserted, repeated, the magic
  byte or schema version changed), decoded as each record type;
* ``kineto``: a small trace mutated as JSON (hostile values in events: huge or negative numbers, times near
  2^62, strings, nesting, step names, ranks and world sizes, process-group lists) and as bytes, plain or
  gzipped (and cut), imported with ``import_kineto`` into a publisher that encodes what it is given;
* ``routers``: a simulated job's records with some fields set to edge values, shuffled with copies, taken by
  the job router and the compression router, whose ``take`` must never raise.

Prints one JSON line: per target the counts of cases, ok, clean errors, escapes and hangs; the peak RSS; the
first failures with their seeds; the budgets (no escape, no hang, peak RSS) and ``within_budget``. Exits 1
over budget.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import logging
import random
import resource
import signal
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable
from functools import cache
from pathlib import Path
from types import FrameType
from typing import Any

from argus.core.errors import ArgusError, SchemaError
from argus.core.settings import Settings
from argus.producers.faults import Fault
from argus.producers.kineto import import_kineto
from argus.producers.seed_cases import paper_case
from argus.producers.simulator import JobSimulator
from argus.schemas.records import JobLifecycle, JobTopology, KernelBatch, PhaseBatch, Record, Step
from argus.streams.compression_router import CompressionRouter
from argus.streams.diagnosis import DiagnosisParams
from argus.streams.diagnosis_stats import DiagnosisStats
from argus.streams.job_effects import Mark, Release
from argus.streams.job_router import JobRouter

#: Budgets: no escape and no hang at all; the process's peak resident memory, MiB.
BUDGET = {"escapes": 0, "hangs": 0, "peak_rss_mb": 2048}
T0 = 1_700_000_000_000_000
EDGES = [0, 1, -1, 2**31 - 1, 2**31, -(2**31), 2**32, 2**53 + 1, 2**62 - 1, 2**62, -(2**62), 2**63 - 1, -(2**63),
         2**64, 10**30]
Outcome = str  # "ok" | "clean" | "escape" | "hang" | "contained"


class _Hang(BaseException):
    """Raised in the case by the timer: not an Exception, so no handler of the code under test swallows it."""


class _Encoder:
    """A publisher that encodes (and so validates) every record it is given, as the real one's sender does."""

    def __init__(self) -> None:
        self.records = 0

    def publish(self, topic: Any, key: bytes, record: Record) -> bool:
        record.encode()
        self.records += 1
        return True

    def flush(self, timeout: float | None = None) -> int:
        return 0


# -- codec -----------------------------------------------------------------------------------------------------

@cache
def _job_records() -> tuple[Record, ...]:
    spec = paper_case(Fault.COMPUTE_STRAGGLER, job_id="fz", steps=6)
    return tuple(r.record for r in JobSimulator(spec, batch_events=512).records())


def _mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 6)):
        at = rng.randint(0, len(out))
        op = rng.choice(["flip", "cut", "insert", "repeat", "head"])
        if op == "flip" and at < len(out):
            out[at] ^= 1 << rng.randint(0, 7)
        elif op == "cut":
            del out[at:at + rng.randint(1, 64)]
        elif op == "insert":
            out[at:at] = bytes(rng.randint(0, 255) for _ in range(rng.randint(1, 16)))
        elif op == "repeat":
            out[at:at] = out[at:at + rng.randint(1, 256)] * rng.randint(1, 8)
        elif op == "head" and out:
            out[rng.randint(0, min(1, len(out) - 1))] = rng.randint(0, 255)  # the magic byte or the version
    return bytes(out)


def fuzz_codec(rng: random.Random) -> Outcome:
    records = _job_records()
    kinds = {type(r) for r in records}
    sample = rng.choice([r for r in records if type(r) is rng.choice(sorted(kinds, key=lambda k: k.__name__))])
    data = _mutate_bytes(rng, sample.encode())
    decoded = 0
    for cls in sorted(kinds, key=lambda k: k.__name__):
        try:
            rec = cls.decode(data)
        except SchemaError:
            continue
        wire = rec.encode()  # records holding arrays compare by identity: compare what they encode to
        if type(rec).decode(wire).encode() != wire:
            raise AssertionError(f"{cls.__name__} decoded from mutated bytes does not round-trip")
        decoded += 1
    return "ok" if decoded else "clean"


# -- kineto ----------------------------------------------------------------------------------------------------

def _hostile(rng: random.Random) -> Any:
    return rng.choice([
        rng.choice(EDGES), -rng.choice(EDGES), rng.random() * 10 ** rng.randint(-5, 25), "12", "NaN", None, True,
        [1, 2], {"a": [{"b": 1}]}, "x" * rng.randint(0, 5000), 2**62 // 1000 - rng.randint(0, 10**6),
        "ProfilerStep#" + str(rng.choice(EDGES)),
    ])


def _trace(rng: random.Random, rank: int, world: int) -> dict[str, Any]:
    events: list[dict[str, Any]] = []
    t = T0
    for step in range(rng.randint(0, 4)):
        events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step}", "ts": t, "dur": 900})
        for i in range(rng.randint(0, 6)):
            events.append({"ph": "X", "cat": rng.choice(["user_annotation", "gpu_user_annotation"]),
                           "name": rng.choice(["## forward ##", "backward", "nccl:all_reduce", "optimizer",
                                               "nccl:send 0->1"]), "ts": t + 10 + i, "dur": 50,
                           "args": {"stream": 7}})
            events.append({"ph": "X", "cat": "kernel", "name": rng.choice(["gemm", "ncclDevKernel_AllReduce", "ln"]),
                           "ts": t + 20 + i, "dur": 30 + rng.random(), "args": {
                               "stream": rng.choice([7, 13]), "Process Group Name": "0",
                               "Process Group Ranks": list(range(world))}})
        t += 1000
    doc = {"schemaVersion": 1, "distributedInfo": {"rank": rank, "world_size": world}, "traceEvents": events,
           "baseTimeNanoseconds": rng.choice([0, 1000, 2**61])}
    for _ in range(rng.randint(0, 4)):  # hostile values where the importer reads them
        where = rng.choice(["event", "info", "base", "args"])
        if where == "event" and events:
            rng.choice(events)[rng.choice(["ts", "dur", "name", "cat", "ph", "tid"])] = _hostile(rng)
        elif where == "info":
            doc["distributedInfo"][rng.choice(["rank", "world_size", "pg_config"])] = _hostile(rng)
        elif where == "base":
            doc["baseTimeNanoseconds"] = _hostile(rng)
        elif events:
            rng.choice(events).setdefault("args", {})[rng.choice(["stream", "Process Group Ranks"])] = _hostile(rng)
    return doc


def fuzz_kineto(rng: random.Random) -> Outcome:
    world = rng.choice([1, 2, 4])
    with tempfile.TemporaryDirectory(prefix="argus-fuzz-") as tmp:
        for rank in range(rng.randint(1, world)):
            data = json.dumps(_trace(rng, rank, world)).encode()
            if rng.random() < 0.3:
                data = _mutate_bytes(rng, data)
            name = f"rank{rank}.json"
            if rng.random() < 0.3:
                data, name = gzip.compress(data), name + ".gz"
                if rng.random() < 0.3:
                    data = data[:rng.randint(0, len(data))]
            (Path(tmp) / name).write_bytes(data)
        try:
            import_kineto(Settings.load(env={}, import_max_memory_mb=256), Path(tmp), "fz", publisher=_Encoder())
        except ArgusError:
            return "clean"
    return "ok"


# -- routers ---------------------------------------------------------------------------------------------------

_INT_FIELDS = {Step: ("rank", "step", "start_ns", "wall_ns", "gpu_ns"), PhaseBatch: ("rank", "step"),
               JobLifecycle: ("time_ns", "world_size", "steps", "phase_batches", "kernel_events"),
               JobTopology: ("world_size", "dp_size", "tp_size", "pp_size"), KernelBatch: ("rank", "seq")}


def _edged(rng: random.Random, rec: Record) -> Record | None:
    """``rec`` with one field at an edge value, or None when its ``check()`` refuses it (as decoding would)."""
    fields = _INT_FIELDS.get(type(rec))
    if not fields:
        return rec
    try:
        out = dataclasses.replace(rec, **{rng.choice(fields): rng.choice([*EDGES, rng.randint(-5, 40)])})
        out.check()
    except (SchemaError, TypeError, ValueError):
        return None
    return out


def fuzz_routers(rng: random.Random) -> Outcome:
    settings = Settings.load(env={}, window_ns=1_000_000_000, allowed_lateness_ns=500_000_000)
    records = list(_job_records())
    for _ in range(rng.randint(1, 20)):
        i = rng.randrange(len(records))
        edged = _edged(rng, records[i])
        if edged is None:
            continue  # refused by its own check(), as decoding refuses it: no router would see it
        if rng.random() < 0.5:
            records[i] = edged
        else:
            records.insert(rng.randrange(len(records) + 1), edged)
    records += rng.sample(records, k=rng.randint(0, len(records) // 4))  # copies, as redeliveries
    rng.shuffle(records)
    stats = DiagnosisStats()
    jobs: JobRouter[int] = JobRouter(settings.worker, 2, DiagnosisParams(detect_every=3), stats,
                                     lambda h: records[h], "fuzz", final_wait_s=0.0)
    kernels: CompressionRouter[int] = CompressionRouter(settings.worker, settings.detector)
    now = 0.0
    for h, rec in enumerate(records):
        now += 0.01
        if isinstance(rec, KernelBatch):
            kernels.take(rec, h, h % 2, h, now, T0)
        elif not isinstance(rec, JobTopology | JobLifecycle | Step | PhaseBatch):
            continue
        else:
            _carry_out(jobs, jobs.take(rec, h, now).effects, now)
        if h % 50 == 0:
            _carry_out(jobs, jobs.idle_jobs(now, T0).effects, now)
            kernels.idle_jobs(now)
    # A record that passed its checks and still raised in a stage: contained (dead-lettered, the state
    # rebuilt), but a bug all the same.
    return "contained" if stats.states_repaired or stats.states_discarded or kernels.stats.failed_messages else "ok"


def _carry_out(router: JobRouter[int], effects: Iterable[Any], now: float) -> None:
    for e in effects:
        if isinstance(e, Mark):
            _carry_out(router, router.marked(e.record, now, e.release).effects, now)
        elif isinstance(e, Release):
            _carry_out(router, router.release(e.job_id, now).effects, now)


TARGETS: dict[str, Callable[[random.Random], Outcome]] = {
    "codec": fuzz_codec, "kineto": fuzz_kineto, "routers": fuzz_routers}


def _on_alarm(_signum: int, _frame: FrameType | None) -> None:
    raise _Hang


def run_case(target: str, seed: int, timeout_s: float) -> tuple[Outcome, str]:
    """One case: its outcome and, for an escape or a hang, what happened."""
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return TARGETS[target](random.Random(seed)), ""
    except _Hang:
        return "hang", f"over {timeout_s:.0f} s"
    except Exception as exc:
        where = traceback.extract_tb(exc.__traceback__)[-1]
        return "escape", f"{type(exc).__name__}: {str(exc)[:200]} at {Path(where.filename).name}:{where.lineno}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="how long to fuzz, all targets in turn")
    p.add_argument("--seed", type=int, default=None, help="seed of the case seeds (default: from the clock)")
    p.add_argument("--target", choices=[*TARGETS, "all"], default="all")
    p.add_argument("--cases", type=int, default=None, help="stop after this many cases (each target in turn)")
    p.add_argument("--case-seed", type=int, default=None, help="run the one case of this seed (reproduce it)")
    p.add_argument("--case-timeout", type=float, default=30.0, help="seconds before a case counts as a hang")
    args = p.parse_args(argv)
    logging.disable(logging.CRITICAL)  # the routers log every dead letter; the counts say it here
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    try:
        return _fuzz(args)
    finally:
        logging.disable(logging.NOTSET)
        signal.signal(signal.SIGALRM, previous)


def _fuzz(args: argparse.Namespace) -> int:
    seed = args.seed if args.seed is not None else time.time_ns() % 2**32
    master = random.Random(seed)
    targets = list(TARGETS) if args.target == "all" else [args.target]
    counts = {t: Counter[str]() for t in targets}
    failures: list[dict[str, Any]] = []
    deadline = time.monotonic() + args.minutes * 60
    n = 0
    while time.monotonic() < deadline and (args.cases is None or n < args.cases):
        target = targets[n % len(targets)]
        case_seed = args.case_seed if args.case_seed is not None else master.randrange(2**63)
        outcome, what = run_case(target, case_seed, args.case_timeout)
        what = what or ("a checked record raised inside a router" if outcome == "contained" else "")
        counts[target]["cases"] += 1
        counts[target][outcome] += 1
        if what and len(failures) < 20:
            failures.append({"target": target, "case_seed": case_seed, "outcome": outcome, "what": what,
                             "repro": f"python load_tests/fuzz.py --target {target} --case-seed {case_seed} "
                                      f"--cases 1"})
        n += 1
        if args.case_seed is not None:
            break
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    per_target = {t: {k: c[k] for k in ("cases", "ok", "clean", "contained", "escape", "hang")}
                  for t, c in counts.items()}
    escapes = sum(c["escape"] for c in counts.values())
    hangs = sum(c["hang"] for c in counts.values())
    within = escapes <= BUDGET["escapes"] and hangs <= BUDGET["hangs"] and peak_mb <= BUDGET["peak_rss_mb"]
    print(json.dumps({"benchmark": "fuzz", "seed": seed, "minutes": args.minutes, "targets": per_target,
                      "escapes": escapes, "hangs": hangs, "peak_rss_mb": round(peak_mb, 1), "failures": failures,
                      "budget": BUDGET, "within_budget": within}))
    return 0 if within else 1


if __name__ == "__main__":
    sys.exit(main())
