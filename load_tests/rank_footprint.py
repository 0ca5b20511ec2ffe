"""Benchmark: what ``pip install argus-failslow`` (the rank side, no extras) adds to a training image.

A clean virtualenv (no ``--system-site-packages``) gets a wheel of this checkout with the versions of
``constraints.txt``, and the torch of this environment (with the distributions it requires) made visible as a
training image's own, without copying or downloading it (see ``tests/rank_venv.py``). Measured there:

* ``installed_mb_beyond_image``: megabytes on disk (files as installed, ``.pyc`` included) of every
  distribution the install put into the venv, but numpy, which a training image has (budget 40 MB;
  confluent-kafka with its bundled librdkafka and fastavro take most of it), and ``installed_mb`` per
  distribution;
* ``import_s_beyond_torch``: seconds to import what a rank process loads of argus (``argus.attach`` and the
  tracer, the publisher, the heartbeat, publisher metrics, CUPTI, the integrations' package, ``argus stacks``'
  collector) after ``import torch``, the median over ``--repeats`` fresh processes (budget 0.3 s), beside
  ``torch_import_s`` (torch's own, for scale);
* ``server_modules_importable`` and ``server_modules_loaded``: modules of the ``server`` extra (scipy, numba,
  chDB, Faust, ...) installed in the venv at all, and loaded by those imports: both must be empty.

Prints one JSON line; exits 1 if a budget is missed.
Run: .venv/bin/python load_tests/rank_footprint.py [--repeats 7] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.rank_venv import (  # noqa: E402
    RankVenv,
    beyond_image_bytes,
    build_rank_venv,
    installed_bytes,
    probe,
)

BUDGET_INSTALLED_MB = 40.0
BUDGET_IMPORT_S = 0.3


def measure(venv: RankVenv, repeats: int) -> dict[str, Any]:
    """The figures of the module docstring for a built venv, with ``within_budget``."""
    sizes = installed_bytes(venv)
    probes = [probe(venv) for _ in range(repeats)]
    beyond_mb = beyond_image_bytes(sizes) / 1e6
    import_s = statistics.median(p["argus_s"] for p in probes)
    importable = probes[0]["server_importable"]
    loaded = sorted({m for p in probes for m in p["server_loaded"]})
    out: dict[str, Any] = {
        "benchmark": "rank_footprint",
        "installed_mb_beyond_image": round(beyond_mb, 2),
        "installed_mb": {name: round(size / 1e6, 2) for name, size in sorted(sizes.items())},
        "import_s_beyond_torch": round(import_s, 4),
        "import_s_samples": [round(p["argus_s"], 4) for p in probes],
        "torch_import_s": round(statistics.median(p["torch_s"] for p in probes), 3),
        "torch_version": probes[0]["torch_version"],
        "server_modules_importable": importable,
        "server_modules_loaded": loaded,
        "budget": {"installed_mb_beyond_image": BUDGET_INSTALLED_MB, "import_s_beyond_torch": BUDGET_IMPORT_S},
    }
    out["within_budget"] = bool(beyond_mb <= BUDGET_INSTALLED_MB and import_s <= BUDGET_IMPORT_S
                                and not importable and not loaded)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7, help="fresh processes timed (default 7; the median counts)")
    ap.add_argument("--keep", type=Path, default=None,
                    help="build the venv in this (new or empty) directory and keep it (default: a temporary one)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    if args.keep is not None:
        out = measure(build_rank_venv(args.keep), args.repeats)
    else:
        with tempfile.TemporaryDirectory(prefix="argus-rank-venv-") as tmp:
            out = measure(build_rank_venv(Path(tmp)), args.repeats)
    sys.stdout.write(json.dumps(out) + "\n")
    return 0 if out["within_budget"] else 1


if __name__ == "__main__":
    sys.exit(main())
