"""A small torch.distributed (gloo, CPU) training job instrumented with the argus tracer.

It is both the adoption example (the lines marked ``# argus``) and the end-to-end test job: one rank can be
slowed by real extra work in its forward pass, as a degraded GPU or a throttled host would be.

Run 4 ranks (any launcher that sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, e.g. torchrun)::

    torchrun --nproc-per-node 4 examples/train_gloo.py --job my-job --steps 40 --slow-rank 2
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn

from argus.core.settings import Settings
from argus.producers.tracer import Tracer  # argus
from argus.schemas.records import ParallelGroup, PhaseKind  # argus


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.self_attention = nn.Sequential(nn.Linear(width, width), nn.Tanh())
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attention(x)
        return x + self.mlp(x)


def extra_work(ms: float) -> None:
    """Real compute for ``ms`` milliseconds (the injected slowdown)."""
    a = torch.randn(128, 128)
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        a = torch.tanh(a @ a)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--job", required=True)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--slow-rank", type=int, default=-1)
    ap.add_argument("--slow-ms", type=float, default=40.0)
    ap.add_argument("--width", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(*(Block(args.width) for _ in range(2)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = torch.randn(32, args.width)

    tracer = Tracer(Settings.load(), args.job, rank, world).start()  # argus
    tracer.instrument(model)  # argus: phases for every self_attention / mlp submodule
    tracer.instrument_optimizer(opt)  # argus
    try:
        for _ in range(args.steps):
            with tracer.step():  # argus
                with tracer.phase("forward", PhaseKind.FORWARD):  # argus
                    loss = model(data).square().mean()
                    if rank == args.slow_rank:
                        extra_work(args.slow_ms)
                with tracer.phase("backward", PhaseKind.BACKWARD):  # argus
                    opt.zero_grad()
                    loss.backward()
                grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
                tracer.all_reduce(grads, parallel_group=ParallelGroup.DP)  # argus: timed as dp-allreduce
                offset = 0
                for p in model.parameters():
                    if p.grad is not None:
                        n = p.grad.numel()
                        p.grad.copy_(grads[offset:offset + n].view_as(p.grad) / world)
                        offset += n
                opt.step()
    finally:
        tracer.close()  # argus: collective (sums the record counts for END); every rank calls it
        dist.destroy_process_group()
    if rank == 0 and os.environ.get("ARGUS_EXAMPLE_QUIET") != "1":
        print(f"job {args.job}: {args.steps} steps on {world} ranks done")


if __name__ == "__main__":
    main()
