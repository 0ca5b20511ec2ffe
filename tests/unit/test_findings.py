"""Detector results as Finding records (argus.detectors.findings)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from argus.core.errors import DetectorError, SchemaError
from argus.core.kinds import FindingKind
from argus.detectors import L1Result, L2Result, L3Result, finding_id, to_finding, to_findings
from argus.schemas.records import Finding, Level

T = 1_767_225_600_000_000_000
KINDS = {
    FindingKind.ITERATION_SPIKE: "iteration_spike", FindingKind.STEP_REGRESSION: "step_regression",
    FindingKind.COMPUTE_STRAGGLER: "compute_straggler", FindingKind.PHASE_STRAGGLER: "phase_straggler",
    FindingKind.PP_STAGE_SLOW: "pp_stage_slow", FindingKind.KERNEL_DEGRADED: "kernel_degraded",
    FindingKind.LINK_DEGRADED: "link_degraded", FindingKind.LATE_ARRIVAL: "late_arrival",
}


def test_kind_strings() -> None:
    for kind, value in KINDS.items():
        assert kind.value == value
    assert len({k.value for k in FindingKind}) == len(FindingKind)  # distinct across levels
    assert {k.level for k in FindingKind} == set(Level)


def test_old_kind_names_read_as_their_members() -> None:
    # Before the kinds were one enum, the L3 late arrival was 'compute_straggler', like the L2 straggler.
    assert FindingKind.of("L3", "compute_straggler") is FindingKind.LATE_ARRIVAL
    assert FindingKind.of(Level.L2, "compute_straggler") is FindingKind.COMPUTE_STRAGGLER
    new = Finding("id", "j", Level.L3, FindingKind.LATE_ARRIVAL, (3,), (), 5.0, "{}", 1)
    old = dict(new.to_avro(), kind="compute_straggler")
    assert Finding.from_avro(old).kind is FindingKind.LATE_ARRIVAL
    assert Finding("id", "j", Level.L3, "compute_straggler", (3,), (), 5.0, "{}", 1).kind is FindingKind.LATE_ARRIVAL  # type: ignore[arg-type]
    with pytest.raises(SchemaError, match="unknown kind"):
        Finding.from_avro(dict(old, kind="no_such_kind"))
    with pytest.raises(SchemaError, match="of level L3"):
        Finding("id", "j", Level.L1, FindingKind.LATE_ARRIVAL, (3,), (), 5.0, "{}", 1).check()


def test_l1_finding() -> None:
    res = L1Result(FindingKind.ITERATION_SPIKE, (12,), 3.0, {"spike_ratio": np.float64(3.0),
                                                              "host_side": np.bool_(True), "gpu_ms": float("nan"),
                                                              "peak_step": np.int64(12)})
    f = to_finding("job-1", res, T)
    assert (f.level, f.kind, f.ranks, f.steps, f.phase, f.kernel, f.stream) == (
        Level.L1, "iteration_spike", (), (12,), None, None, None)
    assert f.score == 3.0 and f.time_ns == T and f.job_id == "job-1"
    assert f.evidence == {"spike_ratio": 3.0, "host_side": True, "gpu_ms": None, "peak_step": 12}
    assert f.evidence_json == json.dumps(f.evidence, sort_keys=True, separators=(",", ":"))
    assert len(f.finding_id) == 40 and int(f.finding_id, 16) >= 0


def test_l2_and_l3_findings_roundtrip_avro() -> None:
    l2 = L2Result(FindingKind.PP_STAGE_SLOW, (7, 6), "backward", 1.9, {"stage_per_occurrence_ms": {3: 17.6, "0": 9.3},
                                                                "phases": ("a", "b")})
    l3 = L3Result(FindingKind.LINK_DEGRADED, (4, 5, 6, 7), "ncclDevKernel_AllReduce", 13, 8.0,
                  {"w1_inter_over_intra_ratio": 179.0, "ranks": np.array([4, 5])})
    f2, f3 = to_findings("j", [l2, l3], T)
    assert (f2.level, f2.kind, f2.ranks, f2.phase, f2.kernel) == (Level.L2, "pp_stage_slow", (6, 7), "backward", None)
    assert f2.evidence == {"phases": ["a", "b"], "stage_per_occurrence_ms": {"0": 9.3, "3": 17.6}}
    assert (f3.level, f3.kind, f3.ranks, f3.kernel, f3.stream, f3.phase) == (
        Level.L3, "link_degraded", (4, 5, 6, 7), "ncclDevKernel_AllReduce", 13, None)
    assert f3.evidence["ranks"] == [4, 5]
    for f in (f2, f3):
        back = Finding.decode(f.encode())
        assert back == f


def test_ids_are_deterministic_and_separate_identities() -> None:
    base = L3Result(FindingKind.KERNEL_DEGRADED, (3,), "gemm", 7, 1.0, {"a": 1})
    same = L3Result(FindingKind.KERNEL_DEGRADED, (3,), "gemm", 7, 2.5, {"b": 2})  # score/evidence are no identity
    assert to_finding("j", base, T).finding_id == to_finding("j", same, T + 5).finding_id
    variants = [
        to_finding("k", base, T),
        to_finding("j", L3Result(FindingKind.KERNEL_DEGRADED, (4,), "gemm", 7, 1.0), T),
        to_finding("j", L3Result(FindingKind.KERNEL_DEGRADED, (3,), "gemm2", 7, 1.0), T),
        to_finding("j", L3Result(FindingKind.KERNEL_DEGRADED, (3,), "gemm", 8, 1.0), T),
        to_finding("j", L3Result(FindingKind.LINK_DEGRADED, (3,), "gemm", 7, 1.0), T),
        to_finding("j", L2Result(FindingKind.COMPUTE_STRAGGLER, (3,), "gemm", 1.0), T),
        to_finding("j", L2Result(FindingKind.COMPUTE_STRAGGLER, (3,), "mlp", 1.0), T),
        to_finding("j", L1Result(FindingKind.ITERATION_SPIKE, (3,), 1.0), T),
        to_finding("j", L1Result(FindingKind.ITERATION_SPIKE, (4,), 1.0), T),
    ]
    ids = {f.finding_id for f in variants} | {to_finding("j", base, T).finding_id}
    assert len(ids) == len(variants) + 1


@settings(max_examples=50, deadline=None)
@given(ranks=st.lists(st.integers(0, 10_000), max_size=20), steps=st.lists(st.integers(0, 10**6), max_size=5),
       phase=st.one_of(st.none(), st.text(max_size=10)), kernel=st.one_of(st.none(), st.text(max_size=10)))
def test_finding_id_ignores_rank_order_only(ranks: list[int], steps: list[int], phase: str | None,
                                            kernel: str | None) -> None:
    a = finding_id("j", "L2", "k", ranks, phase, kernel, None, steps)
    assert a == finding_id("j", "L2", "k", list(reversed(ranks)), phase, kernel, None, steps)
    assert a != finding_id("j", "L3", "k", ranks, phase, kernel, None, steps)
    assert a != finding_id("j", "L2", "k", ranks, phase, kernel, None, [*steps, -1])


def test_bad_input_raises() -> None:
    ok = L1Result(FindingKind.STEP_REGRESSION, (15,), 20.0)
    with pytest.raises(DetectorError):
        to_finding("", ok, T)
    with pytest.raises(DetectorError):
        to_finding("j", ok, -1)
    with pytest.raises(DetectorError):
        to_finding("j", L1Result(FindingKind.STEP_REGRESSION, (15,), math.inf), T)
    with pytest.raises(DetectorError):
        to_finding("j", L1Result(FindingKind.STEP_REGRESSION, (15,), 2.0, {"x": object()}), T)
