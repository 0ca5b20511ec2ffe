"""Jobs that never end: which jobs are idle (on a fake clock), the bound on open jobs, the ABANDONED reason,
the settings, and what a crashed job's flush summarizes and frees."""

from __future__ import annotations

import numpy as np
import pytest

from argus.core.errors import ConfigError
from argus.core.settings import Settings
from argus.schemas.records import JobLifecycle, KernelBatch, LifecycleEvent
from argus.streams.idle import IdleJobs, QuietClock, abandon_reason
from argus.streams.windows import WindowBuffer

W = 1_000_000_000
T0 = 1_767_225_600 * W


def test_idle_jobs_are_those_quiet_for_the_timeout_longest_first() -> None:
    jobs = IdleJobs()
    jobs.touch("a", 0.0)
    jobs.touch("b", 1.0)
    jobs.touch("c", 2.0)
    assert jobs.idle(now=3.0, timeout_s=5.0) == []
    assert jobs.idle(now=6.0, timeout_s=5.0) == ["a", "b"]
    jobs.touch("a", 6.5)  # a record arrived: no longer idle, now the most recent
    assert jobs.idle(now=7.0, timeout_s=5.0) == ["b", "c"]
    assert jobs.age("a", 7.0) == pytest.approx(0.5) and jobs.age("zz", 7.0) is None
    jobs.forget("b")
    assert jobs.idle(now=100.0, timeout_s=5.0) == ["c", "a"] and "b" not in jobs and len(jobs) == 2
    jobs.clear()
    assert len(jobs) == 0 and jobs.idle(now=1e9, timeout_s=1.0) == []


def test_open_jobs_beyond_the_bound_are_the_longest_idle() -> None:
    jobs = IdleJobs()
    for i, job in enumerate("abcde"):
        jobs.touch(job, float(i))
    jobs.touch("a", 10.0)
    assert jobs.beyond(3) == ["b", "c"]
    assert jobs.beyond(5) == [] and jobs.beyond(10) == []


def test_abandon_reason_says_why() -> None:
    assert abandon_reason(301.24, 300.0, over_limit=False) == "idle: no record for 301.2 s (job_idle_timeout_s = 300)"
    assert abandon_reason(None, 300.0, over_limit=True).startswith("max_open_jobs")


def test_abandoned_record_carries_reason_and_last_step() -> None:
    rec = JobLifecycle("j", LifecycleEvent.ABANDONED, T0, 4, source="streams", reason=abandon_reason(3.0, 2.0, False),
                       last_step=11)
    back = JobLifecycle.decode(rec.encode())
    assert back.event is LifecycleEvent.ABANDONED and back.last_step == 11 and back.reason.startswith("idle")


def test_idle_settings_are_validated() -> None:
    s = Settings.load(env={})
    assert (s.job_idle_timeout_s, s.max_open_jobs, s.max_ranks_per_job) == (300.0, 10_000, 65_536)
    assert Settings.load(env={"ARGUS_JOB_IDLE_TIMEOUT_S": "2.5"}).job_idle_timeout_s == 2.5
    for bad in ({"job_idle_timeout_s": 0.0}, {"job_idle_timeout_s": 1e9}, {"max_open_jobs": 0},
                {"max_ranks_per_job": 0}):
        with pytest.raises(ConfigError):
            Settings.load(env={}, **bad)  # type: ignore[arg-type]


def _batch(rank: int, seq: int, start_ns: np.ndarray, job: str = "crashed") -> KernelBatch:
    n = start_ns.size
    return KernelBatch(job, rank, seq, ("k0",), np.zeros(n, dtype=np.int64), np.full(n, 7), start_ns,
                       np.full(n, 1000), np.zeros(n))


def test_a_crashed_job_flush_summarizes_every_open_window_and_frees_every_message() -> None:
    """A job that never sent end_of_stream nor END: its last windows stay open (the watermark never passes
    them) and hold their messages; the flush on ABANDONED closes all of them and frees every token."""
    buf = WindowBuffer(W, lateness_ns=W // 2)
    held: set[int] = set()
    events = 0
    token = 0
    for rank in range(2):
        for seq in range(3):
            starts = T0 + seq * W + np.arange(5) * (W // 5)
            token += 1
            up = buf.add(_batch(rank, seq, starts), token=token)
            events += starts.size
            held.add(token)
            held -= set(up.free_tokens)
            for w in up.closed:
                held -= set(buf.release(w))
    buf.add(_batch(0, 0, np.array([T0]), job="other"), token=99)
    assert held and buf.open_windows > 1  # the crashed job pins messages
    closed = buf.flush_job("crashed")
    assert {w.job_id for w in closed} == {"crashed"} and buf.open_windows == 1  # only the other job's window
    freed = {t for w in closed for t in buf.release(w)}
    assert held <= freed
    summarized = sum(len(w) for w in closed)
    assert 0 < summarized <= events


def test_quiet_clock_counts_a_blocked_loop_as_one_step_at_most() -> None:
    clock = QuietClock(max_step_s=0.5, start=100.0)
    assert clock.read(100.4) == pytest.approx(0.4)
    assert clock.read(103.4) == pytest.approx(0.9)  # 3 s blocked: counts 0.5
    assert clock.read(103.2) == pytest.approx(0.9)  # never backwards
    assert clock.read(103.6) == pytest.approx(1.1)
