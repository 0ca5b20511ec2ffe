"""Asynchronous resolution of step and phase timings: the tracer's training-thread side only records.

The training thread (:class:`~argus.producers.tracer.Tracer`) fills a :class:`StepRec` per step with
:class:`PhaseRec` s: host ``perf_counter_ns`` stamps always, and with CUDA a pair of timing events per phase
(``torch.cuda.Event(enable_timing=True)``, taken from a bounded :class:`EventPool`) recorded on the stream
the phase's work runs on. At the end of a step it appends the StepRec to the :class:`StepResolver`'s bounded
queue. The resolver's daemon thread polls ``event.query()`` (never ``synchronize``) until every event of the
oldest step has completed, computes durations with ``elapsed_time``, returns the events to the pool and
publishes one :class:`~argus.schemas.records.Step` and one :class:`~argus.schemas.records.PhaseBatch`.

Times of a step, integer ns: see docs/internals/producers.md.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from argus.schemas.records import ParallelGroup, PhaseBatch, PhaseKind, Step
from argus.topics import PublisherLike, Topic, job_key

__all__ = ["EPOCH_ANCHOR_NS", "EventPool", "PhaseOpener", "PhaseRec", "StepRec", "StepResolver", "epoch_ns"]

log = logging.getLogger(__name__)

#: ``time_ns() - perf_counter_ns()`` taken once at import: host stamps are monotonic, published as epoch ns.
EPOCH_ANCHOR_NS = time.time_ns() - time.perf_counter_ns()


def epoch_ns(perf_ns: int) -> int:
    """A ``perf_counter_ns`` stamp as integer ns since the Unix epoch."""
    return perf_ns + EPOCH_ANCHOR_NS


class PhaseRec:
    """One phase as recorded on the training thread (``t1 == 0`` / ``ev1 is None`` until it ends)."""

    __slots__ = ("ev0", "ev1", "group", "kind", "name", "on", "stream", "t0", "t1")

    def __init__(self, name: str, kind: PhaseKind, group: ParallelGroup, stream: int, t0: int,
                 ev0: Any = None, on: Any = None) -> None:
        self.name, self.kind, self.group, self.stream = name, kind, group, stream
        self.t0, self.t1 = t0, 0
        self.ev0: Any = ev0
        self.ev1: Any = None
        #: the torch.cuda.Stream the start event went on, until the end event is recorded there
        self.on: Any = on


class StepRec:
    """One step as recorded on the training thread."""

    __slots__ = ("dropped_phases", "ev0", "ev1", "expert_tokens", "phases", "step", "t0", "t1")

    def __init__(self, step: int, t0: int, ev0: Any = None) -> None:
        self.step, self.t0, self.t1 = step, t0, 0
        self.ev0: Any = ev0
        self.ev1: Any = None
        self.phases: list[PhaseRec] = []
        self.dropped_phases = 0
        #: tokens routed to the rank's MoE experts this step (None: not counted)
        self.expert_tokens: int | None = None

    def events(self) -> list[Any]:
        out = [e for e in (self.ev0, self.ev1) if e is not None]
        for p in self.phases:
            if p.ev0 is not None:
                out.append(p.ev0)
            if p.ev1 is not None:
                out.append(p.ev1)
        return out


class EventPool:
    """Reusable CUDA timing events, at most ``capacity`` alive; :meth:`get` returns None when exhausted.

    ``factory`` creates one event (``torch.cuda.Event(enable_timing=True)``). :meth:`get` runs on the training
    thread, :meth:`put` on the resolver thread (deque operations are atomic).
    """

    def __init__(self, factory: Callable[[], Any], capacity: int = 65_536, prewarm: int = 0) -> None:
        self._factory = factory
        self._free: collections.deque[Any] = collections.deque()
        self.capacity = capacity
        self.alive = 0
        self.exhausted = 0
        for _ in range(min(prewarm, capacity)):
            self._free.append(factory())
            self.alive += 1

    def get(self) -> Any:
        try:
            return self._free.pop()
        except IndexError:
            pass
        if self.alive >= self.capacity:
            self.exhausted += 1
            return None
        self.alive += 1
        return self._factory()

    def put(self, events: list[Any]) -> None:
        self._free.extend(events)

    def forget(self, n: int) -> None:
        """``n`` events were dropped with their step (garbage-collected, not returned)."""
        self.alive -= n


class StepResolver:
    """Resolves StepRecs into Step + PhaseBatch records on a daemon thread and publishes them.

    Args:
        job_id, rank: the records' identity.
        publisher: non-blocking ``publish(topic, key, record) -> bool``.
        pool: where resolved events go back (None in host-clock mode).
        max_pending: bound of the queue of steps waiting for their events; beyond it a step is dropped.
        poll_s: pause between polls of an incomplete step's events.
    """

    def __init__(self, job_id: str, rank: int, publisher: PublisherLike, pool: EventPool | None = None,
                 max_pending: int = 256, poll_s: float = 0.001) -> None:
        self.job_id, self.rank = job_id, rank
        self._key = job_key(job_id)
        self._publisher = publisher
        self._pool = pool
        self._max_pending = max_pending
        self._poll_s = poll_s
        self._pending: collections.deque[StepRec] = collections.deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._deadline = float("inf")
        self.steps_published = self.phase_batches_published = self.phases = 0
        self.steps_dropped = self.phases_dropped = self.publish_dropped = self.errors = 0
        self._thread = threading.Thread(target=self._run, name=f"argus-step-resolver-{rank}", daemon=True)
        self._thread.start()

    def submit(self, rec: StepRec) -> bool:
        """Queue a finished step (training thread; O(1), never blocks). False if dropped (queue full)."""
        if len(self._pending) >= self._max_pending or self._stop.is_set():
            with self._lock:
                self.steps_dropped += 1
            if self._pool is not None:
                self._pool.forget(len(rec.events()))
            return False
        self._pending.append(rec)
        self._wake.set()
        return True

    @property
    def pending(self) -> int:
        return len(self._pending)

    def close(self, timeout_s: float = 10.0) -> None:
        """Resolve what is queued (waiting up to ``timeout_s`` for the GPU), then stop the thread."""
        self._deadline = time.monotonic() + timeout_s
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s + 1.0)
        if self._thread.is_alive():
            log.warning("rank %d: step resolver still busy after %.1f s", self.rank, timeout_s)

    def _run(self) -> None:
        current: StepRec | None = None
        events: list[Any] = []
        checked = 0  # events of the oldest step already seen complete
        while True:
            if not self._pending:
                if self._stop.is_set():
                    return
                self._wake.wait(0.1)
                self._wake.clear()
                continue
            rec = self._pending[0]
            try:
                if rec is not current:
                    current, events, checked = rec, rec.events(), 0
                while checked < len(events) and events[checked].query():
                    checked += 1
                if checked < len(events):
                    if self._stop.is_set() and time.monotonic() > self._deadline:
                        self._drop_rest()
                        return
                    time.sleep(self._poll_s)
                    continue
                self._pending.popleft()
                self._publish(rec)
                if self._pool is not None and events:
                    self._pool.put(events)
            except Exception:
                if self._pending and self._pending[0] is rec:
                    self._pending.popleft()
                with self._lock:
                    self.errors += 1
                log.exception("rank %d: step %d not resolved", self.rank, rec.step)

    def _drop_rest(self) -> None:
        n = len(self._pending)
        with self._lock:
            self.steps_dropped += n
        self._pending.clear()
        log.warning("rank %d: %d steps dropped at close: their GPU events did not complete in time", self.rank, n)

    def _publish(self, rec: StepRec) -> None:
        start_ns = epoch_ns(rec.t0)
        wall_ns = max(0, rec.t1 - rec.t0)
        kinds: list[PhaseKind] = []
        names: list[str] = []
        groups: list[ParallelGroup] = []
        streams: list[int] = []
        starts: list[int] = []
        durs: list[int] = []
        dropped = rec.dropped_phases
        gpu_lo = gpu_hi = 0.0
        base = rec.ev0
        if base is not None and rec.ev1 is not None:
            gpu_hi = base.elapsed_time(rec.ev1)
        for p in rec.phases:
            if p.ev0 is not None and base is not None:
                if p.ev1 is None:
                    dropped += 1
                    continue
                s_ms, e_ms = base.elapsed_time(p.ev0), base.elapsed_time(p.ev1)
                gpu_lo, gpu_hi = min(gpu_lo, s_ms), max(gpu_hi, e_ms)
                starts.append(start_ns + round(s_ms * 1e6))
                durs.append(max(0, round((e_ms - s_ms) * 1e6)))
            else:
                if not p.t1:
                    dropped += 1
                    continue
                starts.append(epoch_ns(p.t0))
                durs.append(max(0, p.t1 - p.t0))
            kinds.append(p.kind)
            names.append(p.name)
            groups.append(p.group)
            streams.append(p.stream if p.ev0 is not None else -1)
        gpu_ns = max(0, round((gpu_hi - gpu_lo) * 1e6)) if base is not None and rec.ev1 is not None else None
        step = Step(self.job_id, self.rank, rec.step, start_ns, wall_ns, gpu_ns, rec.expert_tokens)
        batch = PhaseBatch(self.job_id, self.rank, rec.step, tuple(kinds), tuple(names), tuple(groups),
                           tuple(streams), tuple(starts), tuple(durs))
        ok_step = self._publisher.publish(Topic.STEPS, self._key, step)
        ok_phases = self._publisher.publish(Topic.PHASES, self._key, batch)
        with self._lock:
            self.phases += len(kinds)
            self.phases_dropped += dropped
            self.steps_published += ok_step
            self.phase_batches_published += ok_phases
            self.publish_dropped += (not ok_step) + (not ok_phases)


class PhaseOpener:
    """What the tracer's mixins (hooks, collective wrappers) need from :class:`~argus.producers.tracer.Tracer`."""

    def _open(self, name: str, kind: PhaseKind, group: ParallelGroup, stream: Any, host: bool = False
              ) -> PhaseRec | None:
        raise NotImplementedError

    def _close(self, rec: PhaseRec) -> None:
        raise NotImplementedError

    def _error(self, where: str, exc: BaseException) -> None:
        raise NotImplementedError

    def _capturing(self) -> bool:
        """The current CUDA stream is capturing a graph (see :mod:`argus.producers.tracer_graphs`)."""
        raise NotImplementedError

