"""The in-process pipeline (argus.streams.offline) and the job-level link ledger
(argus.streams.diagnosis.LinkLedger)."""

from __future__ import annotations

import dataclasses
import json

from argus.detectors.l3_kernels import PIPELINE_SIDE
from argus.producers.faults import Fault
from argus.producers.seed_cases import paper_case
from argus.producers.simulator import JobSimulator
from argus.schemas.records import Finding, Level
from argus.streams.diagnosis import CORROBORATES_ONLY, LinkLedger
from argus.streams.offline import diagnose_records, finding_json


def _link(ranks: tuple[int, ...], kernel: str, ratio: float, groups: int, impact: float = 1.0,
          weak: bool = False, known: bool = False, of_kind: tuple[int, int, int] | None = None) -> Finding:
    ev = json.dumps({"transfer_ratio": ratio, "groups_compared": groups, "group_known": known}
                    | ({CORROBORATES_ONLY: True} if weak else {})
                    | (dict(zip(("kind_groups", "kind_slow_groups", "kind_comparisons"), of_kind, strict=True))
                       if of_kind else {}))
    return Finding(finding_id=f"{kernel}{ranks}", job_id="j", level=Level.L3, kind="link_degraded", ranks=ranks,
                   steps=(), score=ratio, evidence_json=ev, time_ns=1, kernel=kernel, stream=20, impact_ns=impact)


def test_links_need_two_collectives_or_strong_evidence() -> None:
    ledger = LinkLedger()
    assert ledger.filter([_link((0, 1), "AllReduce", 1.6, 2, impact=5.0)]) == []
    # Once the second collective agrees, each of the group's collectives is named, each once.
    assert [f.kernel for f in ledger.filter([_link((0, 1), "AllGather", 1.7, 2)])] == ["AllReduce", "AllGather"]
    assert [f.kernel for f in ledger.filter([_link((0, 1), "ReduceScatter", 1.7, 2)])] == ["ReduceScatter"]
    assert ledger.filter([_link((0, 1), "AllGather", 1.8, 2)]) == []  # a copy of a named one
    assert len(LinkLedger().filter([_link((2, 3), "AllReduce", 3.0, 4)])) == 1
    # One collective is enough where the trace named the stream's process group.
    assert len(LinkLedger().filter([_link((6, 7), "AllReduce", 1.6, 2, known=True)])) == 1
    other = _link((4, 5), "x", 1.0, 1)
    assert LinkLedger().filter([dataclasses.replace(other, kind="kernel_degraded")])  # other kinds pass


def test_the_only_slow_group_of_its_kind_across_three_stages_is_strong() -> None:
    # Two EP groups per stage, eight stages: slow against its stage's other group, even in all the others.
    assert len(LinkLedger().filter([_link((9, 11), "SendRecv", 2.8, 2, of_kind=(16, 1, 8))])) == 1
    # Two stages only, a second slow group somewhere, or a ratio under the strong one: a second collective is
    # needed.
    assert LinkLedger().filter([_link((2, 3), "ReduceScatter", 2.9, 2, of_kind=(4, 1, 2))]) == []
    assert LinkLedger().filter([_link((9, 11), "SendRecv", 2.8, 2, of_kind=(16, 2, 8))]) == []
    assert LinkLedger().filter([_link((9, 11), "SendRecv", 1.8, 2, of_kind=(16, 1, 8))]) == []
    # The ratio read low in the mode counts as well: the other groups' typical calls hold waiting.
    low = _link((9, 11), "SendRecv", 2.2, 2, of_kind=(16, 1, 8))
    low = dataclasses.replace(low, evidence_json=json.dumps(low.evidence | {"low_transfer_ratio": 2.7}))
    assert len(LinkLedger().filter([low])) == 1


def test_several_slow_groups_in_one_collective_are_no_strong_evidence() -> None:
    # Seven TP pairs of 64 slow x14 in one reduce-scatter of an unnamed group: ranks waiting in a DP
    # reduce-scatter for a straggler look so. Two slow groups still are strong; a second collective names them.
    assert LinkLedger().filter([_link((12, 13), "ReduceScatter", 14.0, 64, of_kind=(64, 7, 1))]) == []
    assert len(LinkLedger().filter([_link((12, 13), "ReduceScatter", 14.0, 64, of_kind=(64, 2, 1))])) == 1
    ledger = LinkLedger()
    assert ledger.filter([_link((12, 13), "ReduceScatter", 14.0, 64, of_kind=(64, 7, 1))]) == []
    assert len(ledger.filter([_link((12, 13), "AllGather", 1.5, 64, of_kind=(64, 1, 1))])) == 2
    # A named group needs no strength.
    assert len(LinkLedger().filter([_link((12, 13), "ReduceScatter", 14.0, 64, known=True, of_kind=(64, 7, 1))])) == 1


def test_the_named_collectives_do_not_depend_on_their_order() -> None:
    links = [_link((0, 1), "AllReduce", 1.6, 2, known=True, impact=2.0), _link((0, 1), "AllGather", 1.7, 2, known=True),
             _link((0, 1), "Tiny", 1.7, 2, weak=True)]
    named = [sorted(f.kernel or "" for f in LinkLedger().filter(order)) for order in (links, links[::-1])]
    assert named == [["AllGather", "AllReduce"]] * 2


def test_links_under_the_impact_threshold_corroborate_but_are_never_published() -> None:
    ledger = LinkLedger()
    assert ledger.filter([_link((0, 1), "AllReduce_small", 1.6, 2, weak=True)]) == []
    assert ledger.filter([_link((0, 1), "AllGather_small", 3.0, 8, weak=True)]) == []  # strong, but too small
    named = ledger.filter([_link((0, 1), "AllReduce_big", 1.6, 2, impact=9.0)])
    assert [f.kernel for f in named] == ["AllReduce_big"]
    assert LinkLedger().filter([_link((2, 3), "a", 1.6, 2), _link((2, 3), "b", 1.6, 2, weak=True)])
    # One collective is enough where the trace named the stream's process group.
    assert len(LinkLedger().filter([_link((6, 7), "AllReduce", 1.6, 2, known=True)])) == 1
    other = _link((4, 5), "x", 1.0, 1)
    assert LinkLedger().filter([dataclasses.replace(other, kind="kernel_degraded")])  # other kinds pass


def test_the_paper_case_runs_through_the_offline_pipeline_with_impacts() -> None:
    records = (r.record for r in JobSimulator(paper_case(Fault.COMPUTE_STRAGGLER)).records())
    [(_job, findings)] = diagnose_records(records).items()
    assert findings and {r for f in findings for r in f.ranks} == {5}
    assert all(f.impact_ns > 0 and f.impact_ns_per_step > 0 for f in findings)
    out = finding_json(findings[0])
    assert {"impact_ns", "impact_ns_per_step", "evidence", "kind", "ranks"} <= out.keys()
    assert out["evidence"]["delay_ms_per_step"] > 0


def _side(rank: int, stage: int, pipe: int = 3, weak: bool = False, impact: float = 1.0) -> Finding:
    ev = {"transfer_ratio": 1.8, "groups_compared": 4, "group_kind": PIPELINE_SIDE, "pp_group": pipe,
          "pp_stage": stage} | ({CORROBORATES_ONLY: True} if weak else {})
    return Finding(finding_id=f"side{rank}", job_id="j", level=Level.L3, kind="link_degraded", ranks=(rank,),
                   steps=(), score=1.8, evidence_json=json.dumps(ev), time_ns=1, kernel="SendRecv", stream=40 + stage,
                   impact_ns=impact)


def test_a_pipeline_link_is_named_from_both_of_its_sides() -> None:
    ledger = LinkLedger()
    assert ledger.filter([_side(1, 0)]) == []  # one side: a rank waiting for a slow peer looks like this
    assert ledger.filter([_side(9, 3)]) == []  # not adjacent
    assert ledger.filter([_side(6, 1, pipe=4)]) == []  # another pipeline
    [named] = ledger.filter([_side(5, 1, impact=7.0)])
    assert named.ranks == (1, 5) and named.impact_ns == 7.0 and named.evidence["group_kind"] == "PP"
    assert named.finding_id != _side(5, 1).finding_id
    assert ledger.filter([_side(5, 1), _side(1, 0)]) == []  # named once
    weak = LinkLedger()
    assert weak.filter([_side(1, 0, weak=True), _side(5, 1, weak=True)]) == []  # both under the impact rule
    assert [f.ranks for f in weak.filter([_side(5, 1)])] == [(1, 5)]


def test_pipeline_sides_are_not_paired_once_a_straggler_is_known() -> None:
    ledger = LinkLedger()
    straggler = Finding(finding_id="s", job_id="j", level=Level.L2, kind="compute_straggler", ranks=(93,), steps=(),
                        score=2.0, evidence_json="{}", time_ns=1)
    assert ledger.filter([straggler]) == [straggler]
    assert ledger.filter([_side(1, 0), _side(5, 1)]) == []  # their waiting is the straggler's doing


def test_a_named_stragglers_kernels_are_its_evidence_not_findings_of_their_own() -> None:
    from argus.detectors.victims import drop_victims

    def l3(kind: str, ranks: tuple[int, ...]) -> Finding:
        return Finding(finding_id=f"{kind}{ranks}", job_id="j", level=Level.L3, kind=kind, ranks=ranks, steps=(),
                       score=1.0, evidence_json="{}", time_ns=1)

    found = [l3("kernel_degraded", (5,)), l3("kernel_degraded", (6,)), l3("late_arrival", (5,)),
             l3("late_arrival", (7,)), l3("rank_degraded", (5,))]
    assert [(f.kind, f.ranks) for f in drop_victims(found, {5})] == [
        ("kernel_degraded", (6,)), ("late_arrival", (5,)), ("rank_degraded", (5,))]


def test_findings_carry_the_version_of_the_detectors_that_made_them() -> None:
    from argus.core.settings import Settings
    from argus.streams.diagnosis import DiagnosisParams, detector_version

    cfg = Settings()
    records = [r.record for r in JobSimulator(paper_case(Fault.COMPUTE_STRAGGLER)).records()]
    [(_job, findings)] = diagnose_records(records, cfg).items()
    version = detector_version(DiagnosisParams(min_impact_fraction=cfg.min_impact_fraction), cfg)
    assert findings and {f.detector_version for f in findings} == {version}
    assert finding_json(findings[0])["detector_version"] == version
    package, digest = version.split("+")
    assert package and len(digest) == 12 and int(digest, 16) >= 0
    # Same detectors, same version; other parameters or settings that shape the findings, another one.
    assert detector_version(DiagnosisParams(min_impact_fraction=0.01), Settings()) == version
    assert detector_version(DiagnosisParams(min_impact_fraction=0.02), cfg) != version
    assert detector_version(DiagnosisParams(), cfg.replace(window_ns=5_000_000_000)) != version
    # Settings that do not touch the diagnosis leave it alone.
    assert detector_version(DiagnosisParams(), cfg.replace(sink_flush_ms=900)) == version


def test_the_link_ledgers_judge_by_the_link_params_the_diagnosis_runs_with() -> None:
    """One LinkParams (``L3Params.links``) serves the link rule and the job's link ledger, offline and in the
    worker (the JobRouter's ledger)."""
    from argus.core.settings import Settings
    from argus.detectors.l3_kernels import L3Params
    from argus.detectors.links import LinkParams
    from argus.streams.diagnosis import DiagnosisParams
    from argus.streams.diagnosis_stats import DiagnosisStats
    from argus.streams.job_router import JobRouter
    from argus.streams.offline import _Job

    links = LinkParams(strong_ratio=3.5, strong_groups=6)
    params = DiagnosisParams(l3=dataclasses.replace(L3Params(), links=links))
    assert _Job("j", params).links.params is links
    router: JobRouter[Finding] = JobRouter(Settings().worker, 1, params, DiagnosisStats(), lambda m: m, "v")
    assert router.ledger.link_params is links
    strong = _link((2, 3), "AllReduce", 3.0, 4)  # strong by the default LinkParams, not by these
    assert len(LinkLedger().filter([strong])) == 1
    assert router.ledger.publishable([strong]) == ()
    assert LinkLedger(links).filter([strong]) == []
