"""The link rule's parameters and evidence (argus.detectors.links) and the job's link ledger with them
(argus.detectors.link_ledger)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from argus.core.errors import DetectorError
from argus.core.kinds import FindingKind
from argus.detectors import L3Params, detect_l3
from argus.detectors.findings import to_finding
from argus.detectors.impact import Impact
from argus.detectors.l3_kernels import L3Result
from argus.detectors.link_ledger import LinkLedger
from argus.detectors.links import (
    CORROBORATES_ONLY,
    IMPACT_BAR_SHARE,
    PIPELINE_SIDE,
    LinkEvidence,
    LinkParams,
    PseudoGroup,
    _at_one_late_position,
    group_kind,
)
from argus.producers.topology import build_topology
from argus.schemas.records import Finding, ParallelGroup
from argus.streams.offline import diagnose_traces
from load_tests.kineto_scenarios import Scenario, simulate, topology_flag, write_scenario
from tests.unit.test_l3 import AR, REAL_STAGE0_SIDES, _ranks, _summary

#: The keys of a link result's evidence as the rule wrote them before LinkEvidence (a whole group's).
GROUP_KEYS = {"window_end_ns", "n_ranks", "collective", "group_known", "group", "group_kind", "group_index",
              "whole_group", "transfer_ratio", "p50_ratio", "group_min_ns", "low_transfer_ratio", "healthy_min_ns",
              "mode_share_of_calls", "groups_compared", "kind_groups", "kind_slow_groups", "kind_comparisons",
              "w1_inter_over_intra_ratio"}
SENDRECV = "ncclDevKernel_SendRecv"


def test_link_params_defaults_are_the_rules_thresholds() -> None:
    p = LinkParams()
    assert (p.ratio, p.z, p.max_ratio, p.small_ratio, p.mad_floor, p.side_floor_ratio) == (1.3, 4.0, 20.0, 2.0,
                                                                                          0.05, 1.2)
    assert (p.spread_set, p.strong_ratio, p.strong_groups, p.several_slow, p.moved_share) == (4, 2.5, 4, 3, 0.45)
    assert L3Params().links == p
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.ratio = 2.0  # type: ignore[misc]


@pytest.mark.parametrize("bad", [
    {"ratio": 1.0}, {"ratio": math.nan}, {"max_ratio": math.inf}, {"small_ratio": 0.5}, {"side_floor_ratio": 1.0},
    {"strong_ratio": -2.0}, {"z": -1.0}, {"z": math.nan}, {"mad_floor": 0.0}, {"mad_floor": 1.0},
    {"ratio": 3.0, "max_ratio": 2.0}, {"spread_set": 1}, {"strong_groups": 0}, {"several_slow": 1},
    {"late_arrival_ratio": 1.0}, {"w1_resolution": 0.0}, {"w1_resolution": math.inf}, {"moved_share": 0.0},
    {"moved_share": 1.0}, {"moved_share": math.nan},
])
def test_link_params_reject_out_of_range_values(bad: dict[str, Any]) -> None:
    with pytest.raises(DetectorError):
        LinkParams(**bad)


def test_link_params_reach_the_rule_through_l3_params() -> None:
    topo = build_topology("j", dp=4, tp=2)
    slow = [_summary(_ranks(8, {r: 10.0 for r in (1, 3, 5, 7)}), kernel=AR, stream=13)]
    assert [r.ranks for r in detect_l3(slow, topo)] == [(1, 3, 5, 7)]
    # x10 beyond a max_ratio of 5 is waiting, not a link.
    assert detect_l3(slow, topo, L3Params(links=LinkParams(max_ratio=5.0))) == []


def test_group_kinds_read_back_from_evidence() -> None:
    assert group_kind("PP") is ParallelGroup.PP and group_kind("TP") is ParallelGroup.TP
    assert group_kind(PIPELINE_SIDE) is PseudoGroup.PP_SIDE and group_kind("JOB") is PseudoGroup.JOB
    with pytest.raises(DetectorError, match="unknown group kind"):
        group_kind("PP_PAIR")


def _link_result() -> L3Result:
    topo = build_topology("j", dp=4, tp=2)
    [res] = detect_l3([_summary(_ranks(8, {r: 10.0 for r in (1, 3, 5, 7)}), kernel=AR, stream=13)], topo)
    assert res.kind is FindingKind.LINK_DEGRADED
    return res


def test_link_evidence_is_the_dictionary_the_rule_wrote_before() -> None:
    ev = _link_result().evidence
    assert set(ev) == GROUP_KEYS
    assert ev["group"] == "DP1" and ev["group_kind"] == "DP" and isinstance(ev["group_kind"], str)
    assert ev["p50_ratio"] == ev["transfer_ratio"] and ev["whole_group"] is True and ev["collective"] is True
    back = LinkEvidence.from_dict(ev)
    assert back.group_kind is ParallelGroup.DP and back.as_dict() == ev


def test_link_evidence_round_trips_through_a_finding() -> None:
    res = _link_result()
    f = to_finding("j", res, 10, Impact(2e6, 5, 4e6, 2e7))
    # The finding's evidence: the link's keys as written, with the impact's.
    assert set(f.evidence) == GROUP_KEYS | {"delay_ms_per_step", "impact_steps"}
    link = {k: v for k, v in f.evidence.items() if k in GROUP_KEYS}
    assert LinkEvidence.from_dict(f.evidence).as_dict() == link
    assert json.dumps(LinkEvidence.from_dict(f.evidence).as_dict(), sort_keys=True) == json.dumps(link, sort_keys=True)


def test_a_pipeline_sides_evidence_round_trips_with_its_stage_and_corroboration() -> None:
    # The real run's stage-0 sides of tests/unit/test_l3.py: rank 3's side only corroborates.
    topo = build_topology("j", dp=4, tp=2, pp=2)
    rows = list(REAL_STAGE0_SIDES)
    [res] = detect_l3([_summary(rows, kernel=SENDRECV)], topo)
    ev = res.evidence
    assert set(ev) == GROUP_KEYS | {"pp_group", "pp_stage", CORROBORATES_ONLY, "weak"}
    assert ev["group_kind"] == PIPELINE_SIDE and ev["whole_group"] is False and ev[CORROBORATES_ONLY] is True
    back = LinkEvidence.from_dict(ev)
    assert back.group_kind is PseudoGroup.PP_SIDE and back.corroborates_only and back.weak and back.pp_stage == 0
    assert back.as_dict() == ev
    assert CORROBORATES_ONLY not in dataclasses.replace(back, corroborates_only=False).as_dict()


def _side_finding(rank: int, stage: int, ratio: float, impact: float, weak: bool = False,
                  bar_share: float | None = None, compared: int = 4) -> Finding:
    ev = LinkEvidence(group=f"PP_SIDE{3 * 65536 + stage}", group_kind=PseudoGroup.PP_SIDE,
                      group_index=3 * 65536 + stage, whole_group=False, transfer_ratio=ratio, group_min_ns=2e5 * ratio,
                      low_transfer_ratio=ratio, healthy_min_ns=2e5, mode_share_of_calls=1.0, groups_compared=compared,
                      kind_groups=8, kind_slow_groups=1, kind_comparisons=2, w1_inter_over_intra_ratio=None,
                      window_end_ns=99, n_ranks=4, group_known=False, pp_group=3, pp_stage=stage,
                      corroborates_only=weak, weak=weak)
    extra = {} if bar_share is None else {IMPACT_BAR_SHARE: bar_share}  # as the judgement adds it
    res = L3Result(FindingKind.LINK_DEGRADED, (rank,), SENDRECV, 40 + stage, ratio, ev.as_dict() | extra,
                   excess_ns=impact)
    return to_finding("j", res, 10, Impact(impact, 5, impact, impact * 5))


def test_a_pipeline_pairs_evidence_is_its_larger_sides_as_a_whole_pp_group() -> None:
    ledger = LinkLedger()
    assert ledger.filter([_side_finding(1, 0, 1.8, 1e6)]) == []
    [pair] = ledger.filter([_side_finding(5, 1, 2.2, 3e6)])
    side = _side_finding(5, 1, 2.2, 3e6).evidence
    want = {k: v for k, v in side.items() if k != "pp_stage"} | {
        "group_kind": "PP", "whole_group": True, "group": "PP3", "side_transfer_ratio": {"5": 2.2, "1": 1.8}}
    assert pair.ranks == (1, 5) and pair.evidence == want
    assert LinkEvidence.from_dict(pair.evidence).group_kind is ParallelGroup.PP


@pytest.mark.parametrize(("ratios", "shares", "pipelines"), [((1.9, 1.9), (1.87, 2.05), 2),
                                                              ((1.9, 1.9), (0.6, 0.8), 2),
                                                              ((3.2, 1.55), (3.9, 1.8), 3),
                                                              ((1.48, 1.43), (2.8, 2.8), 32)])
def test_a_links_two_ends_that_only_corroborate_name_it_together(ratios: tuple[float, float],
                                                                   shares: tuple[float, float],
                                                                   pipelines: int) -> None:
    # DP2 x PP2, pipeline 1's link x1.9 (scenario 1439826674): of two pipelines no side reaches the small-set
    # ratio (x2), but each end is the only one of its stage whose fast calls are slower. Both ends of one link
    # time the same transfers: named together where the larger delay is over the impact bar, never one end
    # alone. Waiting made two neighbouring sides read x3.2 and x1.55 (unlike ratios), and in a healthy
    # DP16 x TP2 x PP4 job (445944120) x1.48 and x1.43, each merely the slowest of 32: no link.
    ends = [_side_finding(1, 0, ratios[0], 6e6, weak=True, bar_share=shares[0], compared=pipelines),
            _side_finding(3, 1, ratios[1], 7e6, weak=True, bar_share=shares[1], compared=pipelines)]
    ledger = LinkLedger()
    assert ledger.filter(ends[:1]) == []
    named = ledger.filter(ends[1:])
    agree = max(shares) >= 1.0 and ratios[0] == ratios[1] and pipelines < 4
    assert [f.ranks for f in named] == ([(1, 3)] if agree else [])
    for f in named:
        ev = LinkEvidence.from_dict(f.evidence)
        assert not ev.corroborates_only and not ev.weak and IMPACT_BAR_SHARE not in f.evidence
        assert ev.group_kind is ParallelGroup.PP and ev.side_transfer_ratio == {"1": 1.9, "3": 1.9}


def _rank_finding(rank: int) -> Finding:
    res = L3Result(FindingKind.RANK_DEGRADED, (rank,), "gemm", 7, 1.6, {"kernels": 6}, excess_ns=4e6)
    return to_finding("j", res, 10, Impact(4e6, 5, 4e6, 2e7))


@pytest.mark.parametrize("straggler", [False, True])
def test_a_final_judgements_pipeline_pair_waits_for_the_jobs_ranks(straggler: bool) -> None:
    # The job's final judgement pairs two sides; the rank aggregate judged after it may name the straggler the
    # sides wait for (its pipeline's stages wait for it): then the pair is no link.
    ledger = LinkLedger()
    assert ledger.filter([_side_finding(1, 0, 1.8, 1e6), _side_finding(5, 1, 2.2, 3e6)], final=True) == []
    ranks = [_rank_finding(41)] if straggler else []
    assert ledger.filter(ranks, final=True) == ranks
    assert [f.ranks for f in ledger.release()] == ([] if straggler else [(1, 5)])
    assert ledger.release() == []  # released once


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 1, 0), (1, 2, 0)])
def test_a_slow_links_waiting_neighbour_pairs_with_neither_of_its_sides(order: tuple[int, ...]) -> None:
    # Pipeline 3 of a DP x PP 8 job whose stage 4-5 link is slow: both its sides are slow (x3.7), and stage 6's
    # side waits for what it carries (x1.9, corroborating only). One pair is named, in whatever order the
    # sides are read within a batch; read alone, a weak side pairs with a slow one as before.
    sides = [_side_finding(149, 4, 3.7, 5e6), _side_finding(181, 5, 3.7, 5e6),
             _side_finding(213, 6, 1.9, 2e6, weak=True)]
    named = LinkLedger().filter([sides[i] for i in order])
    assert [f.ranks for f in named] == [(149, 181)]
    ledger = LinkLedger()
    assert ledger.filter([sides[1]]) == [] and [f.ranks for f in ledger.filter([sides[2]])] == [(181, 213)]


def test_the_ledger_reads_its_strong_evidence_gates_from_link_params() -> None:
    f = to_finding("j", dataclasses.replace(_link_result(), evidence=_link_result().evidence | {
        "transfer_ratio": 3.0, "low_transfer_ratio": 2.0, "groups_compared": 4, "kind_slow_groups": 1}), 10)
    assert len(LinkLedger().filter([f])) == 1  # x3 against 4 groups: strong at the default x2.5
    assert LinkLedger(LinkParams(strong_ratio=3.5)).filter([f]) == []
    assert LinkLedger(LinkParams(strong_groups=5)).filter([f]) == []


@pytest.mark.parametrize(("shares", "weak", "published"), [
    ((0.6, 0.5), (False, False), True),  # each under the impact bar, together over it
    ((0.6, 0.3), (False, False), False),
    ((0.7, 0.5), (False, True), True),  # a weak collective adds its cost to one that is evidence enough
    ((0.7, 0.5), (True, True), False),  # weak evidence alone names no link, whatever its cost
])
def test_a_groups_collectives_under_the_impact_bar_count_together(shares: tuple[float, float],
                                                                   weak: tuple[bool, bool], published: bool) -> None:
    from argus.detectors.impact import StepClock
    from argus.streams.diagnosis import judge

    clock = StepClock.of([i * 100_000_000 for i in range(10)], [100e6] * 10)  # 10 steps of 100 ms
    base = _link_result()
    out = []
    for i, (share, is_weak) in enumerate(zip(shares, weak, strict=True)):
        # share x 1 % of the step, per step over the window's 10 steps
        res = dataclasses.replace(base, kernel=f"{AR}_{i}", excess_ns=share * 0.01 * 100e6 * 10,
                                  evidence=base.evidence | ({"weak": True, CORROBORATES_ONLY: True} if is_weak else {}))
        [f] = judge("j", [res], 10, 8, clock, 0.01, (0, 10 * 100_000_000))
        assert f.evidence[IMPACT_BAR_SHARE] == pytest.approx(share)
        out.append(f)
    ledger = LinkLedger()
    raised = ledger.filter(out[:1]) + ledger.filter(out[1:])
    if not published:
        assert raised == []
        return
    assert sorted(f.kernel or "" for f in raised) == [f"{AR}_0", f"{AR}_1"]
    assert not any(CORROBORATES_ONLY in f.evidence for f in raised)
    assert [f.finding_id for f in raised] == [f.finding_id for f in out]


@pytest.mark.slow
def test_groups_whose_members_take_turns_arriving_last_are_no_reference(tmp_path: Path) -> None:
    # The evaluation's scenario that found this (DP4 x TP8 x PP8, 3 steps, no group names, rank 249 x1.44): the
    # straggler's replica arrives last in 6 of stage 0's 8 DP groups; in the other two the last arrival varies
    # call by call, so each member's calls hold waiting at their middle, and DP0 read x4.6 against DP2.
    scn = Scenario.from_seed(2046879683, "short_trace", 256)
    assert (scn.dp, scn.tp, scn.pp, scn.steps, scn.fault_ranks) == (4, 8, 8, 3, (249,))
    found = diagnose_traces(write_scenario(scn, tmp_path, simulate(scn)), "turns", topology=topology_flag(scn))
    assert [(f["kind"], f["ranks"]) for f in found] == [("rank_degraded", [249])]


def test_a_group_whose_fastest_member_holds_the_one_late_position_reads_its_transfer() -> None:
    # Four groups of four; the groups with a late arrival all have it at position 1, so their fastest members
    # never wait. Group 2's position-1 member is fastest too, late by less (its link lengthens every call).
    same = [(g, np.arange(4 * g, 4 * g + 4)) for g in range(4)]
    typical = np.array([310, 155, 390, 660, 320, 150, 380, 650, 500, 360, 600, 720, 305, 158, 395, 640], float)
    late = np.array([True, True, False, True])
    assert _at_one_late_position(same, typical, late).tolist() == [True, True, True, True]
    typical[9] = 800  # its fastest member elsewhere: its members take turns, no transfer to read
    assert _at_one_late_position(same, typical, late).tolist() == [True, True, False, True]
    typical[13] = 900  # the late groups disagree on the position: none reads a transfer
    assert not _at_one_late_position(same, typical, late).any()


@pytest.mark.slow
def test_a_small_groups_link_is_compared_where_one_replica_arrives_last_in_every_other_group(
        tmp_path: Path) -> None:
    # The evaluation's scenario that found this (DP4 x TP8 x PP2, DP group 6-30 x2.4 from step 3 of 10): in
    # stage 0's reduce-scatter DP replica 1 arrives last in the other seven groups; the slow group has its
    # replica-1 member fastest too, by less, so it is no late group, and was held against the seven as groups
    # taking turns (no reference): its all-gather alone fell under the impact bar.
    scn = Scenario.from_seed(760283820, "link_small_group", 256)
    assert (scn.dp, scn.tp, scn.pp, scn.steps, scn.fault_ranks) == (4, 8, 2, 10, (6, 14, 22, 30))
    found = diagnose_traces(write_scenario(scn, tmp_path, simulate(scn)), "late", topology=topology_flag(scn))
    assert [(f["kind"], f["ranks"]) for f in found] == [("link_degraded", [6, 14, 22, 30])]


@pytest.mark.slow
def test_a_pipeline_link_slowed_inside_the_window_is_named_from_its_moved_calls(tmp_path: Path) -> None:
    # The evaluation's scenario that found this (DP8 x PP2, 40 steps, the 5-13 link x2.4 from step 16): each
    # side keeps its 16 steps of fast calls, so neither side's floor is raised; rank 5's side is slow at its
    # modes' middles, rank 13's moved 60 % of its fast calls up as a cluster of their own and corroborates.
    scn = Scenario.from_seed(149293908, "link_degraded", 256)
    assert (scn.dp, scn.pp, scn.steps, scn.onset, scn.fault_ranks) == (8, 2, 40, 16, (5, 13))
    found = diagnose_traces(write_scenario(scn, tmp_path, simulate(scn)), "moved", topology=topology_flag(scn))
    assert [(f["kind"], f["ranks"]) for f in found] == [("link_degraded", [5, 13])]
