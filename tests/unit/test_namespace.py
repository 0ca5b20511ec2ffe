"""One import namespace: every module imports the stages as ``argus.<stage>``, and the wheel holds ``argus`` only."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STAGES = ("producers", "streams", "schemas", "sinks", "detectors")
_BARE = re.compile(rf"^\s*(?:from|import)\s+({'|'.join(STAGES)})(?:[.\s]|$)", re.M)


def _sources() -> list[Path]:
    return sorted(p for top in ("argus", "tests", "load_tests", "examples", "scripts")
                  for p in (ROOT / top).rglob("*.py"))


def test_no_module_imports_a_bare_stage() -> None:
    bad = [f"{p.relative_to(ROOT)}: {m.group(0).strip()}" for p in _sources()
           for m in _BARE.finditer(p.read_text(encoding="utf-8"))]
    assert not bad, bad


def test_stages_are_subpackages_of_argus() -> None:
    """Real folders inside ``argus/``, no symlinks: every tool that reads paths sees the package as it imports."""
    import argus.detectors.l3_kernels as l3
    import argus.producers.tracer as tracer

    assert Path(tracer.__file__).resolve() == ROOT / "argus" / "producers" / "tracer.py"
    assert l3.__name__ == "argus.detectors.l3_kernels"
    for stage in STAGES:
        assert (ROOT / "argus" / stage / "__init__.py").is_file(), stage
        assert not (ROOT / stage).exists(), f"{stage}/ at the top level: the stages live in argus/"
    links = [str(p.relative_to(ROOT)) for p in (ROOT / "argus").rglob("*") if p.is_symlink()]
    assert not links, links


def test_star_import_of_every_package() -> None:
    """``from argus.<package> import *`` works: every name of each ``__all__`` is defined."""
    packages = ["argus", "argus.core", "argus.integrations", *(f"argus.{stage}" for stage in STAGES)]
    code = ("import importlib, sys\n"
            f"for name in {packages!r}:\n"
            "    namespace = {}\n"
            "    exec(f'from {name} import *', namespace)\n"
            "    module = importlib.import_module(name)\n"
            "    missing = sorted(set(module.__all__) - set(namespace))\n"
            "    assert not missing, (name, missing)\n"
            "print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def _loaded_after(statement: str) -> list[str]:
    code = (f"import sys; {statement}; print([m for m in ('faust', 'torch', 'clickhouse_connect', 'chdb', "
            "'confluent_kafka') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    return list(eval(out.stdout.strip()))


@pytest.mark.slow
def test_entry_points_are_lazy() -> None:
    assert _loaded_after("import argus; argus.Settings; argus.ArgusError") == []
    heavy = _loaded_after("from argus import Tracer, attach")
    assert not {"faust", "clickhouse_connect", "chdb"} & set(heavy), heavy
    assert "clickhouse_connect" in _loaded_after("from argus import fetch_findings")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_wheel_holds_argus_only(tmp_path: Path) -> None:
    src = tmp_path / "src"  # a copy: building writes build/ and egg-info next to the sources
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "argus", src / "argus", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(src)], check=True, capture_output=True, cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"argus"}
    assert len(names) == len(set(names)), "a file twice in the wheel"
    shipped = {p.relative_to(src).as_posix() for p in (src / "argus").rglob("*")
               if p.suffix in (".py", ".avsc", ".xml") or p.name == "py.typed"}
    assert shipped - set(names) == set(), "every module, schema and data file of argus/ ships"
    for stage in STAGES:
        assert f"argus/{stage}/__init__.py" in names, stage
    assert "argus/schemas/finding.v4.avsc" in names
