"""Liveness on the stream with a fake worker clock: a job ages by the wall clock only when nothing arrives;
a hang is named from heartbeats (stall, wavefront with the suspect), the next completed step closes the
episode with ``job_resumed``, a rank that stops while its peers go on is silent, a healthy job raises nothing."""

from __future__ import annotations

from argus.core.kinds import FindingKind
from argus.detectors.hangs import HangParams
from argus.producers.topology import build_topology
from argus.schemas.records import Heartbeat, ParallelGroup, PhaseBatch, PhaseKind, Step
from argus.streams.liveness import JobLiveness

T0 = 1_767_225_600_000_000_000
STEP = 100_000_000  # 100 ms steps
P = HangParams(stall_k=2.0, stall_floor_ns=100_000_000, heartbeat_interval_ns=100_000_000, silent_heartbeats=3)


def _steps(live: JobLiveness, ranks: range, step: int, clock: float) -> list[FindingKind]:
    out = []
    for r in ranks:
        out += [x.kind for x in live.observe(Step("j", r, step, T0 + step * STEP, STEP, STEP), clock)]
    return out


def test_healthy_job_is_judged_on_event_time_and_raises_nothing() -> None:
    topo = build_topology("j", 4, 2, 1)
    live = JobLiveness("j", P)
    clock = 100.0
    for step in range(10):
        assert _steps(live, range(8), step, clock) == []
        clock += 0.1
        assert live.judge(topo, STEP, clock) == []
    # The worker clock only adds the time since the newest event time advanced.
    assert live.now_ns(clock) == T0 + 10 * STEP + 100_000_000


def test_hang_is_named_then_closed_by_the_next_step() -> None:
    topo = build_topology("j", 4, 2, 1)  # DP 4 x TP 2
    live = JobLiveness("j", P)
    clock = 50.0
    for step in range(5):
        _steps(live, range(8), step, clock)
        clock += 0.1
    hang_at = T0 + 5 * STEP
    hung = 3
    dp = topo.dp_group[topo.rank.index(hung)]
    for r, g in zip(topo.rank, topo.dp_group, strict=True):
        if r == hung:
            hb = Heartbeat("j", r, hang_at + 10_000_000, 5, "backward", PhaseKind.BACKWARD)
        elif g == dp:
            hb = Heartbeat("j", r, hang_at + 10_000_000, 5, "dp-allreduce", PhaseKind.ALL_REDUCE, PhaseKind.ALL_REDUCE,
                           ParallelGroup.DP, g, 7, hang_at)
        else:
            hb = Heartbeat("j", r, hang_at + 10_000_000, 5, "forward", PhaseKind.FORWARD)
        live.observe(hb, clock)
    assert live.judge(topo, STEP, clock) == []  # just now: not stalled yet
    # Heartbeats keep coming (the ranks are alive, blocked): event time advances, no step completes.
    for i in range(1, 4):
        for r in range(8):
            old = live.ranks[r]
            live.observe(Heartbeat("j", r, hang_at + i * STEP, 5, old.phase, None, old.collective, old.group,
                                   old.group_index, old.seq, old.in_flight_since_ns), clock + i * 0.1)
    found = live.judge(topo, STEP, clock + 0.3)
    kinds = [f.kind for f in found]
    assert FindingKind.JOB_STALLED in kinds and FindingKind.RANK_SILENT not in kinds
    wave = [f for f in found if f.kind is FindingKind.HANG_WAVEFRONT and f.evidence["group"] == "DP"]
    assert len(wave) == 1 and wave[0].ranks == (hung,) and wave[0].evidence["first_ranks"] == [hung]
    assert live.stalled_since_ns == T0 + 5 * STEP
    # The job resumes: the next completed step closes the episode.
    resumed = live.observe(Step("j", 0, 5, T0 + 5 * STEP, 8 * STEP, 8 * STEP), clock + 1.0)
    assert [r.kind for r in resumed] == [FindingKind.JOB_RESUMED]
    assert abs(resumed[0].evidence["seconds_stalled"] - 0.8) < 1e-9 and live.stalled_since_ns is None
    assert live.observe(Step("j", 1, 5, T0 + 5 * STEP, 8 * STEP, 8 * STEP), clock + 1.0) == []


def test_the_wavefront_waits_for_heartbeats_read_past_the_stall_bound() -> None:
    # A worker that reads the heartbeats late: its clock passes the stall bound while the heartbeats it read
    # show only rank 1 of the hung rank's DP group in the all-reduce, its peers 5 and 7 still in their backward
    # before it. Named then, 3, 5 and 7 would all be suspects that wait nowhere.
    topo = build_topology("j", 4, 2, 1)  # DP 4 x TP 2: DP group {1, 3, 5, 7}
    live = JobLiveness("j", P)
    clock = 50.0
    for step in range(5):
        _steps(live, range(8), step, clock)
        clock += 0.1
    hang_at, hung = T0 + 5 * STEP, 3
    dp = topo.dp_group[topo.rank.index(hung)]

    def beat(r: int, t: int, entered: set[int]) -> Heartbeat:
        if r in entered:
            return Heartbeat("j", r, t, 5, "dp-allreduce", PhaseKind.ALL_REDUCE, PhaseKind.ALL_REDUCE,
                             ParallelGroup.DP, dp, 7, hang_at)
        return Heartbeat("j", r, t, 5, "backward", PhaseKind.BACKWARD)

    for r in range(8):
        live.observe(beat(r, hang_at + 10_000_000, {1}), clock)
    assert FindingKind.HANG_WAVEFRONT not in [f.kind for f in live.judge(topo, STEP, clock + 1.0)]
    # The heartbeats read on, past the bound: every peer has entered the all-reduce; the hung rank is named.
    for i in range(1, 4):
        for r in range(8):
            live.observe(beat(r, hang_at + i * STEP, {1, 5, 7}), clock + 1.0 + i * 0.1)
    wave = [f for f in live.judge(topo, STEP, clock + 1.3)
            if f.kind is FindingKind.HANG_WAVEFRONT and f.evidence["group"] == "DP"]
    assert len(wave) == 1 and wave[0].ranks == (hung,) and wave[0].evidence["first_ranks"] == [hung]


def test_quiet_job_ages_by_the_worker_clock_and_a_silent_rank_is_named() -> None:
    topo = build_topology("j", 2, 1, 1)
    live = JobLiveness("j", P)
    clock = 10.0
    _steps(live, range(2), 0, clock)
    # Nothing arrives: after the stall bound on the worker clock, the whole job is stalled (all silent).
    found = live.judge(topo, STEP, clock + 0.5)
    assert [f.kind for f in found] == [FindingKind.JOB_STALLED] and found[0].evidence["all_ranks_silent"]
    # Rank 0 goes on, rank 1 stops: rank 1 is silent (and the episode closes at rank 0's next step).
    live2 = JobLiveness("j", P)
    _steps(live2, range(2), 0, clock)
    for step in range(1, 8):
        live2.observe(Step("j", 0, step, T0 + step * STEP, STEP, STEP), clock + step * 0.1)
    found = live2.judge(topo, STEP, clock + 0.8)
    silent = [f for f in found if f.kind is FindingKind.RANK_SILENT]
    assert len(silent) == 1 and silent[0].ranks == (1,)


def test_phases_read_ahead_of_steps_are_progress_not_a_stall() -> None:
    """The steps and phases topics are read independently: phases of later steps arriving before their
    Step records are completions too, so the job is not stalled."""
    topo = build_topology("j", 2, 1, 1)
    live = JobLiveness("j", P)
    for step in range(20):
        for r in range(2):
            live.observe(PhaseBatch("j", r, step, (PhaseKind.FORWARD,), ("forward",), (ParallelGroup.NONE,), (-1,),
                                    (T0 + step * STEP,), (STEP,)), 5.0)
    _steps(live, range(2), 0, 5.0)  # the Step records lag far behind
    assert live.judge(topo, STEP, 5.05) == []
    assert live.last_completed_step == 19


def test_a_producer_slower_than_its_event_time_is_not_stalled_between_steps() -> None:
    """Steps of 100 ms event time arriving one per worker second (a simulator on a busy machine): the quiet
    time counts at that pace, so a second between steps is no stall; ten quiet seconds are."""
    topo = build_topology("j", 2, 1, 1)
    live = JobLiveness("j", P)
    for step in range(10):
        _steps(live, range(2), step, 10.0 + step)
    assert live.pace(STEP) == 0.1
    assert live.judge(topo, STEP, 19.0 + 1.5) == []
    assert [f.kind for f in live.judge(topo, STEP, 19.0 + 10.5)] == [FindingKind.JOB_STALLED]


def test_a_job_is_alive_only_while_its_heartbeats_arrive() -> None:
    # With nothing arriving (a broker outage, every rank gone) silence is no evidence of a hang.
    live = JobLiveness("j")
    assert not live.alive(10.0, 6.0)  # never heard a heartbeat
    live.heartbeat_at = 5.0
    assert live.alive(10.0, 6.0) and not live.alive(12.0, 6.0)


def test_ranks_are_not_silent_when_steps_are_read_ahead_of_heartbeats() -> None:
    """A checkpoint pause read with a backlog: half the ranks' resumed steps arrive before the heartbeats
    the others sent during the pause. Silence is measured on the heartbeats' clock: nobody is silent."""
    topo = build_topology("j", 4, 2, 1)
    live = JobLiveness("j", P)
    clock = 10.0
    for step in range(5):
        _steps(live, range(8), step, clock)
        for r in range(8):
            live.observe(Heartbeat("j", r, T0 + step * STEP + STEP // 2, step, "forward", PhaseKind.FORWARD), clock)
        clock += 0.1
    pause = 10 * STEP  # a checkpoint of 1 s between steps 4 and 5
    for r in range(4):  # ranks 0-3 resumed: their step 5 is read, the others' pause heartbeats are not yet
        live.observe(Step("j", r, 5, T0 + 5 * STEP + pause, STEP, STEP), clock)
    found = live.judge(topo, STEP, clock)
    assert not any(f.kind is FindingKind.RANK_SILENT for f in found), found


def test_a_rank_read_behind_is_not_silent_before_its_first_heartbeat_is_read() -> None:
    """A job publishing heartbeats only in a pause (as the simulator does), read unevenly: rank 7's steps
    partition is read up to step 4 only, the others' up to 11, and the pause's first heartbeats are read for
    ranks 0-6 but not yet for rank 7 (a worker batch ends between them). On the heartbeats' clock rank 7 has
    not been silent yet; it is once the others' heartbeats run on past the bound without its own."""
    topo = build_topology("j", 4, 2, 1)
    live = JobLiveness("j", P)
    clock = 10.0
    for step in range(12):
        _steps(live, range(7) if step > 4 else range(8), step, clock)
    pause = T0 + 12 * STEP
    for r in range(7):
        live.observe(Heartbeat("j", r, pause, 11), clock)
    assert not [f for f in live.judge(topo, STEP, clock) if f.kind is FindingKind.RANK_SILENT]
    for i in range(1, 5):  # 400 ms of the pause's heartbeats, none of rank 7's
        for r in range(7):
            live.observe(Heartbeat("j", r, pause + i * STEP, 11), clock + i * 0.1)
    silent = [f for f in live.judge(topo, STEP, clock + 0.4) if f.kind is FindingKind.RANK_SILENT]
    assert [f.ranks for f in silent] == [(7,)] and silent[0].evidence["seconds_silent"] == 0.4


def _steps_behind_heartbeats(beats: int) -> tuple[JobLiveness, float]:
    """A DP 4 x TP 2 job whose steps 0-3 are read, then ``beats`` heartbeats of every rank in step 9 (the steps
    topic read behind them); the job's liveness and the worker clock after them."""
    live = JobLiveness("j", P)
    clock = 10.0
    for step in range(4):
        _steps(live, range(8), step, clock)
        clock += 0.1
    for i in range(beats):
        for r in range(8):
            live.observe(Heartbeat("j", r, T0 + (9 + i) * STEP + 1, 9, "forward", PhaseKind.FORWARD), clock)
    return live, clock


def test_heartbeats_ahead_of_the_steps_topic_are_no_stall() -> None:
    """Heartbeats say the ranks began step 9 while the steps read so far end at 3: the steps are late, not
    stalled -- for twice the stall bound (a busy worker read a 4-worker test run's steps topic 1 s behind, the
    bound 0.5 s) and more, until that lasts ``lost_step_bounds`` stall bounds (a Step lost, not late)."""
    topo = build_topology("j", 4, 2, 1)
    live, clock = _steps_behind_heartbeats(beats=5)
    assert live.judge(topo, STEP, clock) == []
    bound_s = P.stall_bound_ns(STEP) / 1e9
    assert live.judge(topo, STEP, clock + 2 * bound_s + 0.01) == []
    clock += P.lost_step_bounds * bound_s + 0.01
    assert live.judge(topo, STEP, clock)  # the lag persisted: judged (stalled)


def test_steps_catching_up_slowly_with_heartbeats_read_ahead_are_no_stall() -> None:
    """A busy worker reads the heartbeats of step 9 while its steps topic is at 3 and catches up one step
    per stall bound: each step that arrives shows the topic is late, not lost, so nothing is judged (no stall,
    no silent rank) however long the catching up takes; once the steps stop coming, it is."""
    topo = build_topology("j", 4, 2, 1)
    live, clock = _steps_behind_heartbeats(beats=1)
    bound_s = P.stall_bound_ns(STEP) / 1e9
    for step in range(4, 8):
        assert live.judge(topo, STEP, clock) == []
        clock += 1.5 * bound_s
        assert live.judge(topo, STEP, clock) == []
        _steps(live, range(5), step, clock)  # ranks 5-7's records of the step are read a moment later
        assert live.judge(topo, STEP, clock) == [], step
        _steps(live, range(5, 8), step, clock)
    clock += P.lost_step_bounds * bound_s + 0.01
    assert live.judge(topo, STEP, clock)  # no step for lost_step_bounds bounds: judged


def test_a_lull_after_the_last_heartbeat_is_no_stall() -> None:
    """Heartbeats came (a checkpoint pause), then steps again, then a lull in the records on their way:
    without a heartbeat sent after the last completed step nothing shows the ranks stuck."""
    topo = build_topology("j", 2, 1, 1)
    live = JobLiveness("j", P)
    _steps(live, range(2), 0, 10.0)
    for r in range(2):
        live.observe(Heartbeat("j", r, T0 + STEP + STEP // 2, 1, "", None), 10.0)
    for step in range(1, 4):
        _steps(live, range(2), step, 10.0 + step * 0.1)
    assert live.judge(topo, STEP, 10.3 + 1.0) == []
    for r in range(2):  # the ranks heartbeat on, stuck in step 4: now it is a stall
        live.observe(Heartbeat("j", r, T0 + 4 * STEP + STEP // 2, 4, "forward", PhaseKind.FORWARD), 11.3)
    assert [f.kind for f in live.judge(topo, STEP, 11.3 + 1.0)] == [FindingKind.JOB_STALLED]
