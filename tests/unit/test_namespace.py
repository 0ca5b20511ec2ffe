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
    files = {p.resolve() for top in ("argus", *STAGES, "tests", "load_tests", "examples", "scripts")
             for p in (ROOT / top).rglob("*.py")}
    return sorted(files)


def test_no_module_imports_a_bare_stage() -> None:
    bad = [f"{p.relative_to(ROOT.resolve())}: {m.group(0).strip()}" for p in _sources()
           for m in _BARE.finditer(p.read_text(encoding="utf-8"))]
    assert not bad, bad


def test_stages_are_subpackages_of_argus() -> None:
    import argus.detectors.l3_kernels as l3
    import argus.producers.tracer as tracer

    assert Path(tracer.__file__).parent.name == "producers"
    assert l3.__name__ == "argus.detectors.l3_kernels"
    for stage in STAGES:
        link = ROOT / "argus" / stage
        assert link.is_symlink() and link.resolve() == (ROOT / stage).resolve(), stage


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
    for top in ("argus", *STAGES):
        shutil.copytree(ROOT / top, src / top, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(src)], check=True, capture_output=True, cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"argus"}
    for stage in STAGES:
        assert f"argus/{stage}/__init__.py" in names, stage
    assert "argus/schemas/finding.v4.avsc" in names
