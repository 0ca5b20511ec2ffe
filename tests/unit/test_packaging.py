"""The distribution's dependency declarations (pyproject.toml) against the exact versions CI installs
(constraints.txt) and against what the rank side really imports; ``python -m argus`` and the extras' errors.

The clean-install counterpart (a wheel in a fresh venv, a gloo job from it) is
tests/integration/test_rank_install.py.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, distribution

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from argus.core.errors import ArgusError
from argus.core.extras import Extra, MissingExtraError, extra_of, install_hint, missing_extra, require_extra
from tests.rank_venv import CONSTRAINTS, RANK_MODULES, ROOT, SERVER_MODULES

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
SELF = canonicalize_name(PYPROJECT["name"])


def _requirements(group: str | None = None) -> list[Requirement]:
    lines = PYPROJECT["dependencies"] if group is None else PYPROJECT["optional-dependencies"][group]
    return [r for r in map(Requirement, lines) if canonicalize_name(r.name) != SELF]


def _all_requirements() -> list[Requirement]:
    return [r for g in (None, *PYPROJECT["optional-dependencies"]) for r in _requirements(g)]


def _pins() -> dict[str, str]:
    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep and version, f"constraints.txt: {line!r} is not an exact pin (name==version)"
            pins[canonicalize_name(name)] = version
    return pins


def test_base_distribution_is_the_rank_side() -> None:
    names = {canonicalize_name(r.name) for r in _requirements()}
    assert names == {"confluent-kafka", "fastavro", "numpy", "prometheus-client"}
    server = {canonicalize_name(r.name) for r in _requirements("server")}
    assert {"faust-streaming", "aiokafka", "scipy", "numba", "clickhouse-connect", "chdb", "pyarrow", "ijson",
            "plotly", "tqdm"} <= server
    assert {canonicalize_name(r.name) for r in _requirements("rank")} >= {"torch"}
    assert {canonicalize_name(r.name) for r in _requirements("gpu")} >= {"cupti-python"}


def test_every_dependency_is_a_bounded_range_never_a_pin() -> None:
    for req in _all_requirements():
        ops = {spec.operator for spec in req.specifier}
        assert ops & {">=", ">"} and ops & {"<"}, f"{req}: needs a lower and an upper bound"
        assert not ops & {"==", "===", "~="}, f"{req}: a range, not a pin (exact versions go to constraints.txt)"


def test_constraints_pin_every_dependency_inside_its_range() -> None:
    pins = _pins()
    assert SELF not in pins
    for req in _all_requirements():
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is not pinned in constraints.txt"
        assert req.specifier.contains(pins[name], prereleases=True), f"{req}: constraints.txt has {pins[name]}"


def test_installed_versions_are_the_constraints() -> None:
    """scripts/setup installs with ``-c constraints.txt``; a pin that differs from the environment the tests
    run in was never tested."""
    wrong = {}
    for name, version in _pins().items():
        try:
            installed = distribution(name).version
        except PackageNotFoundError:
            continue  # another platform's package (the pins were frozen on Linux x86_64)
        if installed != version:
            wrong[name] = (version, installed)
    assert not wrong, f"constraints.txt (pinned, installed): {wrong}"


def test_pins_satisfy_each_others_requirements() -> None:
    """One consistent set: e.g. faust-streaming caps click, and the click pin must be under that cap."""
    pins = _pins()
    broken = []
    for name in pins:
        try:
            requires = distribution(name).requires or []
        except PackageNotFoundError:
            continue
        for req in map(Requirement, requires):
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            pinned = pins.get(canonicalize_name(req.name))
            if pinned is not None and not req.specifier.contains(pinned, prereleases=True):
                broken.append(f"{name} requires {req}, constraints.txt pins {pinned}")
    assert not broken, broken


@pytest.mark.slow
def test_rank_side_imports_nothing_of_the_server() -> None:
    """In this (full) environment: what the rank side loads beyond torch holds no module of the server extra
    (torch may load some on its own, e.g. tqdm; those are not argus's)."""
    code = ("import importlib, sys\nimport torch\nbefore = set(sys.modules)\n"
            f"for m in {list(RANK_MODULES)!r}:\n    importlib.import_module(m)\n"
            f"print(sorted({{m.partition('.')[0] for m in set(sys.modules) - before}} & {set(SERVER_MODULES)!r}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]", proc.stdout


def test_python_m_argus_is_the_cli() -> None:
    proc = subprocess.run([sys.executable, "-m", "argus", "--help"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: argus")


def test_py_typed_is_shipped() -> None:
    assert (ROOT / "argus" / "py.typed").is_file()
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "py.typed" in package_data["argus"]


def test_missing_extra_names_the_extra_and_the_pip_command() -> None:
    error = missing_extra(ModuleNotFoundError("No module named 'chdb'", name="chdb"), "argus sql")
    assert isinstance(error, MissingExtraError) and isinstance(error, ArgusError)
    assert isinstance(error, ModuleNotFoundError) and error.name == "chdb" and error.extra is Extra.SERVER
    assert str(error) == ("argus sql needs the 'server' extra (chdb is not installed): "
                          "pip install 'argus-failslow[server]'")
    assert extra_of("scipy.special") is Extra.SERVER and extra_of("torch.distributed") is Extra.RANK
    assert extra_of("cupti") is Extra.GPU
    # A module of no extra is a broken installation, not a missing extra: the caller re-raises it.
    assert missing_extra(ModuleNotFoundError("No module named 'numpy'", name="numpy"), "x") is None
    assert missing_extra(ModuleNotFoundError("no name"), "x") is None
    assert "torch>=2.4,<3" in install_hint(Extra.RANK)


def test_every_extras_module_is_declared_by_its_extra() -> None:
    """The import names the hints map to an extra come from distributions that extra declares (directly or
    through them): a module moved out of the server extra must leave the map too."""
    declared = {canonicalize_name(r.name) for r in _requirements("server")}
    for module in SERVER_MODULES:
        assert extra_of(module) is Extra.SERVER, module
    providers = {"faust": "faust-streaming", "mode": "faust-streaming", "llvmlite": "numba",
                 "clickhouse_connect": "clickhouse-connect"}
    for module in SERVER_MODULES:
        assert canonicalize_name(providers.get(module, module)) in declared, module


def test_require_extra_passes_where_the_extra_is_installed() -> None:
    require_extra(Extra.SERVER, "argus up")  # this environment has every extra (scripts/setup)
    require_extra(Extra.RANK, "argus.attach")


@pytest.mark.parametrize("extra", list(Extra))
def test_every_extra_is_declared(extra: Extra) -> None:
    assert extra.value in PYPROJECT["optional-dependencies"]
