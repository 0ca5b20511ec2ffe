"""Diagnosis of real third-party traces (../shared/realtraces), through the in-process stream pipeline.

Unmodified, a healthy real job raises no finding above the impact threshold; with one rank's kernels slowed,
that rank -- and only it -- is named. Runs where the real traces are present next to the repository.
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path
from typing import Any

import pytest

from argus.streams.offline import diagnose_traces

REAL = Path(__file__).resolve().parents[2].parent / "shared" / "realtraces"
DLRM = REAL / "param_dlrm_8rank_v100" / "dlrm_kineto"
HTA = REAL / "hta_sampled_2rank"
needs_real = pytest.mark.skipif(not REAL.is_dir(), reason=f"{REAL} is absent")


def _load(directory: Path) -> dict[str, dict[str, Any]]:
    out = {}
    for p in sorted(directory.iterdir()):
        raw = gzip.decompress(p.read_bytes()) if p.name.endswith(".gz") else p.read_bytes()
        out[p.name.removesuffix(".gz")] = json.loads(raw)
    return out


def _write(traces: dict[str, dict[str, Any]], out: Path, rank: int | None = None, factor: float = 1.0,
           pattern: str = ".") -> Path:
    """The traces under ``out``, with ``rank``'s GPU kernels matching ``pattern`` ``factor`` times longer."""
    out.mkdir(parents=True, exist_ok=True)
    for name, trace in traces.items():
        if trace.get("distributedInfo", {}).get("rank") == rank:
            trace = json.loads(json.dumps(trace))
            for e in trace["traceEvents"]:
                if str(e.get("cat", "")).lower() == "kernel" and re.search(pattern, e["name"], re.IGNORECASE):
                    e["dur"] = e["dur"] * factor
        (out / name).write_text(json.dumps(trace))
    return out


def _named(findings: list[dict[str, Any]]) -> set[int]:
    return {r for f in findings for r in f["ranks"]}


@pytest.fixture(scope="module")
def dlrm() -> dict[str, dict[str, Any]]:
    return _load(DLRM)


@needs_real
def test_unmodified_real_traces_raise_nothing(dlrm: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    assert diagnose_traces(_write(dlrm, tmp_path / "dlrm"), "dlrm") == []
    assert diagnose_traces(_write(_load(HTA), tmp_path / "hta"), "hta") == []


@pytest.mark.slow
@needs_real
@pytest.mark.parametrize(("rank", "factor"), [(0, 1.3), (3, 1.5), (5, 2.0), (7, 1.3)])
def test_a_slowed_rank_of_the_dlrm_job_is_named_alone(dlrm: dict[str, dict[str, Any]], tmp_path: Path,
                                                      rank: int, factor: float) -> None:
    found = diagnose_traces(_write(dlrm, tmp_path, rank, factor), "dlrm")
    assert found and _named(found) == {rank}
    top = found[0]
    assert top["impact_ns"] > 0 and top["evidence"]["delay_ms_per_step"] > 0
    assert [f["impact_ns"] for f in found] == sorted((f["impact_ns"] for f in found), reverse=True)


@needs_real
@pytest.mark.parametrize(("rank", "factor"), [(0, 1.3), (1, 1.5)])
def test_a_slowed_rank_of_a_two_rank_job_is_named_alone(tmp_path: Path, rank: int, factor: float) -> None:
    found = diagnose_traces(_write(_load(HTA), tmp_path, rank, factor), "hta")
    assert _named(found) == {rank}
    assert {f["kind"] for f in found} <= {"rank_degraded", "kernel_degraded"}
