"""A clean virtualenv with what a training host gets from ``pip install argus-failslow`` (the rank side, no
extras) next to a torch it already had: for the rank-install test and the rank footprint benchmark.

How it is built, without downloading torch (gigabytes) and without ``--system-site-packages``:

1. a wheel of the checkout, built from a copy of its sources (a stale ``build/`` in the checkout cannot leak
   into it) with this interpreter's setuptools (``--no-build-isolation``: nothing downloaded);
2. ``python -m venv --without-pip``: the venv holds nothing but what step 3 installs, so its size is the rank
   side's alone;
3. this interpreter's pip installs the wheel into it (``pip --python``) with the project's constraints: the
   base dependencies resolved as a user's pip resolves them, pinned to the versions CI tests;
4. torch as the training image's: a directory of symlinks to the installed files of torch and of the
   distributions it requires (read from their metadata: sympy, networkx, jinja2, triton, nvidia-*, ...),
   appended to the venv's ``sys.path`` by a ``.pth`` file. Their ``.dist-info`` come along, so pip and
   ``importlib.metadata`` in the venv see torch as installed, as on a real image; nothing else of this
   environment (scipy, numba, chDB, Faust, ...) is visible there.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from importlib.metadata import Distribution, distribution
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement

__all__ = ["CONSTRAINTS", "IMAGE_DISTRIBUTIONS", "RANK_MODULES", "SERVER_MODULES", "RankVenv", "beyond_image_bytes",
           "build_overlay", "build_rank_venv", "build_wheel", "clean_env", "installed_bytes", "probe",
           "torch_closure"]

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "constraints.txt"
#: Import names of the server extra that must not be importable (nor imported) on the rank side.
SERVER_MODULES = ("scipy", "numba", "llvmlite", "chdb", "clickhouse_connect", "faust", "mode", "aiokafka",
                  "pyarrow", "plotly", "ijson", "tqdm")
#: What a rank process can import of argus (``argus.attach`` and what it loads, the pieces it starts on
#: demand, the framework integrations' package) and ``argus stacks``' collector.
RANK_MODULES = ("argus", "argus.producers.attach", "argus.producers.tracer", "argus.producers.publisher",
                "argus.producers.heartbeat", "argus.producers.publisher_metrics", "argus.producers.cupti_kernels",
                "argus.integrations", "argus.producers.cpu_stacks")
#: What a training image already has: not counted in the rank side's footprint.
IMAGE_DISTRIBUTIONS = ("numpy",)
#: The checkout's files a wheel is built from (the Dockerfile copies the same).
_SOURCES = ("pyproject.toml", "README.md", "argus")


@dataclass(frozen=True)
class RankVenv:
    """A built clean venv: its interpreter, its ``site-packages`` and the torch overlay directory."""

    root: Path
    python: Path
    site_packages: Path
    overlay: Path
    wheel: Path

    def run(self, code: str, timeout_s: float = 300, cwd: Path | None = None) -> str:
        """Run ``code`` with the venv's Python outside the checkout (no ``PYTHONPATH``); its stdout.

        Raises:
            AssertionError: the code exited non-zero (with its output).
        """
        proc = subprocess.run([str(self.python), "-c", code], env=clean_env(), cwd=cwd or self.root,
                              capture_output=True, text=True, timeout=timeout_s)
        assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        return proc.stdout


def clean_env() -> dict[str, str]:
    """This process's environment without what would point a Python at this checkout or this venv."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def torch_closure() -> list[Distribution]:
    """torch and every distribution it requires, transitively (extras and markers evaluated here).

    Raises:
        PackageNotFoundError: torch (or one of its requirements) is not installed in this environment.
    """
    found: dict[str, Distribution] = {}
    seen: set[tuple[str, frozenset[str]]] = set()
    todo: list[tuple[str, frozenset[str]]] = [("torch", frozenset())]
    while todo:
        name, extras = todo.pop()
        if (_canonical(name), extras) in seen:
            continue
        seen.add((_canonical(name), extras))
        dist = found.setdefault(_canonical(name), distribution(name))
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in ("", *extras)):
                todo.append((req.name, frozenset(req.extras)))
    return list(found.values())


def build_overlay(dest: Path) -> Path:
    """``dest`` filled with symlinks to the top-level files of :func:`torch_closure` (packages, modules,
    ``.dist-info``); shared namespace directories (``nvidia``, ``cuda``) are linked once, whole."""
    dest.mkdir(parents=True, exist_ok=True)
    for dist in torch_closure():
        for file in dist.files or []:
            top = file.parts[0]
            if top in ("..", "__pycache__") or top.endswith(".pth") or (dest / top).is_symlink():
                continue
            target = Path(str(dist.locate_file(top)))
            if target.exists():
                (dest / top).symlink_to(target)
    return dest


def build_wheel(dest: Path) -> Path:
    """A wheel of the checkout (no dependencies), built in ``dest`` from a copy of its sources."""
    src = dest / "src"
    for name in _SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
        else:
            src.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(dest / "wheels"), str(src)], check=True, capture_output=True, timeout=300)
    (wheel,) = (dest / "wheels").glob("argus_failslow-*.whl")
    return wheel


def build_rank_venv(dest: Path, extras: str = "") -> RankVenv:
    """The clean venv of the module docstring in ``dest`` (created), with ``argus-failslow[extras]``.

    Raises:
        subprocess.CalledProcessError: the wheel could not be built or installed (pip's output attached).
        PackageNotFoundError: torch is not installed in this environment.
    """
    wheel = build_wheel(dest / "build")
    venv = dest / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True, env=clean_env()).stdout.strip())
    requirement = f"{wheel}[{extras}]" if extras else str(wheel)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                    "-c", str(CONSTRAINTS), requirement], check=True, capture_output=True, timeout=600,
                   env=clean_env())
    overlay = build_overlay(dest / "torch-overlay")
    (site / "_torch_overlay.pth").write_text(f"{overlay}\n")
    return RankVenv(root=dest, python=python, site_packages=site, overlay=overlay, wheel=wheel)


_SIZES = """
import json, sys
from importlib.metadata import distributions
from pathlib import Path
site = Path(sys.argv[1]).resolve()
sizes = {}
for d in distributions(path=[str(site)]):
    total = 0
    for f in d.files or []:
        p = Path(str(d.locate_file(f)))
        if p.is_file() and not p.is_symlink():
            total += p.stat().st_size
    sizes[d.metadata["Name"]] = total
print(json.dumps(sizes))
"""


_PROBE = """
import importlib, importlib.util, json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
for name in sys.argv[1].split(","):
    importlib.import_module(name)
t2 = time.perf_counter()
import argus
server = sys.argv[2].split(",")
print(json.dumps({"torch_s": t1 - t0, "argus_s": t2 - t1, "argus_file": argus.__file__,
                  "torch_version": torch.__version__,
                  "server_loaded": sorted(m for m in sys.modules if m.partition(".")[0] in server),
                  "server_importable": [m for m in server if importlib.util.find_spec(m) is not None]}))
"""


def probe(venv: RankVenv) -> dict[str, Any]:
    """One fresh process of the venv importing torch, then :data:`RANK_MODULES`: ``torch_s`` and ``argus_s``
    (seconds each took), ``argus_file`` (where argus came from), ``torch_version``, ``server_loaded`` (modules of
    :data:`SERVER_MODULES` the imports loaded) and ``server_importable`` (those installed at all)."""
    proc = subprocess.run([str(venv.python), "-c", _PROBE, ",".join(RANK_MODULES), ",".join(SERVER_MODULES)],
                          capture_output=True, text=True, env=clean_env(), cwd=venv.root, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def installed_bytes(venv: RankVenv) -> dict[str, int]:
    """Bytes on disk of each distribution installed in the venv itself (not the torch overlay), by name."""
    proc = subprocess.run([str(venv.python), "-c", _SIZES, str(venv.site_packages)], check=True,
                          capture_output=True, text=True, env=clean_env(), timeout=120)
    sizes: dict[str, int] = json.loads(proc.stdout)
    return sizes


def beyond_image_bytes(sizes: dict[str, int]) -> int:
    """What the rank side adds to a training image: every installed distribution but the image's own."""
    image = {_canonical(n) for n in IMAGE_DISTRIBUTIONS}
    return sum(size for name, size in sizes.items() if _canonical(name) not in image)

