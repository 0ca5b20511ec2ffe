"""Benchmark: false alarms of the whole streaming diagnosis on healthy simulated jobs.

Starts the local stack (``argus up``), publishes ``--seeds`` healthy jobs for each of several topologies
(the simulator's default noise and benign rank-to-rank spread), waits until each is diagnosed through to
ClickHouse and counts the findings. Budget: zero L2/L3 findings and zero L1 findings (iteration time is flat).

Prints one JSON line; exits 1 on any false alarm.
Run: .venv/bin/python load_tests/false_alarms.py [--seeds 5]
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from argus.core.settings import Settings
from argus.producers.publisher import Publisher
from argus.producers.sim_workload import GradSync
from argus.producers.simulator import JobSimulator, JobSpec
from argus.sinks.findings_query import fetch_findings, wait_diagnosed
from argus.stack import Stack

TOPOLOGIES = {"dp8": (8, 1, 1, GradSync.ALL_REDUCE), "dp4pp2-dist": (4, 1, 2, GradSync.DISTRIBUTED),
              "dp2tp2pp2-dist": (2, 2, 2, GradSync.DISTRIBUTED), "dp8tp2pp2": (8, 2, 2, GradSync.ALL_REDUCE)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    settings = Settings.load()
    Stack(settings).up()
    tag = uuid.uuid4().hex[:6]
    specs = [JobSpec(f"healthy-{name}-{seed}-{tag}", dp, tp=tp, pp=pp, steps=args.steps, seed=seed, grad_sync=sync)
             for name, (dp, tp, pp, sync) in TOPOLOGIES.items() for seed in range(args.seeds)]
    with Publisher(settings, lossless=True) as pub:
        for spec in specs:
            JobSimulator(spec, batch_events=settings.publisher_batch_events).run(pub)
    per_level = {"L1": 0, "L2": 0, "L3": 0}
    undiagnosed = 0
    examples = []
    for spec in specs:
        if not wait_diagnosed(settings, spec.job_id, 300):
            undiagnosed += 1
        for f in fetch_findings(settings, spec.job_id):
            per_level[f["level"]] += 1
            examples.append({k: f[k] for k in ("job", "level", "kind", "ranks", "phase", "kernel", "score")})
    result = {"benchmark": "false_alarms", "jobs": len(specs), "topologies": list(TOPOLOGIES),
              "seeds_per_topology": args.seeds, "steps": args.steps, "findings": per_level,
              "undiagnosed_jobs": undiagnosed, "examples": examples[:5]}
    result["within_budget"] = not examples and not undiagnosed
    sys.stdout.write(json.dumps(result) + "\n")
    return 0 if result["within_budget"] else 1


if __name__ == "__main__":
    sys.exit(main())
