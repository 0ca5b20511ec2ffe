"""The pure hang detector: stalls, silent ranks, the hang wavefront (suspects and victims per group), resumption,
and their findings."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from argus.core.kinds import FindingKind
from argus.detectors.findings import to_finding
from argus.detectors.hangs import HangParams, RankLiveness, detect_hangs, job_resumed
from argus.producers.topology import build_topology
from argus.schemas.records import Heartbeat, JobTopology, Level, ParallelGroup, PhaseKind

T0 = 1_767_225_600_000_000_000
STEP = 150_000_000  # median step time, ns
P = HangParams(stall_k=2.0, stall_floor_ns=100_000_000, heartbeat_interval_ns=100_000_000, silent_heartbeats=3)


def _hung(topo: JobTopology, hung: int, seq: int, now: int) -> dict[int, RankLiveness]:
    """Every rank of ``hung``'s DP group waits in DP allreduce ``seq``; ``hung`` is stuck in its backward."""
    i = topo.rank.index(hung)
    out = {}
    for r, g in zip(topo.rank, topo.dp_group, strict=True):
        if r == hung:
            out[r] = RankLiveness(r, now - 10_000_000, 12, "backward")
        elif g == topo.dp_group[i]:
            out[r] = RankLiveness(r, now - 10_000_000, 12, "dp-allreduce", PhaseKind.ALL_REDUCE, ParallelGroup.DP,
                                  g, seq, now - 400_000_000)
        else:  # other DP groups are blocked behind the hung group elsewhere (a TP collective with its peers)
            out[r] = RankLiveness(r, now - 10_000_000, 12, "tp-allreduce", PhaseKind.ALL_REDUCE, ParallelGroup.TP,
                                  -1, 40, now - 300_000_000)
    return out


def test_healthy_job_raises_nothing() -> None:
    topo = build_topology("j", 4, 2, 1)
    now = T0 + 10 * STEP
    live = {r: RankLiveness(r, now - STEP // 2, 9, "forward") for r in topo.rank}
    assert detect_hangs(live, topo, now, now - STEP // 3, 9, STEP, P) == []


def test_hang_names_the_suspect_and_its_victims() -> None:
    topo = build_topology("j", 8, 2, 2)
    now = T0 + 100 * STEP
    results = detect_hangs(_hung(topo, 5, 30, now), topo, now, now - 3 * STEP, 11, STEP, P)
    kinds = [r.kind for r in results]
    assert kinds.count(FindingKind.JOB_STALLED) == 1 and FindingKind.RANK_SILENT not in kinds
    stalled = results[kinds.index(FindingKind.JOB_STALLED)]
    assert stalled.evidence["last_completed_step"] == 11 and abs(stalled.evidence["seconds_stalled"] - 0.45) < 1e-9
    waves = [r for r in results if r.kind is FindingKind.HANG_WAVEFRONT]
    dp = [w for w in waves if w.evidence["group"] == "DP"]
    assert len(dp) == 1 and dp[0].ranks == (5,)
    ev = dp[0].evidence
    peers = [r for r, g in zip(topo.rank, topo.dp_group, strict=True) if g == topo.dp_group[5] and r != 5]
    assert ev["victims"] == peers and ev["first_ranks"] == [5] and ev["first_of_wavefront"]
    assert (ev["collective"], ev["seq"], ev["step"], ev["phase"]) == ("ALL_REDUCE", 30, 12, "dp-allreduce")
    # 5's TP partner waits for it in a TP collective: 5 is that group's suspect too, and first everywhere
    assert all(5 in w.evidence["first_ranks"] for w in waves)
    f = to_finding("j", dp[0], now)
    assert (f.level, f.kind, f.ranks, f.phase, f.steps) == (Level.L2, "hang_wavefront", (5,), "dp-allreduce", (12,))
    assert to_finding("j", stalled, now).level is Level.L1
    # re-derived a tick later: the same finding ids (the sink and stream deduplicate)
    again = detect_hangs(_hung(topo, 5, 30, now + STEP), topo, now + STEP, now - 3 * STEP, 11, STEP, P)
    assert {to_finding("j", r, now).finding_id for r in results} == {to_finding("j", r, now).finding_id
                                                                     for r in again}


def test_a_rank_that_never_finished_the_earlier_collective_is_the_suspect() -> None:
    topo = build_topology("j", 4, 1, 1)
    now = T0 + 100 * STEP
    live = {r: RankLiveness(r, now, 3, "dp-allreduce", PhaseKind.ALL_REDUCE, ParallelGroup.DP, 0, 8, now - STEP)
            for r in (0, 1, 3)}
    live[2] = RankLiveness(2, now, 3, "dp-allreduce", PhaseKind.ALL_REDUCE, ParallelGroup.DP, 0, 7, now - 9 * STEP)
    (wave,) = [r for r in detect_hangs(live, topo, now, now - 5 * STEP, 2, STEP, P)
               if r.kind is FindingKind.HANG_WAVEFRONT]
    assert wave.ranks == (2,) and wave.evidence["victims"] == [0, 1, 3] and wave.evidence["first_ranks"] == [2]


def test_silent_rank_and_all_silent_is_the_job() -> None:
    topo = build_topology("j", 4, 1, 1)
    now = T0 + 100 * STEP
    live = {r: RankLiveness(r, now - STEP // 2, 20, "forward") for r in topo.rank}
    live[3] = RankLiveness(3, now - 5 * STEP, 17, "mlp")
    (res,) = detect_hangs(live, topo, now, now - STEP // 2, 19, STEP, P)
    assert (res.kind, res.ranks, res.level, res.evidence["last_step"]) == (FindingKind.RANK_SILENT, (3,), Level.L2, 17)
    assert abs(res.evidence["seconds_silent"] - 0.75) < 1e-9
    quiet = {r: RankLiveness(r, now - 5 * STEP, 20, "") for r in topo.rank}
    out = detect_hangs(quiet, topo, now, now - 5 * STEP, 19, STEP, P)
    assert [r.kind for r in out] == [FindingKind.JOB_STALLED] and out[0].evidence["all_ranks_silent"]


def test_checkpoint_pause_names_no_rank_and_resumes() -> None:
    """All ranks idle a few step times (a checkpoint), heartbeats going on: job_stalled, then job_resumed."""
    topo = build_topology("j", 4, 2, 1)
    now = T0 + 100 * STEP
    live = {r: RankLiveness(r, now - 50_000_000, 30, "checkpoint") for r in topo.rank}
    out = detect_hangs(live, topo, now, now - 4 * STEP, 29, STEP, P)
    assert [r.kind for r in out] == [FindingKind.JOB_STALLED]
    end = job_resumed(now - 4 * STEP, now + STEP, 30)
    assert (end.kind, end.level, end.steps) == (FindingKind.JOB_RESUMED, Level.L1, (30,))
    assert abs(end.evidence["seconds_stalled"] - 0.75) < 1e-9
    assert to_finding("j", end, now + STEP).kind == "job_resumed"


def test_stall_bound_and_liveness_from_heartbeat() -> None:
    assert P.stall_bound_ns(STEP) == 300_000_000 and P.stall_bound_ns(float("nan")) == 100_000_000
    assert HangParams().silent_bound_ns(STEP) == 6_000_000_000
    hb = Heartbeat("j", 2, T0, 5, "dp-allreduce", PhaseKind.ALL_REDUCE, PhaseKind.ALL_REDUCE, ParallelGroup.DP, 1,
                   4, T0 - 7)
    s = RankLiveness.from_heartbeat(hb)
    assert (s.rank, s.last_seen_ns, s.collective, s.group_index, s.seq, s.waiting) == (
        2, T0, PhaseKind.ALL_REDUCE, 1, 4, True)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(dp=st.integers(2, 6), tp=st.sampled_from([1, 2]), pp=st.sampled_from([1, 2]), data=st.data())
def test_property_the_hung_rank_is_named_first_and_never_a_victim(dp: int, tp: int, pp: int,
                                                                 data: st.DataObject) -> None:
    topo = build_topology("j", dp, tp, pp)
    hung = data.draw(st.sampled_from(topo.rank))
    seq = data.draw(st.integers(0, 1000))
    now = T0 + 1000 * STEP
    live = _hung(topo, hung, seq, now)
    order = data.draw(st.permutations(list(live.values())))
    results = detect_hangs(order, topo, now, now - 3 * STEP, 11, STEP, P)
    waves = [r for r in results if r.kind is FindingKind.HANG_WAVEFRONT]
    dp_waves = [w for w in waves if w.evidence["group"] == "DP"]
    assert len(dp_waves) == 1 and dp_waves[0].ranks == (hung,)
    assert all(hung not in w.evidence["victims"] for w in waves)
    assert all(hung in w.evidence["first_ranks"] for w in waves)
    assert not any(r.kind is FindingKind.RANK_SILENT for r in results)
    # not stalled yet: nothing but silence could be raised, and nobody is silent
    assert detect_hangs(order, topo, now, now - STEP, 11, STEP, P) == []


def test_a_job_going_quiet_rank_by_rank_names_no_silent_rank() -> None:
    # The whole job stops; its ranks' last records lie a heartbeat or two apart, so *now* passes the silence
    # bound for the earlier ones first. None was silent while others published: no rank_silent, and once
    # every rank is past the bound, the job is silent.
    topo = build_topology("j", 4, 1, 1)
    bound = P.silent_bound_ns(STEP)
    last = T0 + 100 * STEP
    live = {r: RankLiveness(r, last - r * bound // 4, 20, "") for r in topo.rank}
    out = detect_hangs(live, topo, last + bound - bound // 8, last - 5 * STEP, 19, STEP, P)
    assert FindingKind.RANK_SILENT not in {r.kind for r in out}, out
    out = detect_hangs(live, topo, last + bound, last - 5 * STEP, 19, STEP, P)
    assert FindingKind.RANK_SILENT not in {r.kind for r in out}
    assert [r.evidence["all_ranks_silent"] for r in out if r.kind is FindingKind.JOB_STALLED] == [True]
