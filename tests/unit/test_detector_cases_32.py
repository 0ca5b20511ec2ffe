"""The paper's five cases on the demo's 32-rank layout (DP 8 x TP 2 x PP 2, ``argus demo``), and no false
alarms on healthy jobs of that layout.

Unlike the paper's layouts, every rank here has a TP partner: a blocking TP all-reduce sits inside each
self_attention and mlp, so the partner of a slow rank waits there (a victim whose layer phases are as
long as the straggler's, and which arrives as late at its DP all-reduce), and a degraded TP link makes
the layers of its group long without any slow compute. Runs through the same pure-level pipeline as
:mod:`tests.unit.test_detector_cases` (and shares its cache).
"""

from __future__ import annotations

import dataclasses

import pytest

from argus.core.kinds import FindingKind
from argus.demo import build_spec
from argus.producers.sim_workload import K_ALL_REDUCE, TP_STREAM, GradSync
from argus.producers.simulator import JobSpec
from tests.unit.test_detector_cases import Diagnosis, _findings, diagnose

pytestmark = pytest.mark.slow

HEALTHY_SEEDS = range(12)
STAGE_1 = tuple(range(16, 32))


def _demo(case: str, seed: int = 0) -> Diagnosis:
    spec = build_spec(f"demo32-{case}-{seed}", 8, 2, 2, 40, case, seed=seed)
    assert (spec.dp, spec.tp, spec.pp, spec.world_size) == (8, 2, 2, 32)
    return diagnose(spec)


def _named(d: Diagnosis) -> set[int]:
    """Every rank an L2 or L3 finding names (a slow stage or a link names many)."""
    return {r for res in (*d.l2, *d.l3) for r in res.ranks}


def test_case1_compute_straggler_not_its_tp_partner() -> None:
    d = _demo("case1")
    assert [(r.kind, r.steps) for r in d.l1] == [(FindingKind.STEP_REGRESSION, (15,))]
    assert [(r.kind, r.ranks) for r in d.l2] == [(FindingKind.COMPUTE_STRAGGLER, (5,))]
    assert d.l2[0].phase in {"self_attention", "mlp"}
    assert d.l2[0].score == pytest.approx(25, rel=0.1)  # self_attention x25, its TP wait excluded
    assert d.l2[0].evidence["collective_short"] is True
    assert d.l2[0].evidence["short_collectives_peers_over_rank_ratio"]["tp-allreduce:ALL_REDUCE"] > 10
    assert {r.kind for r in d.l3} == {FindingKind.KERNEL_DEGRADED, FindingKind.LATE_ARRIVAL}
    assert _named(d) == {5}  # rank 4 (TP partner) and 20/21 (next stage) only waited
    (late,) = [r for r in d.l3 if r.kind is FindingKind.LATE_ARRIVAL]
    assert (late.kernel, late.stream, late.evidence["group"]) == (K_ALL_REDUCE, TP_STREAM, "TP2")
    assert late.evidence["waiting_peers"] == [4]
    assert {f.kind for f in _findings(d)} == {"step_regression", "compute_straggler", "late_arrival", "kernel_degraded"}


def test_case2_degraded_tp_links_are_network_not_compute() -> None:
    d = _demo("case2")
    assert d.l1 == [] and d.l2 == []  # the layers of ranks 4-7 are long, but only their TP all-reduce is
    assert all(r.kind is FindingKind.LINK_DEGRADED for r in d.l3)
    assert sorted(r.ranks for r in d.l3) == [(4, 5), (6, 7)]
    assert all((r.kernel, r.stream) == (K_ALL_REDUCE, TP_STREAM) for r in d.l3)
    assert sorted(r.evidence["group"] for r in d.l3) == ["TP2", "TP3"]
    assert all(r.evidence["p50_ratio"] > 6 for r in d.l3)  # x8, less the fixed launch overheads
    assert {f.kind for f in _findings(d)} == {"link_degraded"}


def test_case3_last_stage_slow() -> None:
    d = _demo("case3")
    assert d.l1 == [] and d.l3 == []
    assert [(r.kind, r.ranks) for r in d.l2] == [(FindingKind.PP_STAGE_SLOW, STAGE_1)]
    assert d.l2[0].score == pytest.approx(1.9, abs=0.1)
    assert d.l2[0].evidence["stage"] == 1 and d.l2[0].evidence["phase_kind"] == "BACKWARD"


def test_case4_host_stall_spikes_only() -> None:
    d = _demo("case4")
    assert all(r.kind is FindingKind.ITERATION_SPIKE for r in d.l1)
    assert sorted(s for r in d.l1 for s in r.steps) == [12, 27]
    assert all(r.evidence["host_side"] is True for r in d.l1)
    assert d.l2 == [] and d.l3 == []
    assert {f.kind for f in _findings(d)} == {"iteration_spike"}


def test_case5_compute_straggler_with_short_collectives() -> None:
    d = _demo("case5")
    assert d.l1 == []
    assert [(r.kind, r.ranks, r.phase) for r in d.l2] == [(FindingKind.COMPUTE_STRAGGLER, (5,), "mlp")]
    assert d.l2[0].score == pytest.approx(3.0, rel=0.1)
    ev = d.l2[0].evidence
    assert ev["collective_short"] is True
    assert ev["short_collectives_peers_over_rank_ratio"]["tp-allreduce:ALL_REDUCE"] > 3
    assert all(r.kind is not FindingKind.LINK_DEGRADED for r in d.l3)
    assert _named(d) == {5}
    assert "link_degraded" not in {f.kind for f in _findings(d)}


@pytest.mark.parametrize(("case", "named"), [("case1", {5}), ("case2", {4, 5, 6, 7}), ("case5", {5})])
def test_attribution_holds_over_seeds(case: str, named: set[int]) -> None:
    for seed in (1, 2):
        d = _demo(case, seed)
        assert _named(d) == named, seed
        if case == "case2":
            assert d.l2 == [] and {r.kind for r in d.l3} == {FindingKind.LINK_DEGRADED}
        else:
            assert [(r.kind, r.ranks) for r in d.l2] == [(FindingKind.COMPUTE_STRAGGLER, (5,))]


@pytest.mark.parametrize("sync", [GradSync.ALL_REDUCE, GradSync.DISTRIBUTED], ids=["ddp", "distopt"])
def test_healthy_32_rank_jobs_give_no_findings(sync: GradSync) -> None:
    alarms = []
    for seed in HEALTHY_SEEDS:
        base = build_spec(f"healthy32-{sync.value}-{seed}", 8, 2, 2, 30, "none", seed=seed)
        spec: JobSpec = dataclasses.replace(base, grad_sync=sync)
        d = diagnose(spec)
        alarms += [(seed, r.kind, getattr(r, "ranks", ()), r.score) for r in (*d.l1, *d.l2, *d.l3)]
    assert alarms == []
