"""L3: degraded kernels and links from compressed windows (argus.detectors.l3_kernels)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from argus.core.errors import DetectorError
from argus.core.kinds import FindingKind
from argus.detectors import (
    L3Params,
    MixtureBatch,
    Scope,
    detect_l3,
    geometric_grid,
    is_collective,
    primary_p50,
    score_ranks,
    w1_to_reference,
)
from argus.detectors.findings import to_finding
from argus.detectors.impact import Impact
from argus.detectors.kernel_rows import calls_below, row_floors
from argus.detectors.l3_kernels import CORROBORATES_ONLY, PIPELINE_SIDE
from argus.detectors.link_ledger import LinkLedger
from argus.detectors.mixture import Z99
from argus.producers.topology import build_topology
from argus.schemas.records import KernelSummary, Level, ParallelGroup

PROPERTY = settings(max_examples=40, deadline=None)
GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n"
AR = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL"
Comp = tuple[int, float, float]  # (count, p50_ns, p99_ns)


def _summary(rows: Sequence[tuple[int, Sequence[Comp]]], kernel: str = GEMM, stream: int = 7) -> KernelSummary:
    """One KernelSummary; each row is (rank, components of one window)."""
    comps = [c for _, cs in rows for c in cs]
    count = tuple(int(c[0]) for c in comps)
    p50 = tuple(round(c[1]) for c in comps)
    p99 = tuple(round(c[2]) for c in comps)
    return KernelSummary(
        job_id="j", kernel=kernel, stream=stream, rank=tuple(r for r, _ in rows),
        window_start_ns=tuple(i * 10 for i in range(len(rows))),
        window_end_ns=tuple(i * 10 + 10 for i in range(len(rows))),
        n_events=tuple(sum(c[0] for c in cs) for _, cs in rows), n_clusters=tuple(len(cs) for _, cs in rows),
        cluster_count=count, cluster_p50_ns=p50, cluster_p99_ns=p99, cluster_min_ns=p50, cluster_max_ns=p99,
        # Each cluster's total is its calls times the mean of the log-normal its p50 and p99 describe.
        cluster_sum_ns=tuple(round(c * m * math.exp(math.log(q / m) ** 2 / (2 * Z99**2)))
                             for c, m, q in zip(count, p50, p99, strict=True)),
    )


def _ranks(n: int, factor: dict[int, float] | None = None, seed: int = 0, jitter: float = 0.01,
           tail: dict[int, float] | None = None, count: int = 100) -> list[tuple[int, list[Comp]]]:
    rng = np.random.default_rng(seed)
    out = []
    for r in range(n):
        # Jitter keeps any two ranks within x1.14 of each other: ranks further apart (at 5 %, 6 ranks were
        # seen to span 3.6 sigma, x1.18) differ by more than L3Params.mode_ratio (1.15), a real difference.
        bound = min(2.5, float(np.log(1.14)) / (2 * jitter)) if jitter > 1e-3 else 2.5
        p50 = 1e6 * (factor or {}).get(r, 1.0) * float(np.exp(jitter * np.clip(rng.standard_normal(), -bound, bound)))
        out.append((r, [(count, p50, p50 * (tail or {}).get(r, 1.1))]))
    return out


def _found(results: list) -> list[tuple[FindingKind, tuple[int, ...]]]:
    return [(r.kind, r.ranks) for r in results]


# -- compute kernels ---------------------------------------------------------------------------------


def test_one_slow_rank_is_degraded_kernel() -> None:
    res = detect_l3([_summary(_ranks(16, {7: 2.0}))])
    assert _found(res) == [(FindingKind.KERNEL_DEGRADED, (7,))]
    r = res[0]
    assert r.level is Level.L3 and r.kernel == GEMM and r.stream == 7 and r.steps == ()
    assert r.score == pytest.approx(1.0, rel=0.1)  # durations x2: W1 = one reference mean
    assert r.evidence["top_p50_ratio"] == pytest.approx(2.0, rel=0.05)
    assert r.evidence["n_ranks"] == 16 and r.evidence["collective"] is False


@PROPERTY
@given(n=st.integers(2, 64), seed=st.integers(0, 2**31), jitter=st.floats(0.0, 0.05),
       tail=st.floats(1.01, 1.5))
def test_jitter_never_flags(n: int, seed: int, jitter: float, tail: float) -> None:
    tails = {r: tail ** float(np.random.default_rng(seed + r).uniform(0.5, 1.0)) for r in range(n)}
    assert detect_l3([_summary(_ranks(n, seed=seed, jitter=jitter, tail=tails))]) == []


def test_tail_growth_with_the_same_p50_is_caught() -> None:
    res = detect_l3([_summary(_ranks(16, tail={3: 3.3}))])
    assert _found(res) == [(FindingKind.KERNEL_DEGRADED, (3,))]
    assert res[0].evidence["top_p50_ratio"] == pytest.approx(1.0, rel=0.05)
    assert res[0].evidence["top_mean_shift_ns"] > 0


def _window(rows: Sequence[tuple[int, float, float, float, float, float]]) -> KernelSummary:
    """One window of one cluster per rank: (rank, min, p50, p99, max, total) in ms, 16 calls each."""
    ms = 1e6
    return KernelSummary(
        job_id="j", kernel=GEMM, stream=7, rank=tuple(r[0] for r in rows), window_start_ns=(0,) * len(rows),
        window_end_ns=(10,) * len(rows), n_events=(16,) * len(rows), n_clusters=(1,) * len(rows),
        cluster_count=(16,) * len(rows), cluster_min_ns=tuple(round(r[1] * ms) for r in rows),
        cluster_p50_ns=tuple(round(r[2] * ms) for r in rows), cluster_p99_ns=tuple(round(r[3] * ms) for r in rows),
        cluster_max_ns=tuple(round(r[4] * ms) for r in rows), cluster_sum_ns=tuple(round(r[5] * ms) for r in rows))


def test_a_stray_call_moving_a_small_clusters_p50_is_no_slow_kernel() -> None:
    # The last window of DP2 x TP2 x PP2 x EP2 scenario 696012118 (one step; stage 1): a GEMM name with three
    # shapes (~1.4, ~2.9, ~4.7 ms) in one cluster of 16 calls. One of rank 6's short calls ran x5 (7.2 ms): its
    # p50 moved from between the shapes onto the upper one (x1.42), its total grew 10 %, one call's worth.
    stray = [(4, 1.381, 2.930, 4.689, 4.695, 47.69), (5, 1.395, 2.890, 4.749, 4.769, 47.79),
             (6, 1.400, 4.127, 6.837, 7.212, 52.63), (7, 1.470, 2.886, 4.634, 4.650, 47.72)]
    assert detect_l3([_window(stray)]) == []
    # The same window's stage 0, where rank 2 (the scenario's straggler, x1.73) runs every call slow: found.
    slow = [(0, 1.464, 2.972, 4.685, 4.705, 48.19), (1, 1.465, 2.910, 4.755, 4.768, 48.39),
            (2, 2.484, 5.108, 8.234, 8.252, 83.79), (3, 1.391, 2.859, 4.625, 4.642, 46.70)]
    assert _found(detect_l3([_window(slow)])) == [(FindingKind.KERNEL_DEGRADED, (2,))]


def test_faster_rank_is_not_flagged() -> None:
    assert detect_l3([_summary(_ranks(16, {2: 0.4}))]) == []


def test_half_the_ranks_slow_needs_the_p50_path() -> None:
    slow = {r: 4.0 for r in range(8, 16)}
    # one finding per rank, each judged on its own impact downstream
    found = _found(detect_l3([_summary(_ranks(16, slow))]))
    assert found == [(FindingKind.KERNEL_DEGRADED, (r,)) for r in range(8, 16)]
    assert detect_l3([_summary(_ranks(16, slow))], params=L3Params(p50_ratio=1e9)) == []  # IQR alone fails


def test_windows_and_summaries_merge_per_rank() -> None:
    rows = _ranks(8, {1: 3.0})
    split = [_summary(rows[:4]), _summary(rows[4:]), _summary([(1, [(50, 3e6, 3.3e6)])])]
    assert _found(detect_l3(split)) == _found(detect_l3([_summary(rows)])) == [(FindingKind.KERNEL_DEGRADED, (1,))]


def test_primary_mode_spans_windows() -> None:
    # one healthy window of 65 events, then ten slow windows of ~10 events: the slow mode has more events
    comps = [(65, 1e6, 1.1e6)] + [(10, 20e6 * (1 + 0.01 * i), 22e6) for i in range(10)]
    trimodal = [(25, 2e5, 2.2e5), (25, 6e5, 6.6e5), (50, 1.6e6, 1.8e6)]
    batch = MixtureBatch.from_long(np.array([0] * 11 + [1] * 3), *zip(*(comps + trimodal), strict=True))
    got = primary_p50(batch)
    assert 20e6 <= got[0] <= 20.1e6 * 1.1 and got[1] == pytest.approx(1.6e6)


def test_min_events_and_min_ranks() -> None:
    rows = _ranks(8, {1: 3.0})
    rows[1] = (1, [(5, 3e6, 3.3e6)])
    assert detect_l3([_summary(rows)]) == []  # the slow rank has too few events to judge
    assert detect_l3([_summary(_ranks(1))]) == [] and detect_l3([]) == []


def test_compute_kernels_compared_within_a_stage() -> None:
    topo = build_topology("j", dp=4, pp=2)
    rows = _ranks(8, {r: 2.5 for r in range(4, 8)})  # stage 1 runs a bigger shape of the same kernel
    assert detect_l3([_summary(rows)], topo) == []
    job = detect_l3([_summary(rows)], topo, L3Params(compute_scope=Scope.JOB, p50_ratio=2.0))
    assert _found(job) == [(FindingKind.KERNEL_DEGRADED, (r,)) for r in (4, 5, 6, 7)]
    assert _found(detect_l3([_summary(_ranks(8, {5: 2.5}))], topo)) == [(FindingKind.KERNEL_DEGRADED, (5,))]


# -- collective kernels ------------------------------------------------------------------------------


def test_whole_group_long_is_link_degradation() -> None:
    # DP groups {0, 2, 4, 6}, {1, 3, 5, 7} (one pipeline stage: groups are compared with their stage's)
    topo = build_topology("j", dp=4, tp=2)
    res = detect_l3([_summary(_ranks(8, {r: 10.0 for r in (1, 3, 5, 7)}), kernel=AR, stream=13)], topo)
    assert _found(res) == [(FindingKind.LINK_DEGRADED, (1, 3, 5, 7))]
    ev = res[0].evidence
    assert ev["group"] == "DP1" and ev["whole_group"] is True and ev["collective"] is True
    assert ev["p50_ratio"] == pytest.approx(10.0, rel=0.05)
    assert ev["w1_inter_over_intra_ratio"] > 50


@pytest.mark.parametrize(("stage", "factor", "found"), [(7, 1.5, False), (0, 1.5, False), (4, 1.5, True),
                                                       (7, 2.5, True)])
def test_one_group_per_stage_at_the_pipelines_ends_needs_the_small_set_ratio(stage: int, factor: float,
                                                                             found: bool) -> None:
    # DP 4 x PP 8: each stage's one DP group is compared across stages. The first and last stages' groups also
    # carry the embedding and the output layer, so x1.5 there is no link; x1.5 in a middle stage, or x2.5 at an
    # end, is.
    topo = build_topology("j", dp=4, pp=8)
    group = [r for r in range(32) if topo.pp_stage[r] == stage]
    res = detect_l3([_summary(_ranks(32, {r: factor for r in group}), kernel=AR, stream=13)], topo)
    assert _found(res) == ([(FindingKind.LINK_DEGRADED, tuple(group))] if found else [])


def test_short_member_is_late_and_its_peers_are_spared() -> None:
    topo = build_topology("j", dp=8)
    res = detect_l3([_summary(_ranks(8, {5: 1 / 20}), kernel=AR)], topo)
    assert _found(res) == [(FindingKind.LATE_ARRIVAL, (5,))]
    ev = res[0].evidence
    assert ev["collective_short"] is True and ev["peers_over_rank_p50_ratio"] == pytest.approx(20, rel=0.05)
    assert ev["waiting_peers"] == [0, 1, 2, 3, 4, 6, 7]


def test_late_member_is_read_by_its_peers_typical_call_not_their_largest_mode() -> None:
    # Rank 5 posts last in most calls. Its peers' calls spread over three modes: their 40 fast ones (rank 5
    # on time) are the most populous mode, but the typical (median) call waited x15.
    topo = build_topology("j", dp=8)
    rows = [(r, [(100, 1e6, 1.1e6)] if r == 5 else [(40, 1e6, 1.1e6), (30, 15e6, 16e6), (30, 30e6, 32e6)])
            for r in range(8)]
    res = detect_l3([_summary(rows, kernel=AR)], topo)
    assert _found(res) == [(FindingKind.LATE_ARRIVAL, (5,))]
    assert res[0].evidence["peers_over_rank_p50_ratio"] == pytest.approx(15, rel=0.05)


def test_late_member_in_one_stage_explains_its_long_peers_only() -> None:
    topo = build_topology("j", dp=4, pp=2)
    factor = {0: 10.0, 1: 10.0, 3: 10.0}  # rank 2 arrived late: the rest of its DP group waited
    assert _found(detect_l3([_summary(_ranks(8, factor), kernel=AR)], topo)) == [
        (FindingKind.LATE_ARRIVAL, (2,))]
    factor = {0: 3.0, 1: 3.0, 3: 3.0}  # 3x shorter: explains the waiting, too weak to name (short_ratio 5)
    assert detect_l3([_summary(_ranks(8, factor), kernel=AR)], topo) == []


def test_late_tp_pair_explains_every_dp_group_and_is_not_named() -> None:
    # DP 8 x TP 2: rank 5 slow, rank 4 waited for it in their TP all-reduce; both arrive last at their DP
    # all-reduce, everyone else waits. No TP pair's long collective is a link, and which of 4 and 5 held up
    # the other only the TP all-reduce shows.
    topo = build_topology("j", dp=8, tp=2)
    factor = {r: 1.0 if r in (4, 5) else 50.0 for r in range(16)}
    assert detect_l3([_summary(_ranks(16, factor), kernel=AR, stream=13)], topo) == []
    # the TP all-reduce: rank 5 short, its partner long
    tp = {r: 50.0 if r == 4 else 1.0 for r in range(16)}
    res = detect_l3([_summary(_ranks(16, tp), kernel=AR, stream=17)], topo)
    assert _found(res) == [(FindingKind.LATE_ARRIVAL, (5,))]
    assert res[0].evidence["group"] == "TP2" and res[0].evidence["waiting_peers"] == [4]


def test_link_of_a_larger_group_is_found_before_late_arrivals_of_smaller_ones() -> None:
    topo = build_topology("j", dp=2, tp=4, pp=2)  # TP groups {0..3} {4..7}; DP pairs {0,4} {1,5} ...
    res = detect_l3([_summary(_ranks(16, {r: 8.0 for r in range(4, 8)}), kernel=AR, stream=17)], topo)
    assert _found(res) == [(FindingKind.LINK_DEGRADED, (4, 5, 6, 7))] and res[0].evidence["group"] == "TP1"


def test_partial_group_slow_collective_is_no_link() -> None:
    topo = build_topology("j", dp=4, pp=2)
    res = detect_l3([_summary(_ranks(8, {1: 10.0, 5: 10.0}), kernel=AR)], topo)  # PP pair {1, 5}: not for AllReduce
    # Members of DP groups whose peers are not slow only waited longer (a collective ends together): no finding.
    assert _found(res) == []
    p2p = detect_l3([_summary(_ranks(8, {1: 10.0, 5: 10.0}), kernel="ncclDevKernel_SendRecv")], topo)
    assert _found(p2p) == [(FindingKind.LINK_DEGRADED, (1, 5))] and p2p[0].evidence["group_kind"] == "PP"


def test_a_pipeline_stream_with_one_side_gives_that_ranks_side() -> None:
    # Sends to the next stage and receives from it on the stage-0 ranks' stream only: no whole pair.
    topo = build_topology("j", dp=4, pp=2)
    res = detect_l3([_summary(_ranks(4, {1: 2.5}), kernel="ncclDevKernel_SendRecv")], topo)
    assert _found(res) == [(FindingKind.LINK_DEGRADED, (1,))]
    ev = res[0].evidence
    assert ev["group_kind"] == PIPELINE_SIDE and ev["pp_stage"] == 0 and not ev["whole_group"]
    assert ev["pp_group"] == topo.pp_group[1]


def test_a_point_to_point_stream_missing_a_stage_is_read_as_pipeline_sides_not_expert_groups() -> None:
    # DP 4 x PP 4 x EP 4: the sends to the next stage run on stages 0-2 only. Stage 0 waits longest (the
    # pipeline's warm-up) in most calls of all four of its ranks, one expert group: no expert link.
    topo = build_topology("j", dp=4, pp=4, ep=4)
    rows = [(r, [(30, 1e6, 1.1e6), (70, 4e6, 4.4e6)] if r < 4 else [(90, 1e6, 1.1e6), (10, 1.3e6, 1.4e6)])
            for r in range(12)]
    assert detect_l3([_summary(rows, kernel="ncclDevKernel_SendRecv")], topo) == []
    # The expert all-to-all, on every stage, still compares expert groups.
    slow = {r: 2.5 for r in range(4, 8)}
    res = detect_l3([_summary(_ranks(16, slow), kernel="ncclDevKernel_SendRecv")], topo)
    assert _found(res) == [(FindingKind.LINK_DEGRADED, (4, 5, 6, 7))] and res[0].evidence["group_kind"] == "EP"


def test_a_pipeline_side_that_waits_keeps_its_transfer_floor_and_is_no_link() -> None:
    # Rank 1 waits in half of its calls (its neighbour stage posts late): typical calls 2.5x longer, while the
    # calls where rank 1 posted last take the transfer alone, as on its peers.
    topo = build_topology("j", dp=4, pp=2)
    rows = _ranks(4)
    rows[1] = (1, [(50, 1e6, 1.1e6), (50, 4e6, 6e6)])
    waiting = _summary(rows, kernel="ncclDevKernel_SendRecv")
    # Half of its fast calls gone from its transfers' cluster read as a slowdown from an onset inside the
    # window would: at most corroboration of a neighbour's side slow by its own evidence, never a link alone.
    assert all(r.evidence[CORROBORATES_ONLY] for r in detect_l3([waiting], topo))
    assert LinkLedger().filter([to_finding("j", r, 10, Impact(2e6, 5, 4e6, 2e7))
                                for r in detect_l3([waiting], topo)]) == []
    slow = _summary(_ranks(4, {1: 2.5}), kernel="ncclDevKernel_SendRecv")  # every call slower: the link
    assert _found(detect_l3([slow], topo)) == [(FindingKind.LINK_DEGRADED, (1,))]


def test_a_pipeline_side_slow_in_its_fastest_calls_is_named_where_its_peers_typical_calls_wait() -> None:
    # DP 8 x PP 2, the stage-0 side of the pipeline transfers: every rank's calls are mostly waiting (its
    # typical call x1.6-2 its transfer, varying by rank), so rank 4's transfers x1.8 (fastest call 730 us
    # against 400) leave its typical call among its peers'. Its fastest calls name it.
    topo = build_topology("j", dp=8, pp=2)
    mids = [656, 832, 779, 732, 848, 809, 771, 743]

    def side(slow_floor: float) -> KernelSummary:
        rows = [(r, [(132, m * 1e3, 10.6e6)]) if r != 4 else (r, [(110, m * 1e3, 3e6), (22, 10.3e6, 10.6e6)])
                for r, m in enumerate(mids)]
        s = _summary(rows, kernel="ncclDevKernel_SendRecv")
        mins = [400e3 * (1 + 0.01 * (r % 3)) for r in range(8)]
        return dataclasses.replace(s, cluster_min_ns=tuple(round(v) for v in [*mins[:4], slow_floor, 10e6, *mins[5:]]))

    res = detect_l3([side(730e3)], topo)
    assert _found(res) == [(FindingKind.LINK_DEGRADED, (4,))]
    assert res[0].evidence["group_kind"] == PIPELINE_SIDE and res[0].evidence["transfer_ratio"] == pytest.approx(
        1.8, rel=0.05)
    assert detect_l3([side(410e3)], topo) == []  # its transfers as its peers': waiting only


def test_a_group_with_a_late_arrival_is_no_reference_for_the_others_links() -> None:
    # DP 8 x PP 2 x EP 8 (a real run's summaries): each stage one expert group. Rank 11 (a straggler) posts
    # last in its group's all-to-all and never waits: its calls are the pure transfers. Stage 0's members
    # wait for each other in some calls, so their fastest member is x1.3-1.7 slower than rank 11, no link.
    topo = build_topology("j", dp=8, pp=2, ep=8)
    stage0 = [(r, [(173, 2.58e6, 6.2e6), (27, 17.7e6, 24.8e6)]) for r in range(8)]
    stage0[2] = (2, [(174, 2.02e6, 4.8e6), (26, 17.3e6, 20.6e6)])
    stage1 = [(r, [(90, 9.5e6, 12e6), (106, 17.6e6, 36e6)]) for r in range(8, 16)]
    stage1[3] = (11, [(196, 1.58e6, 1.68e6)])
    a2a = _summary(stage0 + stage1, kernel="ncclDevKernel_SendRecv")
    res = detect_l3([a2a], topo, group_kind=ParallelGroup.EP)
    assert _found(res) == [(FindingKind.LATE_ARRIVAL, (11,))]
    # Without the late arrival the stages' groups compare: stage 0's slower by x2.2 is its link.
    calm = [(r, [(173, 1.15e6, 1.3e6), (27, 8e6, 9e6)]) for r in range(8, 16)]
    res = detect_l3([_summary(stage0 + calm, kernel="ncclDevKernel_SendRecv")], topo, group_kind=ParallelGroup.EP)
    assert _found(res) == [(FindingKind.LINK_DEGRADED, tuple(range(8)))]


#: A real run's send/receive clusters (count, p50, p99 ns) per rank of stage 0 (DP 4 x TP 2 x PP 2): rank 3's
#: transfers x2 from the fourth of 21 steps on. A tuple: each test takes a list of its own to change.
REAL_STAGE0_SIDES = ((0, [(42, 320.8e3, 338.7e3), (21, 732.5e3, 862.5e3), (21, 10.51e6, 10.94e6)]),
                     (1, [(42, 317.5e3, 335.9e3), (21, 747.1e3, 883.0e3), (21, 10.53e6, 10.97e6)]),
                     (2, [(42, 324.1e3, 408.9e3), (21, 1148.6e3, 1346.1e3), (21, 11.11e6, 11.67e6)]),
                     (3, [(63, 670.1e3, 1656.9e3), (21, 11.12e6, 11.65e6)]),
                     (4, [(63, 547.8e3, 1048.0e3), (21, 10.83e6, 11.20e6)]),
                     (5, [(63, 543.7e3, 1033.7e3), (21, 10.85e6, 11.21e6)]),
                     (6, [(63, 483.9e3, 998.7e3), (21, 10.71e6, 11.17e6)]),
                     (7, [(63, 419.4e3, 997.3e3), (21, 10.73e6, 11.18e6)]))


def test_the_slowest_side_of_a_stage_short_of_the_z_score_only_corroborates() -> None:
    # A real run's stage-0 sides (DP 4 x TP 2 x PP 2): rank 3's transfers x2 from the fourth of 21 steps on
    # share a cluster with its earlier fast calls; its stage peers' calls vary too much for a z-score. The
    # slowest side, slower in its fast calls too, corroborates its neighbour's side but is never a finding.
    topo = build_topology("j", dp=4, tp=2, pp=2)
    rows = list(REAL_STAGE0_SIDES)
    res = detect_l3([_summary(rows, kernel="ncclDevKernel_SendRecv")], topo)
    assert _found(res) == [(FindingKind.LINK_DEGRADED, (3,))]
    assert res[0].evidence["group_kind"] == PIPELINE_SIDE and res[0].evidence[CORROBORATES_ONLY] is True
    rows[3] = (3, [(63, 460e3, 1000e3), (21, 10.9e6, 11.3e6)])  # as its peers: nothing
    assert detect_l3([_summary(rows, kernel="ncclDevKernel_SendRecv")], topo) == []


def test_the_one_side_of_two_slower_in_its_fast_calls_corroborates_whatever_its_modes_show() -> None:
    # A generated run's stage-0 sides (DP 2 x PP 2, gpipe): rank 0's link to stage 1 x2 from the first step.
    # Its sends wait for the slower stage 1 to post, its receives for stage 1's backward: its typical calls
    # hold as much waiting as rank 1's, but its fastest ones (the transfer) are x1.95 rank 1's. Two sides
    # give no z-score: it only corroborates its neighbour's side, which the link slows too.
    topo = build_topology("j", dp=2, pp=2)

    def sides(floor0: float) -> KernelSummary:
        s = _summary([(0, [(184, 4807388, 44330903)]), (1, [(183, 4933032, 42667631)])],
                     kernel="ncclDevKernel_SendRecv")
        return dataclasses.replace(s, cluster_min_ns=(round(floor0), 1351690), cluster_max_ns=(44495115, 42880867))

    res = detect_l3([sides(2640210)], topo)
    assert _found(res) == [(FindingKind.LINK_DEGRADED, (0,))]
    assert res[0].evidence["group_kind"] == PIPELINE_SIDE and res[0].evidence[CORROBORATES_ONLY] is True
    assert detect_l3([sides(1400e3)], topo) == []  # its fast calls as rank 1's: nothing


def test_slow_groups_of_a_comparison_without_reference_still_count_for_the_several_stages_rule() -> None:
    # A real run's reduce-scatter (DP 2 x TP 2 x PP 2, grouping guessed): DP1 {1, 3} slow in stage 0, and in
    # stage 1 DP3 {5, 7} slow next to DP2 {4, 6}, which holds a late arrival (no reference, nothing named
    # there). Slow pairs in both stages are ranks of one position waiting, not a link.
    topo = build_topology("j", dp=2, tp=2, pp=2)
    rows = [(0, [(153, 247.3e3, 3671.7e3)]), (1, [(62, 243.5e3, 402.8e3), (91, 1403.2e3, 5633.2e3)]),
            (2, [(153, 242.4e3, 1577.8e3)]), (3, [(153, 1442.3e3, 7521.4e3)]),
            (4, [(160, 244.6e3, 2429.5e3)]), (5, [(63, 246.5e3, 523.4e3), (97, 1795.6e3, 4304.7e3)]),
            (6, [(160, 246.4e3, 3343.5e3)]), (7, [(160, 522.7e3, 3988.0e3)])]
    rs = "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL"
    assert [r for r in detect_l3([_summary(rows, kernel=rs)], topo) if r.kind is FindingKind.LINK_DEGRADED] == []
    # Stage 0 alone: its slow pair is a link candidate (for the ledger to confirm)
    assert _found(detect_l3([_summary(rows[:4], kernel=rs)], topo)) == [(FindingKind.LINK_DEGRADED, (1, 3))]


def test_row_floors_follow_the_fastest_calls_of_each_piece() -> None:
    # Rank 0: four pieces, the last three after an onset (fastest call x2); rank 1 steady; rank 2 absent.
    rows = [(0, [(10, 1e6, 2e6)])] + [(0, [(10, 2e6, 4e6)])] * 3 + [(1, [(5, 1e6, 1.5e6), (5, 3e6, 4e6)])] * 2
    floors = row_floors([_summary(rows)], np.array([0, 1, 2]))
    assert floors[0] == 2e6 and floors[1] == 1e6 and np.isnan(floors[2])
    assert np.isnan(row_floors([], np.array([0]))).all()


def test_calls_below_counts_each_ranks_calls_in_clusters_under_its_limit() -> None:
    # Rank 0: two windows, 30 of its 50 calls in clusters at 1 ms; rank 1: 10 of 40 under 2 ms; rank 2 absent.
    rows = [(0, [(20, 1e6, 1.2e6), (10, 3e6, 4e6)]), (0, [(10, 1e6, 1.1e6), (10, 2.5e6, 3e6)]),
            (1, [(10, 1.5e6, 2e6), (30, 5e6, 6e6)])]
    shares = calls_below([_summary(rows)], np.array([1, 0, 2]), np.array([2e6, 2e6, 2e6]))
    assert shares[:2].tolist() == [0.25, 0.6] and np.isnan(shares[2])
    assert calls_below([_summary(rows)], np.array([0]), np.array([5e6])).tolist() == [1.0]
    assert np.isnan(calls_below([], np.array([0]), np.array([1.0]))).all()


def test_row_floors_read_a_wide_cluster_at_its_low_quantile() -> None:
    # One window, one cluster per rank: rank 0's transfers x1.9 from an early onset on share a wide cluster with
    # the few fast calls before it (its shortest call is of the old regime); rank 1 steady.
    s = dataclasses.replace(_summary([(0, [(80, 670e3, 900e3)]), (1, [(80, 370e3, 450e3)])]),
                            cluster_min_ns=(350_000, 300_000))
    assert row_floors([s], np.array([0, 1])).tolist() == [350e3, 300e3]  # the shortest calls
    floors = row_floors([s], np.array([0, 1]), within=True)
    # the 0.3 quantile: 60 % of the way from the shortest call to the median, in log
    assert floors == pytest.approx([350e3 * (670 / 350) ** 0.6, 300e3 * (370 / 300) ** 0.6])
    assert floors[0] / floors[1] > 1.4 > 350 / 300


def test_collectives_without_topology() -> None:
    res = detect_l3([_summary(_ranks(8, {r: 10.0 for r in range(4, 8)}), kernel="ncclKernel_AllGather")])
    assert _found(res) == [(FindingKind.KERNEL_DEGRADED, (4, 5, 6, 7))]
    late = detect_l3([_summary(_ranks(8, {5: 1 / 20}), kernel=AR)])
    assert _found(late) == [(FindingKind.LATE_ARRIVAL, (5,))] and late[0].evidence["group"] == "JOB0"


@PROPERTY
@given(seed=st.integers(0, 2**31), spread=st.floats(1.0, 1.75), dp=st.sampled_from([2, 4, 8, 16]),
       pp=st.sampled_from([1, 2]))
def test_waiting_spread_never_flags(seed: int, spread: float, dp: int, pp: int) -> None:
    topo = build_topology("j", dp=dp, pp=pp)
    rng = np.random.default_rng(seed)
    factor = {r: float(spread ** rng.uniform(0, 1)) for r in range(dp * pp)}
    assert detect_l3([_summary(_ranks(dp * pp, factor, seed=seed), kernel=AR)], topo) == []


def test_is_collective() -> None:
    assert is_collective("ncclKernel_AllReduce_RING_LL_Sum_float") and is_collective(AR)
    assert not is_collective(GEMM) and is_collective("my_allreduce", markers=("allreduce",))


# -- scores, errors ----------------------------------------------------------------------------------


def test_score_ranks_matches_w1_to_reference() -> None:
    rng = np.random.default_rng(3)
    p50 = 1e6 * np.exp(0.3 * rng.standard_normal((20, 3)))
    batch = MixtureBatch(rng.integers(1, 50, (20, 3)).astype(float), p50, p50 * 1.3)
    sc = score_ranks(batch, grid_points=512)
    np.testing.assert_allclose(sc.w1_ns, w1_to_reference(batch, grid=geometric_grid(batch, points=512)), rtol=1e-9)
    assert np.all(sc.w1_ns >= np.abs(sc.shift_ns) - 1e-6)
    np.testing.assert_allclose(sc.score, sc.w1_ns / sc.reference_mean_ns)


def test_bad_input_raises() -> None:
    with pytest.raises(DetectorError):
        detect_l3([_summary(_ranks(4)), _summary(_ranks(4), kernel=AR)])
    with pytest.raises(DetectorError):
        detect_l3([_summary(_ranks(4))], build_topology("j", dp=2))
    broken = _summary(_ranks(4))
    with pytest.raises(DetectorError):
        detect_l3([KernelSummary(**{**broken.__dict__, "n_clusters": (2, 1, 1, 1)})])
    for bad in ({"iqr_k": -1.0}, {"min_score": float("nan")}, {"p50_ratio": 1.0}, {"short_ratio": 0.5},
                {"min_events": 0}, {"min_ranks": 1}, {"grid_points": 8}, {"mode_log_gap": 0.0},
                {"collective_markers": ()}, {"scan_step": 0.0}, {"scan_step": 0.5}, {"tail_calls": 1},
                {"small_set_ratio": 1.0}, {"spread_set": 1}, {"same_calls": 1.0}, {"low_part": 0.0}):
        with pytest.raises(DetectorError):
            L3Params(**bad)  # type: ignore[arg-type]


def test_one_stray_call_in_a_small_cluster_is_no_slow_kernel() -> None:
    # 24 calls per rank: a cluster's p99 is its slowest call, so one call x4.6 stretches rank 5's p99 alone.
    ranks = _ranks(32, seed=3, count=24)
    ranks[5] = (5, [(24, ranks[5][1][0][1], ranks[5][1][0][1] * 4.6)])
    assert detect_l3([_summary(ranks)]) == []
    # The same spread carried by a whole cluster of slow calls (a quarter of them) is found.
    ranks[5] = (5, [(18, 1e6, 1.1e6), (6, 3.0e6, 3.3e6)])
    assert _found(detect_l3([_summary(ranks)])) == [(FindingKind.KERNEL_DEGRADED, (5,))]


def test_cluster_median_quantile_weights_clusters_by_calls() -> None:
    from argus.detectors.l3_kernels import cluster_median_quantile
    from argus.detectors.mixture import MixtureBatch

    b = MixtureBatch(np.array([[90.0, 10.0], [50.0, 50.0]]), np.array([[1.0, 5.0], [5.0, 1.0]]),
                     np.array([[2.0, 9.0], [6.0, 3.0]]))
    assert cluster_median_quantile(b, 0.9).tolist() == [1.0, 5.0]
    assert cluster_median_quantile(b, 0.95).tolist() == [5.0, 5.0]


def test_stages_of_two_ranks_compare_a_kernel_every_rank_runs_job_wide() -> None:
    topo = build_topology("j", dp=2, pp=4)  # two ranks per stage: x1.25 is within a pair's own gate
    res = detect_l3([_summary(_ranks(8, {5: 1.25}))], topo)
    assert _found(res) == [(FindingKind.KERNEL_DEGRADED, (5,))]
    # A whole stage slow (both its ranks) is the stage detectors' to name, not two degraded kernels.
    assert detect_l3([_summary(_ranks(8, {6: 1.25, 7: 1.25}))], topo) == []


def test_two_named_groups_of_many_members_compare_like_many() -> None:
    # DP 8 x TP 2: two DP groups of 8 (the even and the odd ranks); the odd ranks' DP link is 1.6x slower.
    topo = build_topology("j", dp=8, tp=2)
    slow = {r: 1.6 for r in range(1, 16, 2)}
    summary = _summary(_ranks(16, slow), kernel=AR)
    # The trace named the stream's process group: each group's fastest member is a pure transfer.
    res = detect_l3([summary], topo, group_kind=ParallelGroup.DP)
    assert _found(res) == [(FindingKind.LINK_DEGRADED, tuple(range(1, 16, 2)))] and res[0].evidence["group_known"]
    # Inferred from durations alone the same (LinkLedger then asks for a second collective of the group).
    res = detect_l3([summary], topo)
    assert _found(res) == [(FindingKind.LINK_DEGRADED, tuple(range(1, 16, 2)))]
    assert not res[0].evidence["group_known"]
    # Within the healthy spread of transfers nothing.
    assert detect_l3([_summary(_ranks(16, {r: 1.2 for r in range(1, 16, 2)}), kernel=AR)], topo) == []


@pytest.mark.parametrize(("factors", "found"), [((1.5, 1.55), "link"), ((1.0, 1.4), "weak"), ((1.4,), "weak"),
                                               ((1.6,), "link"), ((1.2, 1.25), None)])
def test_two_stages_groups_are_a_link_where_every_bucket_is_slower_alike(factors: tuple[float, ...],
                                                                           found: str | None) -> None:
    # DP 4 x PP 2: each stage's one DP group (named by the trace) is compared with the other stage's. Their
    # stages hold other layers, so one mode of a bucketed reduction may differ by size; a slow link slows
    # every mode alike. One mode slower, or a one-mode collective, cannot tell a link from a size: at x1.5 (more
    # than two stages' sizes differ by) it is one; under that it only corroborates (and adds its cost to) a
    # group another collective names.
    topo = build_topology("j", dp=4, pp=2)
    rng = np.random.default_rng(3)
    rows = []
    for r in range(8):
        f = factors if r < 4 else (1.0,) * len(factors)
        rows.append((r, [(50, size * x * float(np.exp(0.01 * rng.standard_normal())), size * x * 1.1)
                         for size, x in zip((4e6, 1e6), f, strict=False)]))
    res = detect_l3([_summary(rows, kernel=AR, stream=13)], topo, group_kind=ParallelGroup.DP)
    if found is None:
        assert res == []
        return
    assert _found(res) == [(FindingKind.LINK_DEGRADED, (0, 1, 2, 3))]
    assert bool(res[0].evidence.get("weak")) is (found == "weak")
    assert detect_l3([_summary(rows, kernel=AR, stream=13)], topo) == []  # a guessed grouping: x2 needed


def test_a_collective_with_one_grouping_in_the_topology_is_judged_on_few_calls() -> None:
    # DP 8 x PP 4, no TP: a reduction can only be a DP group's; six calls a rank (one a step) are enough, as
    # where the trace names the group, while a job with DP and TP groups still needs ten.
    topo = build_topology("j", dp=8, pp=4)
    slow = {r: 2.5 for r in range(32) if topo.pp_stage[topo.rank.index(r)] == 1}
    rows = _ranks(32, slow, count=6)
    res = detect_l3([_summary(rows, kernel=AR)], topo)
    assert _found(res) == [(FindingKind.LINK_DEGRADED, tuple(sorted(slow)))]
    assert res[0].evidence["kind_groups"] == 4 and res[0].evidence["kind_slow_groups"] == 1
    assert detect_l3([_summary(_ranks(16, {r: 2.5 for r in range(1, 16, 2)}, count=6), kernel=AR)],
                     build_topology("j", dp=8, tp=2)) == []


def test_two_pairs_whose_fast_calls_are_slower_too_are_a_link_at_the_plain_ratio() -> None:
    # DP 2 x TP 2, groups inferred: DP pairs {0, 2} and {1, 3}; the odd pair's link is 1.6x slower in every call.
    topo = build_topology("j", dp=2, tp=2)
    slow = {1: 1.6, 3: 1.6}
    res = detect_l3([_summary(_ranks(4, slow), kernel=AR)], topo)
    assert _found(res) == [(FindingKind.LINK_DEGRADED, (1, 3))] and res[0].evidence["group"] == "DP1"
    # Waiting: each member of the pair is as fast as the other pair where it arrived last (30 of its calls).
    waiting = []
    for r, comps in _ranks(4, slow):
        if r in slow:
            base = comps[0][1] / slow[r]
            comps = [(30, base, base * 1.1), (70, base * 1.76, base * 1.9)]
        waiting.append((r, comps))
    assert detect_l3([_summary(waiting, kernel=AR)], topo) == []


def test_a_collective_with_few_calls_is_judged_only_in_its_named_group() -> None:
    # Six calls per rank (a DP all-reduce in a six-step window): enough in the group the trace named, too few
    # to tell waiting from a slow group when every grouping is tried.
    topo = build_topology("j", dp=8, tp=2)
    summary = _summary(_ranks(16, {r: 3.0 for r in range(1, 16, 2)}, count=6), kernel=AR)
    assert _found(detect_l3([summary], topo, group_kind=ParallelGroup.DP)) == [
        (FindingKind.LINK_DEGRADED, tuple(range(1, 16, 2)))]
    assert detect_l3([summary], topo) == []


def test_two_groups_a_stage_slow_in_several_stages_are_waiting_not_links() -> None:
    # DP 2 x TP 4 x PP 2, the stream's group not named: stage 0 holds TP groups [0-3] and [4-7], stage 1
    # [8-11] and [12-15]; each stage compares its two.
    topo = build_topology("j", dp=2, tp=4, pp=2)
    assert list(topo.tp_group) == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4 and list(topo.pp_stage) == [0] * 8 + [1] * 8
    # The second data-parallel replica waits for the first (held up by a straggler) in a DP reduce-scatter:
    # its TP groups are slow in every stage, x25 in one (beyond a plausible transfer) and x5 in the other.
    waiting = {r: 25.0 for r in range(4, 8)} | {r: 5.0 for r in range(12, 16)}
    assert detect_l3([_summary(_ranks(16, waiting), kernel=AR, stream=28)], topo) == []
    assert detect_l3([_summary(_ranks(16, waiting | {r: 1.6 for r in range(4, 8)}), kernel=AR, stream=28)],
                     topo) == []
    # One TP group slow in one stage, the other stage's groups even: that group's link.
    res = detect_l3([_summary(_ranks(16, {r: 1.6 for r in range(12, 16)}), kernel=AR, stream=28)], topo)
    assert _found(res) == [(FindingKind.LINK_DEGRADED, (12, 13, 14, 15))]
    assert res[0].evidence["kind_slow_groups"] == 1 and res[0].evidence["groups_compared"] == 2


def test_two_groups_whose_fast_calls_are_slower_by_the_small_set_ratio_are_a_link() -> None:
    # DP 4 x TP 2 x EP 4: expert groups {0, 2, 4, 6} and {1, 3, 5, 7}, named by the trace. The odd group's
    # all-to-all is x2.1 slower in every call; every member of both waits in 60 % of its calls, so at the
    # middle of the calls the ratio is diluted under the x2 that two groups need, while the fast calls show it.
    topo = build_topology("j", dp=4, tp=2, ep=4)
    assert list(topo.ep_group) == [0, 1] * 4
    rng = np.random.default_rng(3)

    def row(r: int, slow: float) -> tuple[int, list[Comp]]:
        base = 1e6 * float(np.exp(0.01 * rng.standard_normal()))
        return (r, [(40, base * slow, base * slow * 1.1), (60, base * (slow + 0.9), base * (slow + 0.9) * 1.1)])

    a2a = "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)"
    rows = [row(r, 2.1 if r % 2 else 1.0) for r in range(8)]
    res = detect_l3([_summary(rows, kernel=a2a, stream=28)], topo, group_kind=ParallelGroup.EP)
    assert _found(res) == [(FindingKind.LINK_DEGRADED, (1, 3, 5, 7))]
    ev = res[0].evidence
    assert ev["transfer_ratio"] == pytest.approx(ev["low_transfer_ratio"]) and ev["transfer_ratio"] > 2.0
    # Waiting alone (the same calls, the fast ones as fast as the other group's) is none.
    rows = [(r, [(40, 1e6, 1.1e6), (60, 1e6 * (3.0 if r % 2 else 1.9), 1e6 * (3.0 if r % 2 else 1.9) * 1.1)])
            for r in range(8)]
    assert detect_l3([_summary(rows, kernel=a2a, stream=28)], topo, group_kind=ParallelGroup.EP) == []


def test_pairs_slow_in_every_stage_are_one_position_waiting_not_links() -> None:
    # DP 2 x TP 2 x PP 2, the stream's group not named: stage 0 holds DP pairs {0, 2} {1, 3}, stage 1 {4, 6}
    # {5, 7}. The ranks of TP index 1 wait for their partners in a TP collective, seen as DP pairs: slow pairs
    # in both stages.
    topo = build_topology("j", dp=2, tp=2, pp=2)
    assert list(topo.dp_group)[:4] == [0, 1, 0, 1] and list(topo.pp_stage) == [0] * 4 + [1] * 4
    assert detect_l3([_summary(_ranks(8, {1: 3.0, 3: 3.0, 5: 2.4, 7: 2.4}), kernel=AR, stream=32)], topo) == []
    # One pair slow in one stage: its link.
    res = detect_l3([_summary(_ranks(8, {1: 3.0, 3: 3.0}), kernel=AR, stream=32)], topo)
    assert _found(res) == [(FindingKind.LINK_DEGRADED, (1, 3))]


def test_a_guessed_grouping_slow_in_several_stages_is_no_link_however_many_groups() -> None:
    # DP 4 x TP 4 x PP 2: four TP groups of four per stage. A replica's TP groups slow in both stages, as
    # ranks waiting in a DP reduce-scatter for a slow stage elsewhere look when read as TP groups.
    topo = build_topology("j", dp=4, tp=4, pp=2)
    assert list(topo.tp_group) == [g for g in range(8) for _ in range(4)] and topo.pp_stage[16] == 1
    slow = {r: 2.6 for r in [*range(12, 16), *range(28, 32)]}
    assert detect_l3([_summary(_ranks(32, slow), kernel=AR, stream=28)], topo) == []
    # Where the trace named the stream's group, four groups a stage have a spread to judge by: both links.
    res = detect_l3([_summary(_ranks(32, slow), kernel=AR, stream=28)], topo, group_kind=ParallelGroup.TP)
    assert _found(res) == [(FindingKind.LINK_DEGRADED, tuple(range(12, 16))),
                           (FindingKind.LINK_DEGRADED, tuple(range(28, 32)))]
    # One slow group in one stage, guessed: its link.
    res = detect_l3([_summary(_ranks(32, {r: 2.6 for r in range(28, 32)}), kernel=AR, stream=28)], topo)
    assert _found(res) == [(FindingKind.LINK_DEGRADED, tuple(range(28, 32)))]
