"""A plain DistributedDataParallel job (gloo, CPU) traced by one line: ``argus.attach(model, optimizer)``.

Everything else is an ordinary training script: argus finds the rank, the world size and the job id in the
launcher's environment (``ARGUS_JOB_ID``, else torchrun's run id), times the forward, the backward, every DDP
gradient bucket's all-reduce and the optimizer step, marks an iteration at each ``optimizer.step()``, and
closes at ``destroy_process_group()``. ``--slow-rank R --slow-ms MS`` adds real compute to rank R's forward,
as a degraded GPU or a throttled host would.

Run 4 ranks (the Kafka settings come from ``ARGUS_*`` variables, see ``argus.core.settings``)::

    ARGUS_JOB_ID=ddp-demo torchrun --nproc-per-node 4 examples/train_ddp.py --steps 40 --slow-rank 2
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import argus


def extra_work(ms: float) -> None:
    """Real compute for ``ms`` milliseconds (the injected slowdown)."""
    a = torch.randn(128, 128)
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        a = torch.tanh(a @ a)


class Net(nn.Module):
    def __init__(self, width: int, depth: int, slow_ms: float = 0.0) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(),
                                                    nn.Linear(2 * width, width)) for _ in range(depth)))
        self.head = nn.Linear(width, 1)
        self.slow_ms = slow_ms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.slow_ms > 0:
            extra_work(self.slow_ms)
        return self.head(self.layers(x))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--slow-rank", type=int, default=-1)
    ap.add_argument("--slow-ms", type=float, default=40.0)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--bucket-mb", type=float, default=0.05, help="DDP bucket size (small: several buckets)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = Net(args.width, args.depth, slow_ms=args.slow_ms if rank == args.slow_rank else 0.0)
    model = DistributedDataParallel(net, bucket_cap_mb=args.bucket_mb)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    argus.attach(model, optimizer)  # the only argus line

    data = torch.randn(32, args.width)
    target = torch.randn(32, 1)
    for _ in range(args.steps):
        loss = (model(data) - target).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    dist.destroy_process_group()  # argus closes its tracer here (the job's record counts go into END)
    if rank == 0 and os.environ.get("ARGUS_EXAMPLE_QUIET") != "1":
        print(f"{args.steps} steps on {world} ranks done")


if __name__ == "__main__":
    main()
