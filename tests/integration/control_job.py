"""A gloo job that runs until a stop file appears (every rank agrees through an all-reduce, so all stop at the same
step), for tests that act on a running job: ``python control_job.py --job J --stop-file F [--step-ms MS]``.

With ``tests/fake_cupti`` on PYTHONPATH its tracer's CUPTI collector publishes synthetic kernel records."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from argus.core.settings import Settings
from argus.producers.tracer import Tracer
from argus.schemas.records import ParallelGroup, PhaseKind


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--job", required=True)
    ap.add_argument("--stop-file", required=True, type=Path)
    ap.add_argument("--step-ms", type=float, default=30.0)
    ap.add_argument("--max-steps", type=int, default=20_000)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    data = torch.randn(16, 32)
    tracer = Tracer(Settings.load(), args.job, rank, world).start()
    try:
        for _ in range(args.max_steps):
            with tracer.step():
                with tracer.phase("forward", PhaseKind.FORWARD):
                    loss = model(data).square().mean()
                with tracer.phase("backward", PhaseKind.BACKWARD):
                    model.zero_grad()
                    loss.backward()
                time.sleep(args.step_ms / 1000)
                stop = torch.tensor([1.0 if args.stop_file.exists() else 0.0])
                tracer.all_reduce(stop, parallel_group=ParallelGroup.DP)
            if stop.item() > 0:
                break
    finally:
        stats = tracer.close()
        print(f"rank {rank}: {stats}", flush=True)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
