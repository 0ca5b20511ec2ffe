"""``python -m argus.warmup`` (run by scripts/setup and the image build) leaves every kernel the worker's
diagnosis and decoding call compiled in numba's cache."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]


def test_warmup_compiles_the_kernels_of_diagnosis_and_decoding() -> None:
    done = subprocess.run([sys.executable, "-m", "argus.warmup"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("argus: diagnosis kernels ready (") and done.stdout.endswith(" s)\n")
    cached = {p.name.split("-")[0] for p in ROOT.glob("argus/*/__pycache__/*.nbi")}
    # One kernel of each stage it is for: compression (KDE valleys), L3 (CDF grid), L2 (phase folding), the
    # job agent's columnar decode (steps, phases) and the kernel batches' column unpacking.
    assert {"kde_valleys._group_cuts", "cdf_grid._row_cdf", "phase_fold._fold", "step_reading._scan_steps",
            "phase_reading._scan_many", "column_unpacking._offset"} <= cached, sorted(cached)


def test_warmup_takes_no_arguments() -> None:
    done = subprocess.run([sys.executable, "-m", "argus.warmup", "--steps", "3"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and not done.stdout and "unrecognized arguments: --steps 3" in done.stderr
    assert "Traceback" not in done.stderr
