"""Which jobs went quiet: the stream worker's only use of its own clock (pure).

Data is judged on event time everywhere else; "nothing arrived for a job" cannot be, since a job that
stopped publishing has no newer event time. :class:`IdleJobs` keeps the worker-clock time of the last record
of each open job and says which jobs have been idle for a timeout and which are beyond a bound on open jobs;
the job router abandons those (see :mod:`argus.streams.job_router`). Times are passed in (``time.monotonic()``
in the worker, a fake clock in tests).
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["IdleJobs", "QuietClock", "abandon_reason"]


class IdleJobs:
    """Last arrival per open job, oldest first.

    Arrivals are expected in non-decreasing time (a monotonic clock); the order of the jobs is then the
    order of their last arrivals, so :meth:`idle` and :meth:`beyond` stop at the first job that is not.
    """

    def __init__(self) -> None:
        self._last: OrderedDict[str, float] = OrderedDict()

    def touch(self, job_id: str, now: float) -> None:
        """A record of ``job_id`` arrived at ``now`` (seconds)."""
        self._last[job_id] = now
        self._last.move_to_end(job_id)

    def forget(self, job_id: str) -> None:
        """The job is closed (ended or abandoned): no longer tracked."""
        self._last.pop(job_id, None)

    def clear(self) -> None:
        """Forget every job (the worker lost its partitions; they come back from the log)."""
        self._last.clear()

    def idle(self, now: float, timeout_s: float) -> list[str]:
        """The jobs with nothing for at least ``timeout_s`` at ``now``, longest idle first."""
        out = []
        for job_id, last in self._last.items():
            if now - last < timeout_s:
                break
            out.append(job_id)
        return out

    def beyond(self, limit: int) -> list[str]:
        """The longest-idle jobs that exceed ``limit`` open jobs (empty within the limit)."""
        return list(self._last)[: max(len(self._last) - limit, 0)]

    def age(self, job_id: str, now: float) -> float | None:
        """Seconds since the job's last record (``None`` if not tracked)."""
        last = self._last.get(job_id)
        return None if last is None else now - last

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._last

    def __len__(self) -> int:
        return len(self._last)


class QuietClock:
    """Worker time (s) that counts a span in which the event loop was blocked as at most ``max_step_s``.

    A span the worker spent computing (or starved of CPU) is not a span in which nothing arrived: the
    records were there, unread. Read it often (every record and every timer tick, ``max_step_s`` at least
    the tick interval) and it runs with the wall clock whenever the worker keeps up.
    """

    def __init__(self, max_step_s: float, start: float = 0.0) -> None:
        self.max_step_s = max_step_s
        self._real = start
        self._now = 0.0

    def read(self, real: float) -> float:
        """The quiet time at real monotonic time ``real`` (s)."""
        step = real - self._real
        self._real = max(self._real, real)
        self._now += min(max(step, 0.0), self.max_step_s)
        return self._now


def abandon_reason(idle_s: float | None, timeout_s: float, over_limit: bool) -> str:
    """The ``reason`` of an ABANDONED record: idle past the timeout, or beyond the open-job bound."""
    if over_limit:
        return "max_open_jobs: more jobs open than the worker keeps; this one was idle the longest"
    idle = f"{idle_s:.1f}" if idle_s is not None else "?"
    return f"idle: no record for {idle} s (job_idle_timeout_s = {timeout_s:g})"
