"""L2: stragglers by phase within parallel groups, and slow pipeline stages (argus.detectors.l2_phases)."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from argus.core.errors import DetectorError
from argus.core.kinds import FindingKind
from argus.detectors import L2Params, PhaseTable, detect_l2, loo_median
from argus.detectors.l2_compare import compare_rows
from argus.detectors.l2_groups import loo_median_rows, row_spreads
from argus.detectors.victims import waiting_victims
from argus.producers.topology import build_topology
from argus.schemas.records import JobTopology, Level, ParallelGroup, PhaseBatch, PhaseKind

PROPERTY = settings(max_examples=60, deadline=None)
MS = 1_000_000
F, B, OPT = PhaseKind.FORWARD, PhaseKind.BACKWARD, PhaseKind.OPTIMIZER
NONE, DP, TP, PP = ParallelGroup.NONE, ParallelGroup.DP, ParallelGroup.TP, ParallelGroup.PP
Phase = tuple[PhaseKind, str, ParallelGroup, int]


def _batch(rank: int, step: int, phases: list[Phase], starts: tuple[int, ...] | None = None) -> PhaseBatch:
    """One PhaseBatch; phases back to back unless ``starts`` is given."""
    kinds, names, groups, durs = zip(*phases, strict=True) if phases else ((), (), (), ())
    n = len(kinds)
    ints = tuple(int(d) for d in durs)
    begin = starts if starts is not None else tuple(int(x) for x in np.cumsum((0, *ints))[:n])
    return PhaseBatch("j", rank, step, tuple(kinds), tuple(names), tuple(groups), (7,) * n, begin, ints)


def _job(topo: JobTopology, steps: int, phases: Callable[[int, int], list[Phase]]) -> PhaseTable:
    return PhaseTable.from_batches(_batch(r, s, phases(r, s)) for s in range(steps) for r in range(topo.world_size))


def _dp_step(world: int, slow: dict[int, float], late_ms: dict[int, float] | None = None,
             jitter: Callable[[int], float] = lambda r: 1.0) -> Callable[[int, int], list[Phase]]:
    """Compute phases (slowed per rank) and a DP all-reduce in which everyone waits for the last arrival."""
    late = late_ms or {}

    def phases(rank: int, step: int) -> list[Phase]:
        f = slow.get(rank, 1.0) * jitter(rank)
        compute = [(F, "forward", NONE, 50 * MS * f), (F, "mlp", NONE, 30 * MS * f),
                   (B, "backward", NONE, 100 * MS * f), (OPT, "optimizer", NONE, 10 * MS)]
        arrive = {r: 160 * MS * slow.get(r, 1.0) * jitter(r) + late.get(r, 0.0) * MS for r in range(world)}
        mine = 160 * MS * f + late.get(rank, 0.0) * MS
        latest = max(arrive.values())
        return [*compute, (PhaseKind.ALL_REDUCE, "dp-allreduce", DP, 4 * MS + latest - mine),
                (PhaseKind.OTHER, "forward-backward", NONE, latest + 4 * MS)]  # aligned total, as Megatron's

    return phases


def _tp_layer_job(topo: JobTopology, steps: int, compute: dict[int, float], tp_ms: dict[int, float]) -> PhaseTable:
    """Megatron-like: a ``self_attention`` phase holding a blocking TP all-reduce (ending together for the
    TP group), then a blocking DP all-reduce and the aligned forward-backward total. ``compute``: per-rank
    compute factor; ``tp_ms``: TP transfer per TP group (2 ms unless given)."""
    world, ms = topo.world_size, float(MS)
    arrive = np.array([100 * ms * compute.get(r, 1.0) for r in range(world)])
    tp_end = {g: max(arrive[r] for r in range(world) if topo.tp_group[r] == g) + tp_ms.get(g, 2.0) * ms
              for g in set(topo.tp_group)}
    layer_end = np.array([tp_end[topo.tp_group[r]] + 1 * ms for r in range(world)])
    dp_end = {g: max(layer_end[r] for r in range(world) if topo.dp_group[r] == g) + 4 * ms for g in set(topo.dp_group)}
    total = max(dp_end.values())
    batches = []
    for step in range(steps):
        for r in range(world):
            t, d = tp_end[topo.tp_group[r]], dp_end[topo.dp_group[r]]
            phases = [(F, "self_attention", NONE, layer_end[r]),
                      (PhaseKind.ALL_REDUCE, "tp-allreduce", TP, t - arrive[r]),
                      (PhaseKind.ALL_REDUCE, "dp-allreduce", DP, d - layer_end[r]),
                      (PhaseKind.OTHER, "forward-backward", NONE, total)]
            batches.append(_batch(r, step, phases, starts=(0, int(arrive[r]), int(layer_end[r]), 0)))
    return PhaseTable.from_batches(batches)


def _by_kind(results: list) -> dict[FindingKind, list]:
    out: dict[FindingKind, list] = {}
    for r in results:
        out.setdefault(r.kind, []).append(r)
    return out


# -- helpers -----------------------------------------------------------------------------------------


@PROPERTY
@given(st.lists(st.floats(-1e6, 1e6), min_size=0, max_size=30))
def test_loo_median_matches_brute_force(values: list[float]) -> None:
    got = loo_median(values)
    assert got.shape == (len(values),)
    for i in range(len(values)):
        rest = values[:i] + values[i + 1:]
        if rest:
            assert got[i] == pytest.approx(float(np.median(rest)))
        else:
            assert np.isnan(got[i])


@PROPERTY
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 40), width=st.integers(2, 60),
       ties=st.booleans(), nan=st.booleans())
def test_row_spreads_are_numpys(seed: int, rows: int, width: int, ties: bool, nan: bool) -> None:
    """Leave-one-out medians, medians and MADs per row: the values of numpy's calls, bit for bit, whether the
    rows are short (compiled, by insertion) or long, with ties, with NaN."""
    rng = np.random.default_rng(seed)
    v = rng.integers(0, 4, (rows, width)).astype(np.float64) if ties else rng.normal(1e6, 1e4, (rows, width))
    if nan:
        v[rng.integers(0, rows), rng.integers(0, width)] = np.nan
    loo, med, mad = row_spreads(v)
    want_med = np.median(v, axis=1, keepdims=True)
    assert np.array_equal(loo, loo_median_rows(v), equal_nan=True)
    assert np.array_equal(med, want_med, equal_nan=True)
    assert np.array_equal(mad, np.median(np.abs(v - want_med), axis=1, keepdims=True), equal_nan=True)
    with pytest.raises(DetectorError):
        row_spreads(v[:, :1])


def test_phase_table_aggregates_and_deduplicates() -> None:
    b1 = _batch(0, 0, [(F, "mlp", NONE, 5), (F, "mlp", NONE, 7), (B, "mlp", NONE, 11), (F, "fwd", NONE, 3)])
    b2 = _batch(1, 0, [(F, "fwd", NONE, 4)])
    stale = _batch(1, 1, [(F, "fwd", NONE, 999)])
    fresh = _batch(1, 1, [(F, "fwd", NONE, 6)])
    t = PhaseTable.from_batches([b1, b2, stale, fresh])
    rows = {(int(r), int(s), t.names[p], t.kinds[p]): (int(d), int(c))
            for r, s, p, d, c in zip(t.rank, t.step, t.phase, t.duration_ns, t.count, strict=True)}
    assert rows == {(0, 0, "mlp", F): (12, 2), (0, 0, "mlp", B): (11, 1), (0, 0, "fwd", F): (3, 1),
                    (1, 0, "fwd", F): (4, 1), (1, 1, "fwd", F): (6, 1)}
    assert len(t) == 5 and not t.rank.flags.writeable
    assert len(PhaseTable.from_batches([])) == 0
    with pytest.raises(DetectorError):
        PhaseTable(t.rank, t.step, t.phase + 10, t.duration_ns, t.count, t.names, t.kinds, t.groups)
    with pytest.raises(DetectorError):
        PhaseTable(t.rank, t.step[:2], t.phase, t.duration_ns, t.count, t.names, t.kinds, t.groups)


# -- compute stragglers ------------------------------------------------------------------------------


def test_compute_straggler_named_with_short_collective_and_peers_spared() -> None:
    topo = build_topology("j", dp=8)
    res = detect_l2(_job(topo, 10, _dp_step(8, {5: 3.0})), topo)
    assert [(r.kind, r.ranks) for r in res] == [(FindingKind.COMPUTE_STRAGGLER, (5,))]
    r = res[0]
    assert r.level is Level.L2 and r.steps == ()
    assert r.phase in {"forward", "mlp", "backward"} and r.score == pytest.approx(3.0, rel=0.01)
    ev = r.evidence
    assert ev["collective_short"] is True and ev["late_arrival_only"] is False
    assert ev["short_collectives_peers_over_rank_ratio"]["dp-allreduce:ALL_REDUCE"] > 10
    assert ev["group"] == "DP0" and ev["robust_z"] > 3.5 and ev["group_cv"] > 0


def test_a_straggler_is_named_by_the_phase_that_holds_its_slowdown_not_a_short_one_more_elevated() -> None:
    # Rank 2 does 200 ms of extra work in its forward (x101); starved of CPU after it, its optimizer step of
    # 50 us takes 10 ms (x200, the most elevated phase, but 5 % of the excess): the forward names it.
    topo = build_topology("j", dp=4)

    def phases(rank: int, step: int) -> list[tuple[PhaseKind, str, ParallelGroup, float]]:
        slow = rank == 2
        fwd, opt = (202 if slow else 2) * MS, (10 if slow else 0.05) * MS
        mine, latest = fwd + 4 * MS + opt, 202 * MS + 4 * MS + 10 * MS
        return [(F, "forward", NONE, fwd), (B, "backward", NONE, 4 * MS), (OPT, "optimizer", NONE, opt),
                (PhaseKind.ALL_REDUCE, "dp-allreduce", DP, MS + latest - mine)]

    (res,) = detect_l2(_job(topo, 10, phases), topo)
    assert res.ranks == (2,) and res.phase == "forward" and res.score == pytest.approx(101, rel=0.01)
    assert res.evidence["elevated_phases_ratio"]["optimizer:OPTIMIZER"] == pytest.approx(200, rel=0.01)
    (top,) = detect_l2(_job(topo, 10, phases), topo, L2Params(name_share=0.0))
    assert top.phase == "optimizer"  # the most elevated of all


def test_group_of_two_and_only_within_dp_groups() -> None:
    topo = build_topology("j", dp=2, pp=2)  # DP groups {0, 1} and {2, 3}
    work = {0: 1, 1: 3, 2: 4, 3: 4}
    res = detect_l2(_job(topo, 5, lambda r, s: [(F, "fwd", NONE, 10 * MS * work[r])]), topo)
    assert [(r.kind, r.ranks) for r in res] == [(FindingKind.COMPUTE_STRAGGLER, (1,))]
    # stage 1 doing 4x the forward work of stage 0 is no straggler: they are never compared
    assert detect_l2(_job(topo, 5, lambda r, s: [(F, "fwd", NONE, 10 * MS * (4 if r >= 2 else 1))]), topo) == []


@PROPERTY
@given(spread=st.floats(0.0, 0.4), seed=st.integers(0, 2**31), dp=st.sampled_from([2, 3, 4, 8, 16]))
def test_benign_spread_never_flags(spread: float, seed: int, dp: int) -> None:
    topo = build_topology("j", dp=dp)
    factor = 1.0 + spread * np.random.default_rng(seed).uniform(0.0, 1.0, dp)  # max/min < 1.4
    assert detect_l2(_job(topo, 5, _dp_step(dp, {}, jitter=lambda r: float(factor[r]))), topo) == []


def test_late_arrival_without_slow_phase() -> None:
    topo = build_topology("j", dp=8)
    res = detect_l2(_job(topo, 5, _dp_step(8, {}, late_ms={2: 250.0})), topo)  # e.g. a slow data loader
    assert [(r.kind, r.ranks, r.phase) for r in res] == [(FindingKind.COMPUTE_STRAGGLER, (2,), "dp-allreduce")]
    assert res[0].evidence["late_arrival_only"] is True
    assert res[0].evidence["lateness_over_longest_phase_ratio"] > 0.5
    assert res[0].score > 50
    # 12 ms late: 4x shorter all-reduce, but only 7 % of a step: no finding, and the peers are spared too
    assert detect_l2(_job(topo, 5, _dp_step(8, {}, late_ms={2: 12.0})), topo) == []


def test_tp_victim_of_a_straggler_is_not_named() -> None:
    topo = build_topology("j", dp=4, tp=2)  # TP groups {0,1} {2,3} ...; DP groups {0,2,4,6} {1,3,5,7}

    def phases(rank: int, step: int) -> list[Phase]:
        slow = rank == 0
        fwd = 100 * MS * (4 if slow else 1)
        tp_wait = 300 * MS if rank == 1 else 0  # rank 1 waits for rank 0 in their blocking TP all-reduce
        done = fwd + tp_wait + 2 * MS
        latest = 400 * MS + 2 * MS
        return [(F, "fwd", NONE, fwd), (PhaseKind.ALL_REDUCE, "tp-allreduce", TP, 2 * MS + tp_wait),
                (PhaseKind.ALL_REDUCE, "dp-allreduce", DP, 4 * MS + latest - done)]

    res = detect_l2(_job(topo, 5, phases), topo)
    assert [(r.kind, r.ranks) for r in res] == [(FindingKind.COMPUTE_STRAGGLER, (0,))]


def test_phase_table_nests_blocking_collectives_in_compute_phases() -> None:
    phases = [(F, "forward", NONE, 150), (F, "self_attention", NONE, 100), (PhaseKind.ALL_REDUCE, "tp-ar", TP, 30),
              (PhaseKind.ALL_REDUCE, "dp-ar", DP, 40), (PhaseKind.DATA_LOADER, "data", NONE, 100),
              (PhaseKind.SEND_RECV, "p2p", PP, 20)]
    t = PhaseTable.from_batches([_batch(0, 0, phases, starts=(0, 0, 40, 50, 0, 140))])
    nested = {t.names[p]: int(n) for p, n in zip(t.phase, t.nested_ns, strict=True)}
    # TP and PP block the compute stream; DP buckets overlap it; host phases and collectives nest nothing
    assert nested == {"forward": 30 + 10, "self_attention": 30, "tp-ar": 0, "dp-ar": 0, "data": 0, "p2p": 0}
    own = {t.names[p]: int(o) for p, o in zip(t.phase, t.own_ns, strict=True)}
    assert own["forward"] == 110 and own["self_attention"] == 70 and own["dp-ar"] == 40
    # no start times (or one phase): nothing nests
    assert not PhaseTable.from_batches([_batch(0, 0, phases[:1])]).nested_ns.any()


def test_tp_partner_waiting_inside_its_compute_phase_is_a_victim() -> None:
    topo = build_topology("j", dp=4, tp=2)  # TP groups {0,1} {2,3} ...; DP groups {0,2,4,6} {1,3,5,7}
    table = _tp_layer_job(topo, 5, {0: 4.0}, {})
    # rank 1's self_attention is as long as rank 0's: it waited in the nested TP all-reduce
    sa = table.names.index("self_attention")
    dur = {int(r): int(d) for r, p, d in zip(table.rank, table.phase, table.duration_ns, strict=True) if p == sa}
    assert dur[1] == dur[0] > 3.5 * dur[3]
    res = detect_l2(table, topo)
    assert [(r.kind, r.ranks, r.phase) for r in res] == [(FindingKind.COMPUTE_STRAGGLER, (0,), "self_attention")]
    assert res[0].score == pytest.approx(401 / 101, rel=0.01)  # own time: compute + 1 ms, TP wait excluded
    assert res[0].evidence["short_collectives_peers_over_rank_ratio"]["tp-allreduce:ALL_REDUCE"] > 100


def test_degraded_tp_link_inside_compute_phases_is_no_straggler() -> None:
    topo = build_topology("j", dp=4, tp=2)
    table = _tp_layer_job(topo, 5, {}, {1: 160.0})  # TP group {2, 3}: 80x slower transfer
    # their layers are 2.6x their DP peers', and they arrive 158 ms late to the DP all-reduce, but all of
    # it is time in their own TP all-reduce: network, which L3 attributes
    assert detect_l2(table, topo) == []


def test_victims_chain_through_late_arrivals() -> None:
    topo = build_topology("j", dp=4, tp=2, pp=2)  # 5's TP partner 4; 4's next stage 12 (PP group of 4)
    # 13: 5's next stage; 3 and 7 share only a DP group with 5 (and 1 with 3): no waiting links them
    assert waiting_victims({5}, {4, 12, 13, 3, 7, 1}, topo) == {4, 12, 13}
    assert waiting_victims({5}, {5}, topo) == set() and waiting_victims(set(), {4, 12}, topo) == set()


def _victims_pairwise(stragglers: set[int], late: set[int], topology: JobTopology) -> set[int]:
    """waiting_victims as first written: every late rank against every frontier rank, group by group."""
    pos = {r: i for i, r in enumerate(topology.rank)}
    columns = [getattr(topology, g.column) for g in (ParallelGroup.TP, ParallelGroup.PP, ParallelGroup.EP)]

    def shares(r: int, s: int) -> bool:
        return any(col[pos[s]] == col[pos[r]] for col in columns)

    victims: set[int] = set()
    frontier = set(stragglers)
    while frontier:
        frontier = {r for r in late - stragglers - victims if any(shares(r, s) for s in frontier)}
        victims |= frontier
    return victims


@PROPERTY
@given(seed=st.integers(0, 2**32 - 1), dp=st.integers(1, 4), tp=st.sampled_from([1, 2, 4]), pp=st.integers(1, 4),
       ep=st.sampled_from([1, 2]))
def test_victims_as_the_pairwise_rule(seed: int, dp: int, tp: int, pp: int, ep: int) -> None:
    topo = build_topology("j", dp=dp * ep, tp=tp, pp=pp, ep=ep)
    rng = np.random.default_rng(seed)
    ranks = np.array(topo.rank)
    stragglers = set(rng.choice(ranks, size=min(int(rng.integers(0, 3)), ranks.size), replace=False).tolist())
    late = set(ranks[rng.random(ranks.size) < rng.random()].tolist())
    assert waiting_victims(stragglers, late, topo) == _victims_pairwise(stragglers, late, topo)


def test_host_phase_straggler_and_onset() -> None:
    topo = build_topology("j", dp=4)

    def phases(rank: int, step: int) -> list[Phase]:
        slow = rank == 3 and step >= 6
        return [(PhaseKind.DATA_LOADER, "dataloader", NONE, 20 * MS * (5 if slow else 1)), (F, "fwd", NONE, 50 * MS)]

    table = _job(topo, 12, phases)
    full = detect_l2(table, topo)
    post = detect_l2(table, topo, onset_step=6)
    assert [(r.kind, r.ranks, r.phase) for r in post] == [(FindingKind.PHASE_STRAGGLER, (3,), "dataloader")]
    assert post[0].score == pytest.approx(5.0) and full[0].score < post[0].score
    assert detect_l2(table, topo, onset_step=10) == []  # 2 analysed steps < min_steps


# -- pipeline stages ---------------------------------------------------------------------------------


def test_slow_last_stage_found_despite_uneven_counts() -> None:
    topo = build_topology("j", dp=2, pp=4)

    def phases(rank: int, step: int) -> list[Phase]:
        stage = topo.pp_stage[rank]
        factor = 1.9 if stage == 3 else 1.0
        straggler = 10.0 if rank == 0 else 1.0
        sends = 4 if stage in (0, 3) else 8  # first/last stage run half the pipeline transfers
        return ([(B, "backward", NONE, 20 * MS * factor * straggler)] * 8 + [(F, "forward", NONE, 10 * MS)] * 8
                + [(PhaseKind.SEND_RECV, "pp-send-recv", PP, 1 * MS)] * sends)

    res = _by_kind(detect_l2(_job(topo, 5, phases), topo))
    assert [r.ranks for r in res[FindingKind.COMPUTE_STRAGGLER]] == [(0,)]
    (stage,) = res[FindingKind.PP_STAGE_SLOW]
    assert stage.ranks == (6, 7) and stage.phase == "backward"
    assert stage.score == pytest.approx(1.9, rel=0.01)
    assert stage.evidence["stage"] == 3
    assert set(res) == {FindingKind.COMPUTE_STRAGGLER, FindingKind.PP_STAGE_SLOW}


def test_a_phase_overlapped_by_a_transfer_in_flight_makes_its_peer_no_straggler() -> None:
    # DP 2 x PP 2: ranks 2 and 3 (stage 1) run the same 10 ms optimizer. Rank 3's last pipeline send, over a
    # slow link, started before its optimizer and runs on through it (another stream): taken for blocking,
    # it leaves rank 3 no own optimizer time, so rank 2's looks infinitely elevated. But rank 2's optimizer is
    # no longer than rank 3's: it made nobody wait. A rank whose phase is really slower is still named.
    topo = build_topology("j", dp=2, pp=2)

    def job(slow_rank: int | None) -> PhaseTable:
        batches = []
        for step in range(5):
            for r in range(4):
                opt = 10 * (3 if r == slow_rank else 1)
                phases: list[Phase] = [(F, "forward", NONE, 50 * MS), (B, "backward", NONE, 100 * MS),
                                       (OPT, "optimizer", NONE, opt * MS)]
                starts = [0, 50 * MS, 150 * MS]
                if r >= 2:
                    send = 15 if r == 3 else 1
                    phases.append((PhaseKind.SEND_RECV, "nccl:send prev", PP, send * MS))
                    starts.append(149 * MS)
                batches.append(_batch(r, step, phases, starts=tuple(starts)))
        return PhaseTable.from_batches(batches)

    table = job(None)
    keys = zip(table.rank.tolist(), [table.names[i] for i in table.phase], strict=True)
    own = dict(zip(keys, table.own_ns.tolist(), strict=True))
    assert own[(3, "optimizer")] == 0 and own[(2, "optimizer")] == 10 * MS
    assert [r for r in detect_l2(table, topo) if r.kind is FindingKind.COMPUTE_STRAGGLER] == []
    slow = [r for r in detect_l2(job(2), topo) if r.kind is FindingKind.COMPUTE_STRAGGLER]
    assert [(r.ranks, r.phase) for r in slow] == [((2,), "optimizer")]


def test_a_stage_whose_every_rank_waits_for_its_straggler_is_not_slow() -> None:
    # DP 2 x TP 2 x PP 2 x EP 2: stage 0 = ranks 0-3, TP {0, 1}, {2, 3}, EP {0, 2}, {1, 3}. Rank 0's forward
    # is 3x; every rank of stage 0 waits for it inside its backward (an EP all-to-all without collective
    # records), so stage 0's backward is 2x stage 1's. Every rank of stage 0 shares a TP or EP group with the
    # straggler or with such a rank: the stage is explained by it.
    topo = build_topology("j", dp=2, tp=2, pp=2, ep=2)

    def job(straggler: bool, records: bool = False) -> Callable[[int, int], list[Phase]]:
        def phases(rank: int, step: int) -> list[Phase]:
            fwd = 30 if straggler and rank == 0 else 10
            bwd = 40 if topo.pp_stage[rank] == 0 else 20
            tp = [(PhaseKind.ALL_REDUCE, "tp-allreduce", TP, 1 * MS)] if records else []
            return [(F, "forward", NONE, fwd * MS), (B, "backward", NONE, bwd * MS), *tp]
        return phases

    res = _by_kind(detect_l2(_job(topo, 5, job(True)), topo))
    assert set(res) == {FindingKind.COMPUTE_STRAGGLER} and res[FindingKind.COMPUTE_STRAGGLER][0].ranks == (0,)
    # Without the straggler, and still without collective records, the stage's phases cannot tell a slow stage
    # from one whose every rank waits for a straggler nobody named: one slow member of its TP and EP groups
    # holds up all four. Only its kernels tell (argus.detectors.l3_ranks.detect_stage_excess).
    assert FindingKind.PP_STAGE_SLOW not in _by_kind(detect_l2(_job(topo, 5, job(False)), topo))
    # Where the ranks record their blocking collectives, waiting is out of the phases: a slow stage.
    (stage,) = _by_kind(detect_l2(_job(topo, 5, job(False, records=True)), topo))[FindingKind.PP_STAGE_SLOW]
    assert stage.ranks == (0, 1, 2, 3) and stage.score == pytest.approx(2.0)


def test_bad_input_raises() -> None:
    topo = build_topology("j", dp=2)
    table = PhaseTable.from_batches([_batch(r, s, [(F, "f", NONE, 5)]) for r in range(3) for s in range(4)])
    with pytest.raises(DetectorError):
        detect_l2(table, topo)
    for bad in ({"min_elevation": 1.0}, {"min_z": -1.0}, {"mad_floor": 0.0}, {"collective_ratio": float("inf")},
                {"stage_ratio": 0.5}, {"min_steps": 0}, {"min_late_fraction": -0.1}, {"late_arrival_ratio": 1.0},
                {"stands_out": math.nan}, {"min_pairs": 1}, {"pair_min_z": -1.0}, {"pairs_alpha": 0.0},
                {"pairs_alpha": 1.0}, {"wall_share": -0.1}, {"waited_explains": math.inf}, {"waited_own": -1.0}):
        with pytest.raises(DetectorError):
            L2Params(**bad)  # type: ignore[arg-type]


def test_pipeline_neighbour_late_because_it_waited_is_the_late_ranks_victim() -> None:
    # DP 2 x PP 2: stage 0 = ranks 0, 1; stage 1 = ranks 2, 3; pipelines {0, 2} and {1, 3}. Rank 2 is 250 ms
    # late of itself (outside any phase); rank 0 waits 100 ms longer for its gradients and starts its
    # backward later, so it reaches its DP all-reduce 250 ms late too, with only 40 % of that spent waiting.
    topo = build_topology("j", dp=2, pp=2)
    arrive = {0: 10 + 100 + 150 + 100, 1: 10 + 100, 2: 200 + 250, 3: 200}

    def phases(rank: int, step: int) -> list[Phase]:
        peer = rank ^ 1
        ar = 4 + max(arrive[rank], arrive[peer]) - arrive[rank]
        if rank < 2:
            recv = 10 + (100 if rank == 0 else 0)
            return [(PhaseKind.SEND_RECV, "nccl:recv next", PP, recv * MS), (B, "backward", NONE, 100 * MS),
                    (PhaseKind.ALL_REDUCE, "dp-allreduce", DP, ar * MS)]
        return [(F, "forward", NONE, 200 * MS), (PhaseKind.SEND_RECV, "nccl:send prev", PP, 10 * MS),
                (PhaseKind.ALL_REDUCE, "dp-allreduce", DP, ar * MS)]

    res = detect_l2(_job(topo, 5, phases), topo)
    assert [(r.kind, r.ranks) for r in res] == [(FindingKind.COMPUTE_STRAGGLER, (2,))]


def test_a_reduction_across_pipeline_stages_names_no_late_stage() -> None:
    # The first stage ends its backward last: the later stages wait for it in a PP-wide all-reduce.
    topo = build_topology("j", dp=2, pp=2)

    def phases(rank: int, step: int) -> list[Phase]:
        wait = 4 if rank < 2 else 300
        return [(F, "forward", NONE, 100 * MS), (B, "backward", NONE, 200 * MS),
                (PhaseKind.ALL_REDUCE, "grad-norm", PP, wait * MS)]

    assert detect_l2(_job(topo, 5, phases), topo) == []


def test_a_member_whose_collective_took_no_measurable_time_gets_a_finite_ratio() -> None:
    # A last arrival whose collective ended at once reads 0 ns: the ratio to its peers is floored at the clock's
    # 1 ns resolution (an infinite score is no finding: it raised instead of being judged).
    value = np.array([[0.0, 2e5, 2.1e5, 1.9e5], [0.0, 0.0, 0.0, 0.0]])
    ratio, _, _, _, hit = compare_rows(value, L2Params(), collective=True)
    assert np.isfinite(ratio).all() and ratio[0, 0] == pytest.approx(1.0 / 2e5) and hit[0, 0]
    assert (ratio[1] == 1.0).all() and not hit[1].any()


def test_a_tp_group_elevated_alike_names_none_even_where_one_member_alone_crosses_the_ratio() -> None:
    topo = build_topology("j", dp=4, tp=4)  # TP groups {0-3} {4-7} ...; DP groups {0, 4, 8, 12} ...
    assert list(topo.tp_group[:4]) == [0] * 4 and topo.dp_group[0] == topo.dp_group[4]
    # A degraded TP link inside phases that do not tell it from compute: the whole group at ~1.5x its DP
    # peers, and which member crosses 1.5x is noise.
    alike = {0: 1.49, 1: 1.51, 2: 1.48, 3: 1.495}
    assert detect_l2(_job(topo, 5, _dp_step(16, alike)), topo) == []
    # One member 1.3x more elevated than the rest of its group stands out: the cause.
    res = detect_l2(_job(topo, 5, _dp_step(16, alike | {1: 2.0})), topo)
    assert [(r.kind, r.ranks) for r in _by_kind(res)[FindingKind.COMPUTE_STRAGGLER]] == [
        (FindingKind.COMPUTE_STRAGGLER, (1,))]
    # A straggler alone in its group is named.
    res = detect_l2(_job(topo, 5, _dp_step(16, {1: 1.51})), topo)
    assert [r.ranks for r in _by_kind(res)[FindingKind.COMPUTE_STRAGGLER]] == [(1,)]


def tp_pairs_batches(dp: int, seed: int, slow: dict[int, float], steps: int = 8
                     ) -> tuple[JobTopology, list[PhaseBatch]]:
    """DP x TP2 traced without compute phases (only the TP reduce-scatter that closes each rank's 100 ms of
    compute, ending together for the pair, 0.7 ms of transfer): every GPU has a persistent speed of its own
    (lognormal, 2.5 %) and each step a little noise (1 %); ``slow``: rank -> factor on its compute."""
    topo = build_topology("j", dp=dp, tp=2)
    rng = np.random.default_rng(seed)
    speed = rng.lognormal(0.0, 0.025, topo.world_size) * np.array([slow.get(r, 1.0) for r in range(topo.world_size)])
    batches = []
    for step in range(steps):
        arrive = 100 * MS * speed * rng.lognormal(0.0, 0.01, topo.world_size)
        for r in range(topo.world_size):
            end = max(arrive[q] for q in range(topo.world_size) if topo.tp_group[q] == topo.tp_group[r]) + 0.7 * MS
            batches.append(_batch(r, step, [(PhaseKind.REDUCE_SCATTER, "tp-reduce-scatter", TP, end - arrive[r])],
                                  starts=(int(arrive[r]),)))
    return topo, batches


def _tp_pairs_job(dp: int, seed: int, slow: dict[int, float], steps: int = 8) -> tuple[JobTopology, PhaseTable]:
    topo, batches = tp_pairs_batches(dp, seed, slow, steps)
    return topo, PhaseTable.from_batches(batches)


def test_the_most_different_of_many_gpu_pairs_is_no_straggler() -> None:
    # In a pair there is no peer to score a member against: of 32 pairs of GPUs a few percent apart, one pair
    # differs most, its slower member's collective several times shorter than its partner's, every step.
    for seed in range(12):
        topo, table = _tp_pairs_job(32, seed, {})
        assert detect_l2(table, topo) == [], seed


@pytest.mark.parametrize("dp", [4, 32])
def test_a_straggler_in_a_gpu_pair_stands_out_among_the_pairs(dp: int) -> None:
    found = 0
    for seed in range(12):
        topo, table = _tp_pairs_job(dp, seed, {5: 1.3})
        res = detect_l2(table, topo)
        assert {r.ranks for r in res} <= {(5,)}, seed
        found += bool(res)
        if res:
            assert res[0].evidence["late_arrival_only"] and res[0].evidence["robust_z"] <= -5.5
    assert found >= 11


@pytest.mark.parametrize("seed", [0, 1, 5])
def test_late_arrivals_alike_of_one_dp_group_are_its_not_stragglers(seed: int) -> None:
    # DP 4 x TP 2 without compute phases: ranks 0 and 6 are of one DP group, each in another TP pair. A degraded
    # DP link delays its members into their TP collectives alike: late together, neither is named (the link is
    # L3's to find). One of them late by far more than the other stands out: the cause.
    topo, table = _tp_pairs_job(4, seed, {0: 1.5, 6: 1.5})
    assert topo.dp_group[0] == topo.dp_group[6] and topo.tp_group[0] != topo.tp_group[6]
    assert detect_l2(table, topo) == []
    topo, table = _tp_pairs_job(4, seed, {0: 1.3, 6: 2.0})
    assert {r.ranks for r in detect_l2(table, topo)} == {(6,)}
    # Late alike in two DP groups: each is named.
    topo, table = _tp_pairs_job(4, seed, {0: 1.5, 3: 1.5})
    assert topo.dp_group[0] != topo.dp_group[3]
    assert {r.ranks for r in detect_l2(table, topo)} == {(0,), (3,)}


def test_a_stage_with_two_stragglers_in_a_group_of_four_is_no_slow_stage() -> None:
    # Two of a DP group of four slow 2.6x: too many for the group's own z-score (the peers' median is half
    # slow), and the stage's median rank is half slow too. Its fastest ranks run as the other stage's.
    topo = build_topology("j", dp=4, pp=2)
    slow = {0: 2.6, 3: 2.6}

    def phases(rank: int, step: int) -> list[Phase]:
        f = slow.get(rank, 1.0) * (1.0 + 0.01 * ((rank * 7 + step * 3) % 5))
        return [(F, "forward", NONE, 50 * MS * f), (B, "backward", NONE, 100 * MS * f),
                (PhaseKind.ALL_REDUCE, "dp-allreduce", DP, 4 * MS)]

    res = detect_l2(_job(topo, 6, phases), topo)
    assert FindingKind.PP_STAGE_SLOW not in {r.kind for r in res}, res
    # The whole stage 2.6x slower is one.
    slow.update({1: 2.6, 2: 2.6})
    res = detect_l2(_job(topo, 6, phases), topo)
    assert [(r.kind, r.ranks) for r in res if r.kind is FindingKind.PP_STAGE_SLOW] == [
        (FindingKind.PP_STAGE_SLOW, (0, 1, 2, 3))]
