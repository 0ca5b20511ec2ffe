"""A local torch.distributed job for integration tests: one process per rank of a training script, with the
environment torchrun would give it plus the test's argus settings, waited for with each rank's log on failure."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from argus.core.settings import Settings
from tests.integration.conftest import _free_port

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def run_ranks(script: Path, args: Sequence[str], *, world: int, settings: Settings, log_dir: Path,
              extra_env: Mapping[str, str] | None = None, python: str = sys.executable,
              base_env: Mapping[str, str] | None = None, cwd: Path = ROOT, timeout_s: float = 300) -> None:
    """Run ``python script *args`` as ranks ``0 .. world-1`` of one gloo job (loopback rendezvous on a free
    port), each with ``settings`` as ``ARGUS_*`` variables, ``extra_env`` on top, one thread, and its log in
    ``log_dir/rank<R>.log``; rank registries under ``log_dir/ranks``.

    ``base_env`` is the environment the ranks start from (default: this process's), e.g. without
    ``PYTHONPATH`` for a Python that must import its own installed argus.

    Raises:
        AssertionError: a rank exited non-zero (with the tail of its log) or ran past ``timeout_s`` seconds.
    """
    port = _free_port()
    procs = []
    try:
        for rank in range(world):
            env = {**(os.environ if base_env is None else base_env), **settings.to_env(), "RANK": str(rank),
                   "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "ARGUS_EXAMPLE_QUIET": "1",
                   "ARGUS_RANK_REGISTRY": str(log_dir / "ranks"), "OMP_NUM_THREADS": "1", **(extra_env or {})}
            log = open(log_dir / f"rank{rank}.log", "wb")  # noqa: SIM115 - closed below
            procs.append((subprocess.Popen([python, str(script), *args], env=env, stdout=log,
                                           stderr=subprocess.STDOUT, cwd=cwd), log))
        for rank, (proc, _) in enumerate(procs):
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired as exc:
                raise AssertionError(f"rank {rank} still running after {timeout_s:.0f} s:\n"
                                     f"{(log_dir / f'rank{rank}.log').read_text()[-3000:]}") from exc
            assert rc == 0, (log_dir / f"rank{rank}.log").read_text()[-3000:]
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
