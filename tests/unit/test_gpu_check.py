"""scripts/gpu-check's CPU part, as CI runs it: one JSON line with the CPU cost per kernel record and the GPU-side
logic's CPU tests passing, and (on a machine without CUDA) the GPU part skipped with a clear line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def test_gpu_check_cpu_part_and_clear_skip() -> None:
    args = ["--cpu-only"] if _cuda() else []  # a lent GPU is for scripts/gpu-check itself, not for CI
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu-check"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, done.stdout + done.stderr
    out = json.loads(lines[0])
    assert done.returncode == 0 and out["ok"] is True, out
    cost = out["cpu"]["record_cost"]
    assert cost["records"] == 100_000 and 0 < cost["ns_per_record"] < 1_000_000 and cost["wire_bytes_per_record"] > 0
    assert out["cpu"]["cpu_tests"]["passed"] >= 30 and not out["cpu"]["cpu_tests"].get("failed")
    assert "skipped" in out["gpu"]
    assert "gpu-check: GPU part skipped:" in done.stderr
    if not args:
        assert "no CUDA device" in out["gpu"]["skipped"]
