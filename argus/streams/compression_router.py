"""The compression agent's logic, without Kafka: decoded kernel batches in; what to send, dead-letter and ack out.

:class:`CompressionRouter` holds the agent's state (the open windows of :class:`~argus.streams.windows.WindowBuffer`,
the messages not yet acked, which partition each rank arrives on, the jobs' last activity) and answers every
input with a :class:`Routed`: the dead letters to send, the summaries of the windows that closed (an
:class:`Emission`), a job-end marker to pass on, and the messages that may be acked. The Faust agent in
:mod:`argus.streams.compression_agent` only decodes, calls the router, sends and acks; the at-least-once rules
live here and are unit-tested without a broker: see docs/internals/streams.md.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from argus.core.errors import ConfigError, failure_reason
from argus.core.settings import DetectorSettings, WorkerSettings
from argus.detectors.kde_clusters import KdeParams
from argus.schemas.records import JobLifecycle, KernelBatch, KernelSummary, LifecycleEvent
from argus.streams.compression import summarize_isolated
from argus.streams.idle import IdleJobs, QuietClock
from argus.streams.windows import ClosedWindow, WindowBuffer

__all__ = ["CompressionRouter", "CompressionStats", "DeadLetter", "Emission", "Routed", "Staging"]

log = logging.getLogger(__name__)
H = TypeVar("H")


@dataclass
class CompressionStats:
    """Counters of the compression agent (events are kernel events, not Kafka messages)."""

    batches: int = 0
    events_in: int = 0
    events_summarized: int = 0
    windows_closed: int = 0
    summaries_out: int = 0
    summary_bytes_out: int = 0
    #: Events that arrived after their window was summarized, summarized as further pieces of it.
    late_events: int = 0
    #: Batches that were copies of batches already taken (same rank and seq), not summarized again.
    duplicate_batches: int = 0
    #: Events further ahead of their rank's watermark than ``max_event_skew_ns`` (dead-lettered).
    skewed_events: int = 0
    #: Events summarized under ``[other kernels]`` because their window had ``max_kernel_names`` names.
    folded_events: int = 0
    #: Messages dead-lettered whole because their processing raised, and windows that could not be summarized.
    failed_messages: int = 0
    failed_windows: int = 0
    dead_letters: int = 0
    busy_s: float = 0.0
    #: Jobs the compressor abandoned (kernels only, idle past twice ``job_idle_timeout_s``).
    jobs_abandoned: int = 0
    by_job: dict[str, dict[str, int]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "by_job"}
        d["events_per_busy_s"] = round(self.events_in / self.busy_s) if self.busy_s else None
        return d


@dataclass(frozen=True)
class Staging:
    """How closed windows wait to be summarized together. Each kernel message closes the windows of its rank
    only, and a summary is made per (job, kernel, stream) of the windows summarized at once: summarizing each
    message's windows alone sends one summary per (message, kernel, stream), each holding one rank's row (14k
    summaries for a 1,024-rank job of 20 steps), and the L3 agent pays its per-message cost on each.

    ``windows``: summarize once this many closed windows wait (1: at once, each message's own); ``max_age_s``:
    or once the first of them has waited this long (the worker's clock, see
    :meth:`CompressionRouter.flush_staged`). A job-end marker summarizes every waiting window first.

    Raises:
        ConfigError: ``windows`` < 1 or ``max_age_s`` <= 0.
    """

    windows: int = 1
    max_age_s: float = 0.25

    def __post_init__(self) -> None:
        if self.windows < 1 or not self.max_age_s > 0:
            raise ConfigError(f"staging needs windows >= 1 and max_age_s > 0, got {self.windows}, {self.max_age_s}")


@dataclass(frozen=True)
class DeadLetter:
    """A dead letter to send for the message being routed (stage ``compress``): why, and what it held."""

    reason: str
    payload: bytes | None = None
    job: str = ""
    rank: int | None = None


@dataclass(frozen=True)
class Emission(Generic[H]):
    """Summaries of closed windows, to send (each keyed by its (job, kernel, stream)). Once all are delivered
    (or dead-lettered), :meth:`CompressionRouter.delivered` says which messages that frees; ``handle`` is the
    message whose routing closed the windows (a delivery's dead letter goes out for it)."""

    summaries: tuple[KernelSummary, ...]
    windows: tuple[ClosedWindow, ...]
    handle: H


@dataclass
class Routed(Generic[H]):
    """What the agent does for one message, in this order: send ``dead`` (each delivered before anything is
    acked), send ``emission``'s summaries, pass ``end_marker`` on (``(job, kernel partition)``: after every
    summary sent so far is delivered, a :func:`~argus.streams.summary_pieces.summary_end_marker` to each
    summaries partition), then ack ``ack``."""

    ack: list[H] = field(default_factory=list)
    dead: list[DeadLetter] = field(default_factory=list)
    emission: Emission[H] | None = None
    end_marker: tuple[str, int] | None = None


class CompressionRouter(Generic[H]):
    """The compression agent's state and rules (see the module's docstring). Not thread-safe: one per agent.

    ``worker``: windows (``window_ns``, ``allowed_lateness_ns``, ``max_event_skew_ns``, ``max_kernel_names``)
    and ``job_idle_timeout_s`` (``settings.worker``); ``detector``: the KDE parameters (``settings.detector``).
    ``now``: the worker's monotonic clock in seconds at creation. ``staging``: how closed windows wait to be
    summarized together (default: not at all).
    """

    def __init__(self, worker: WorkerSettings, detector: DetectorSettings, now: float = 0.0,
                 staging: Staging | None = None) -> None:
        self.worker = settings = worker
        self.stats = CompressionStats()
        self.buffer = WindowBuffer(settings.window_ns, settings.allowed_lateness_ns,
                                   max_skew_ns=settings.max_event_skew_ns, max_names=settings.max_kernel_names,
                                   late_pieces=True)
        self.params = KdeParams(grid_points=detector.kde_grid_points, min_samples=detector.kde_min_samples,
                                min_log_gap=detector.kde_min_log_gap)
        #: Often enough that a kernel-only job is abandoned within about a quarter of its timeout after it passes.
        self.idle_tick_s = min(max(settings.job_idle_timeout_s / 4, 0.05), 10.0)
        self._pending: dict[int, tuple[H, int]] = {}  # token -> (handle, offset), not acked yet
        self._tokens = itertools.count()
        # Which partition each (job, rank) arrives on, so a job-end marker closes only that partition's ranks.
        self._partition_of: dict[tuple[str, int], int] = {}
        # Kernel-only jobs that never end: worker-clock time of each job's last batch, and its last step seen.
        self._quiet = QuietClock(self.idle_tick_s, now)
        self._arrivals = IdleJobs()
        self._last_seen: dict[str, tuple[int, int]] = {}  # job -> (last step, end of its last event in ns)
        self.staging = staging or Staging()
        # Closed windows waiting to be summarized together, since when (worker clock), and the last message
        # that closed one (an emission's dead letters name a message).
        self._staged: list[ClosedWindow] = []
        self._staged_since = 0.0
        self._staged_handle: H | None = None

    @property
    def pending_messages(self) -> int:
        """Messages taken and not acked yet (their windows are open or their summaries on their way)."""
        return len(self._pending)

    @property
    def open_windows(self) -> int:
        return self.buffer.open_windows

    @property
    def staged_windows(self) -> int:
        """Closed windows waiting to be summarized together (see :class:`Staging`)."""
        return len(self._staged)

    def flush_staged(self, now: float) -> Routed[H]:
        """The summaries of the staged windows once the first has waited ``staging.max_age_s`` (``now``: the
        worker's monotonic clock, s); an empty answer before. The worker asks this on a timer."""
        if not self._staged or now - self._staged_since < self.staging.max_age_s:
            return Routed()
        handle = self._staged_handle
        emission, failed = self._emit(self._unstage(), handle)  # type: ignore[arg-type]
        return Routed(dead=self._dead(failed), emission=emission)

    def take(self, batch: KernelBatch, handle: H, partition: int, offset: int, now: float,
             now_ns: int) -> Routed[H]:
        """Route one decoded batch read at ``partition``/``offset``; ``now`` is the worker's monotonic clock (s),
        ``now_ns`` its wall clock (ns, only to bound skew of ranks with no watermark yet). Never raises for the
        batch's content: a failure dead-letters the message whole."""
        token = next(self._tokens)
        self._pending[token] = (handle, offset)
        try:
            if batch.is_job_end:
                return self._end_job(batch, handle, token, partition)
            return self._add(batch, handle, token, partition, offset, now, now_ns)
        except Exception as exc:  # one message never stops the partition: dead-letter it whole, go on
            self.stats.failed_messages += 1
            log.error("kernel batch of %s/%s at partition %d offset %d failed: %s", batch.job_id, batch.rank,
                      partition, offset, failure_reason(exc))
            self.buffer.discard(token)
            return Routed(ack=self._acks([token]),
                          dead=self._dead([DeadLetter(failure_reason(exc), job=batch.job_id, rank=batch.rank)]))

    def undecodable(self, reason: str) -> Routed[Any]:
        """A message that did not decode: its dead letter; the caller acks it (it was never taken)."""
        return Routed(dead=self._dead([DeadLetter(reason)]))

    def delivered(self, emission: Emission[H], failures: Iterable[tuple[KernelSummary, bytes, BaseException]] = ()
                  ) -> Routed[H]:
        """``emission``'s summaries were sent; ``failures`` those the broker refused (with their payloads), which
        are dead-lettered (kept, never dropped). Frees its windows: the messages now safe to ack."""
        dead = [DeadLetter(f"summary of {s.job_id}/{s.kernel}/{s.stream} not delivered: {failure_reason(exc)}",
                           payload=payload, job=s.job_id) for s, payload, exc in failures]
        free: list[int] = []
        for w in emission.windows:
            self.stats.events_summarized += len(w)
            if w.late:
                self.stats.late_events += len(w)
            if w.folded_events:
                self.stats.folded_events += w.folded_events
                log.warning("%s/%s window [%d, %d): more than %d kernel names, %d events summarized as "
                            "'[other kernels]'", w.job_id, w.rank, w.start_ns, w.end_ns,
                            self.worker.max_kernel_names, w.folded_events)
            free.extend(self.buffer.release(w))
        return Routed(ack=self._acks(free), dead=self._dead(dead))

    def job_closed(self, rec: JobLifecycle) -> bool:
        """A lifecycle record read: whether to append a job-end marker to every kernel partition (an END or
        ABANDONED). The END can overtake batches still queued in other partitions, so it is not applied here:
        the marker closes the job's windows there once everything produced before it was read."""
        if rec.event not in (LifecycleEvent.END, LifecycleEvent.ABANDONED):
            return False
        self._arrivals.forget(rec.job_id)
        self._last_seen.pop(rec.job_id, None)
        return True

    def idle_jobs(self, now: float) -> list[JobLifecycle]:
        """The ABANDONED records to write for jobs with windows open here and no kernel batch for twice
        ``job_idle_timeout_s`` (a job of kernels only never reaches the diagnosis agents, which abandon the
        others long before). ``now``: the worker's monotonic clock (s)."""
        now = self._quiet.read(now)  # a busy worker has not seen what may have arrived
        timeout_s = 2 * self.worker.job_idle_timeout_s
        idle = self._arrivals.idle(now, timeout_s)
        if not idle:
            return []
        open_jobs, out = self.buffer.open_jobs(), []
        for job_id in idle:
            age = self._arrivals.age(job_id, now)
            self._arrivals.forget(job_id)
            step, end_ns = self._last_seen.pop(job_id, (-1, 0))
            if job_id not in open_jobs:
                continue  # nothing held here
            world = 1 + max((r for j, r in self._partition_of if j == job_id), default=0)
            out.append(JobLifecycle(job_id, LifecycleEvent.ABANDONED, end_ns, world, source="streams",
                                    reason=f"kernels only: no kernel batch for {age or 0.0:.1f} s (twice "
                                           f"job_idle_timeout_s = {self.worker.job_idle_timeout_s:g})",
                                    last_step=step))
            self.stats.jobs_abandoned += 1
            log.warning("job %s: ABANDONED by the compressor (kernels only, idle %.1f s, last step %d)", job_id,
                        age or 0.0, step)
        return out

    def revoked(self) -> None:
        """Partitions were revoked: forget everything, ack nothing (un-acked messages are re-delivered from the
        committed offsets, and summarized again into the same pieces)."""
        self.buffer.clear()
        self._unstage()
        self._pending.clear()
        self._partition_of.clear()
        self._arrivals.clear()
        self._last_seen.clear()

    # -- the steps -------------------------------------------------------------------------------------------

    def _add(self, batch: KernelBatch, handle: H, token: int, partition: int, offset: int, now: float,
             now_ns: int) -> Routed[H]:
        st = self.stats
        st.batches += 1
        st.events_in += len(batch)
        self._arrivals.touch(batch.job_id, self._quiet.read(now))
        if len(batch):
            step, end_ns = self._last_seen.get(batch.job_id, (-1, 0))
            self._last_seen[batch.job_id] = (max(step, int(batch.step.max())),
                                             max(end_ns, int((batch.start_ns + batch.duration_ns).max())))
        if batch.end_of_stream:
            self._partition_of.pop((batch.job_id, batch.rank), None)
        else:
            self._partition_of[(batch.job_id, batch.rank)] = partition
        update = self.buffer.add(batch, token, position=offset, now_ns=now_ns)
        if update.duplicate:
            st.duplicate_batches += 1
        where, dead = f"{batch.job_id}/{batch.rank}", []
        if update.skewed is not None:
            st.skewed_events += len(update.skewed)
            dead.append(DeadLetter(f"skew: {len(update.skewed)} events of {where} start more than "
                                   f"{self.worker.max_event_skew_ns} ns after the rank's watermark (first at "
                                   f"{int(update.skewed.start_ns.min())} ns)", payload=update.skewed.encode(),
                                   job=batch.job_id, rank=batch.rank))
        if update.late is not None:  # not with late_pieces; kept for a buffer that returns late events
            st.late_events += len(update.late)
            dead.append(DeadLetter(f"late: {len(update.late)} events of {where} for windows already closed",
                                   payload=update.late.encode(), job=batch.job_id, rank=batch.rank))
        emission, failed = self._stage(update.closed, handle, now)
        return Routed(ack=self._acks(update.free_tokens), dead=self._dead(dead + failed), emission=emission)

    def _end_job(self, batch: KernelBatch, handle: H, token: int, partition: int) -> Routed[H]:
        ranks = {r for (j, r), p in self._partition_of.items() if j == batch.job_id and p == partition}
        for r in ranks:
            del self._partition_of[(batch.job_id, r)]
        # A rank with windows here but no partition (its partition's marker came first, or its end batch was
        # taken as a copy) is closed too: no window may stay open, and its messages un-acked, for good.
        ranks |= {r for r in self.buffer.ranks_of(batch.job_id) if (batch.job_id, r) not in self._partition_of}
        # Every staged window goes first: the marker must follow every summary of the job.
        emission, failed = self._emit(self._unstage() + self.buffer.flush_job(batch.job_id, ranks), handle)
        return Routed(ack=self._acks([token]), dead=self._dead(failed), emission=emission,
                      end_marker=(batch.job_id, partition))

    def _stage(self, closed: list[ClosedWindow], handle: H, now: float
               ) -> tuple[Emission[H] | None, list[DeadLetter]]:
        """Stage ``closed``; the emission of every staged window once ``staging.windows`` wait."""
        if closed:
            if not self._staged:
                self._staged_since = now
            self._staged.extend(closed)
            self._staged_handle = handle
        if len(self._staged) < self.staging.windows:
            return None, []
        return self._emit(self._unstage(), handle)

    def _unstage(self) -> list[ClosedWindow]:
        staged, self._staged, self._staged_handle = self._staged, [], None
        return staged

    def _emit(self, closed: list[ClosedWindow], handle: H) -> tuple[Emission[H] | None, list[DeadLetter]]:
        if not closed:
            return None, []
        out, failed = summarize_isolated(closed, self.params)
        dead = []
        for w, exc in failed:
            offsets = sorted(self._pending[t][1] for t in w.tokens if t in self._pending)
            self.stats.failed_windows += 1
            dead.append(DeadLetter(f"window [{w.start_ns}, {w.end_ns}) of {w.job_id}/{w.rank} (messages at "
                                   f"offsets {offsets}) cannot be summarized: {failure_reason(exc)}",
                                   payload=w.as_batch().encode(), job=w.job_id, rank=w.rank))
        self.stats.summaries_out += len(out)
        self.stats.windows_closed += len(closed)
        # A failed window is released with the others: its events are in its dead letter.
        return Emission(tuple(out), tuple(closed), handle), dead

    def _acks(self, tokens: Iterable[int]) -> list[H]:
        return [entry[0] for t in tokens if (entry := self._pending.pop(t, None)) is not None]

    def _dead(self, letters: list[DeadLetter]) -> list[DeadLetter]:
        self.stats.dead_letters += len(letters)
        return letters
