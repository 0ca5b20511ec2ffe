"""Liveness of a running job on the stream: per rank the last step, phase and collective seen, and the hang
episode (pure; judged by :mod:`argus.detectors.hangs`).

Time is event time: each record's own timestamp says when a rank was last seen and when a step completed.
Only "nothing arrived" needs the worker's clock: the job's *now* is its newest event time plus the worker
time elapsed since its last record, so a job whose records keep coming is judged on event time alone (a
replay gives the same judgement). That elapsed time runs at the pace the job's steps have been arriving
(event time per worker second, at most 1), so a producer that publishes slower than its own event time
(a simulator) does not look stalled between steps; and the agents pass a :class:`argus.streams.idle.QuietClock`,
so a worker busy elsewhere does not make a job look stalled either.

Details and reasoning: docs/internals/streams.md.
"""

from __future__ import annotations

import statistics
from collections import deque

from argus.core.kinds import FindingKind
from argus.detectors.hangs import HangParams, HangResult, RankLiveness, detect_hangs, job_resumed
from argus.schemas.records import Heartbeat, JobTopology, PhaseBatch, Step

__all__ = ["JobLiveness"]


class JobLiveness:
    """What each rank of one job was last seen doing, and the job's hang episode.

    Args:
        job_id: the job.
        params: bounds of the hang detector.
    """

    def __init__(self, job_id: str, params: HangParams | None = None) -> None:
        self.job_id = job_id
        self.params = params or HangParams()
        self.ranks: dict[int, RankLiveness] = {}
        #: Event time a rank last completed a step (or the job's first record), ns; and the newest step.
        self.last_progress_ns = 0
        self.last_completed_step = -1
        #: Newest event time seen, ns, and the worker time (s) of the job's last record.
        self.newest_ns = 0
        self.newest_at = 0.0
        # (newest completed step, worker time) each time it advanced: the pace at which steps arrive.
        self._arrivals: deque[tuple[int, float]] = deque(maxlen=17)
        #: Start of the open stall episode (the last progress before it), ns; ``None`` when none is open.
        self.stalled_since_ns: int | None = None
        #: Worker time (s) the job's last heartbeat arrived; ``None`` before the first.
        self.heartbeat_at: float | None = None
        # Newest heartbeat event time, the worker time it arrived, and the newest step a heartbeat began.
        self._hb_newest_ns = 0
        self._hb_newest_at = 0.0
        self._hb_first_ns = 0  # the first heartbeat read: silence on their clock counts from it
        self._hb_step = -1
        self._behind_since: float | None = None

    def alive(self, now: float, within_s: float) -> bool:
        """Whether the job's heartbeats arrived within ``within_s`` worker seconds of ``now``: its ranks are
        alive and their records reach the worker. Only then is silence in steps a hang -- with nothing at all
        arriving the broker may be down, or the ranks gone (the idle timeout closes such a job)."""
        return self.heartbeat_at is not None and now - self.heartbeat_at <= within_s

    def _seen(self, time_ns: int, now: float) -> None:
        # Any record counts as an arrival, even an old one: the job is not quiet while its records come.
        self.newest_ns, self.newest_at = max(self.newest_ns, time_ns), max(self.newest_at, now)
        if not self.last_progress_ns:
            self.last_progress_ns = time_ns  # the job's start counts as progress

    def observe(self, rec: Step | PhaseBatch | Heartbeat, now: float) -> list[HangResult]:
        """Take one record arriving at worker time ``now`` (s); returns ``job_resumed`` when it is the first
        step completed after a stall episode, else nothing."""
        old = self.ranks.get(rec.rank)
        if isinstance(rec, Heartbeat):
            seen = max(rec.time_ns, old.last_seen_ns if old else 0)
            self.ranks[rec.rank] = RankLiveness.from_heartbeat(rec, seen)
            self._seen(rec.time_ns, now)
            if rec.time_ns >= self._hb_newest_ns:
                self._hb_newest_ns, self._hb_newest_at = rec.time_ns, now
            self._hb_first_ns = min(self._hb_first_ns or rec.time_ns, rec.time_ns)
            self._hb_step = max(self._hb_step, rec.step)
            return []
        if isinstance(rec, PhaseBatch):
            # A rank's phases of a step are published once it completed the step: progress, like its Step
            # (the two topics are read independently, so either can run ahead of the other).
            end = max((s + d for s, d in zip(rec.start_ns, rec.duration_ns, strict=True)), default=0)
            if not end:
                return []
        else:
            end = rec.start_ns + rec.wall_ns
        if old is None or end >= old.last_seen_ns:
            # Past the step: no phase, no collective in flight.
            self.ranks[rec.rank] = RankLiveness(rec.rank, end, max(rec.step, old.step if old else -1))
        self._seen(end, now)
        if rec.step > self.last_completed_step:
            self.last_completed_step = rec.step
            self._arrivals.append((rec.step, now))
            # The steps topic moves: while it catches up with heartbeats read ahead of it, it is late, not lost.
            self._behind_since = None
        if end <= self.last_progress_ns:
            return []
        self.last_progress_ns = end
        if self.stalled_since_ns is None:
            return []
        since, self.stalled_since_ns = self.stalled_since_ns, None
        return [job_resumed(since, end, rec.step)]

    def pace(self, median_step_ns: float) -> float:
        """Event time per worker second while the job's steps arrived, in (0, 1] (1 when unknown)."""
        a = self._arrivals
        gaps = [(t1 - t0) / (s1 - s0) for (s0, t0), (s1, t1) in zip(a, list(a)[1:], strict=False)]
        if not gaps or not median_step_ns > 0:
            return 1.0
        gap_s = statistics.median(gaps)
        return 1.0 if gap_s <= 0 else min(1.0, median_step_ns / 1e9 / gap_s)

    def now_ns(self, now: float, pace: float = 1.0) -> int:
        """The job's now at worker time ``now`` (s): newest event time plus the worker time since its last
        record, at ``pace``."""
        return self.newest_ns + max(0, round((now - self.newest_at) * pace * 1e9))

    def judge(self, topology: JobTopology, median_step_ns: float, now: float) -> list[HangResult]:
        """Stall, silent ranks and hang wavefront at worker time ``now`` (s); opens the episode on a stall."""
        if not self.ranks:
            return []
        if self._hb_step > self.last_completed_step + 1:
            # A heartbeat says a rank began a step after one not seen completed: the steps topic is read behind
            # the heartbeats (a backlog), the job is not stalled; judge once its steps are in -- unless no
            # step arrives for ``lost_step_bounds`` stall bounds (worker time): then a Step record was lost.
            if self._behind_since is None:
                self._behind_since = now
            wait_s = self.params.lost_step_bounds * self.params.stall_bound_ns(median_step_ns) / 1e9
            if now - self._behind_since < wait_s:
                return []
        else:
            self._behind_since = None
        pace = self.pace(median_step_ns)
        # Silence on the heartbeats' own clock: one job's heartbeats share one partition, read in the order
        # they were sent, while its steps may be read ahead of them.
        quiet_now = (self._hb_newest_ns + max(0, round((now - self._hb_newest_at) * pace * 1e9))
                     if self._hb_newest_ns else None)
        found = detect_hangs(self.ranks, topology, self.now_ns(now, pace), self.last_progress_ns,
                             self.last_completed_step, median_step_ns, self.params, silence_now_ns=quiet_now,
                             newest_ns=self._hb_newest_ns or None, heard_since_ns=self._hb_first_ns or None)
        if 0 < self._hb_newest_ns <= self.last_progress_ns:
            # Heartbeats, but none sent since the last completed step: nothing shows the ranks alive and not progressing
            # (a lull in a job's records on the way is no stall); a stuck job heartbeats on, in its collective.
            found = [f for f in found if f.kind not in (FindingKind.JOB_STALLED, FindingKind.HANG_WAVEFRONT)]
        elif 0 < self._hb_newest_ns - self.last_progress_ns < self.params.stall_bound_ns(median_step_ns):
            # The wavefront is read from the ranks' heartbeats. Until those read reach past the stall bound, a
            # worker reading them late (its clock already past the bound) sees members still in the compute
            # before the collective they hang in: each would look like a suspect that waits nowhere.
            found = [f for f in found if f.kind is not FindingKind.HANG_WAVEFRONT]
        if self.stalled_since_ns is None and any(r.kind is FindingKind.JOB_STALLED for r in found):
            self.stalled_since_ns = self.last_progress_ns
        return found
