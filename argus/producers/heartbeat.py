"""Heartbeats of one rank: what it is doing now, published from a background thread.

The training thread only writes a few attributes of a preallocated :class:`LiveState` (the step begun, a
fixed-size stack of the phases open, the collective in flight) and bumps a counter: no allocation of its own,
no lock, no Kafka call. A :class:`HeartbeatThread` reads that state and publishes a
:class:`~argus.schemas.records.Heartbeat` through the publisher's bounded queue (a full queue drops and counts):

* every ``interval_s`` seconds (``Settings.heartbeat_interval_s``), and
* on phase entry, when the rank is still in a newly entered phase (or collective) one tick later (a tick is
  a quarter of the interval, at most 0.25 s). Phases that come and go faster than a tick (the usual case)
  then add nothing, while a rank that stops inside a collective says so within about two ticks — the
  record a hang diagnosis needs most.

Details and reasoning: docs/internals/producers.md.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from argus.producers.cuda_timing import PhaseRec, epoch_ns
from argus.schemas.records import Heartbeat, ParallelGroup, PauseReason, PhaseKind
from argus.topics import PublisherLike, Topic, job_key

__all__ = ["MAX_DEPTH", "HeartbeatThread", "LiveState"]

log = logging.getLogger(__name__)

#: Phases tracked per rank as nested (deeper ones are timed but not named in heartbeats).
MAX_DEPTH = 16
_GROUPS = tuple(ParallelGroup)
_GROUP_IDX = {g: i for i, g in enumerate(_GROUPS)}


def _completed(work: Any) -> bool:
    """Whether an async collective's work (or list of works) finished; True when it cannot be told."""
    try:
        works = work if isinstance(work, (list, tuple)) else (work,)
        return all(w is None or bool(w.is_completed()) for w in works)
    except Exception:
        return True


class LiveState:
    """What one rank is doing now; written by the training thread only, read by :class:`HeartbeatThread`.

    Attributes:
        version: bumped on every change (step begun, phase entered, collective issued).
        step: the last step begun (-1 before the first).
        stack, depth: the phases entered and not exited, innermost at ``stack[depth - 1]``.
        coll_kind: kind of the collective in flight (None if none), in ``coll_group``; ``coll_seq`` its
            number among this rank's collectives of that group kind; ``coll_t0`` when it was issued
            (``perf_counter_ns``); ``coll_work`` its async work when the host did not wait for it (the
            collective is in flight until that work completes).
        seqs: next collective sequence number per :class:`ParallelGroup` (by its position in the enum).
        control: ``(pause reasons, last control command id, its refusal, pauses so far)`` of kernel records,
            replaced whole by the control and CUPTI threads (:meth:`set_control`), never by training.
    """

    __slots__ = ("coll_group", "coll_kind", "coll_seq", "coll_t0", "coll_work", "control", "depth", "seqs", "stack",
                 "step", "version")

    def __init__(self) -> None:
        self.version = 0
        self.step = -1
        self.stack: list[PhaseRec | None] = [None] * MAX_DEPTH
        self.depth = 0
        self.coll_kind: PhaseKind | None = None
        self.coll_group = ParallelGroup.NONE
        self.coll_seq = -1
        self.coll_t0 = 0
        self.coll_work: Any = None
        self.seqs = [0] * len(_GROUPS)
        self.control: tuple[tuple[PauseReason, ...], str, str, int] = ((), "", "", 0)

    def set_control(self, reasons: tuple[PauseReason, ...], ack: str, error: str, pauses: int) -> None:
        """Kernel pause reasons and the last control command (control/CUPTI threads); the next heartbeat says so."""
        self.control = (reasons, ack, error, pauses)
        self.version += 1  # a racing increment may be lost: the periodic heartbeat still carries the change

    # -- training thread ----------------------------------------------------------------------------------

    def enter(self, rec: PhaseRec) -> None:
        """A phase began (deeper than :data:`MAX_DEPTH`: not tracked)."""
        d = self.depth
        if d < MAX_DEPTH:
            self.stack[d] = rec
            self.depth = d + 1
            self.version += 1

    def exit(self, rec: PhaseRec) -> None:
        """A phase ended; phases above it that never ended (an exception skipped their exit) go with it. A
        phase not on the stack (opened deeper than :data:`MAX_DEPTH`) changes nothing."""
        d = self.depth
        if d and self.stack[d - 1] is rec:  # the usual case: the innermost phase ends
            self.stack[d - 1] = None
            self.depth = d - 1
            self.version += 1
            return
        for i in range(d - 2, -1, -1):
            if self.stack[i] is rec:
                for j in range(i, d):
                    self.stack[j] = None
                self.depth = i
                self.version += 1
                return

    def begin_step(self, step: int) -> None:
        self.step = step
        self.version += 1

    def issue(self, kind: PhaseKind, group: ParallelGroup, t0: int) -> None:
        """A collective was issued through the tracer (host time ``t0``, ``perf_counter_ns``)."""
        i = _GROUP_IDX[group]
        self.coll_seq = self.seqs[i]
        self.seqs[i] = self.coll_seq + 1
        self.coll_work = None
        self.coll_group, self.coll_t0 = group, t0
        self.coll_kind = kind  # last: a reader that sees the kind sees its group and seq
        self.version += 1

    def done(self, group: ParallelGroup, seq: int) -> None:
        """The collective ``seq`` of ``group`` finished on the host (a later one issued since stays)."""
        if self.coll_seq == seq and self.coll_group is group:
            self.coll_kind = None
            self.version += 1

    # -- heartbeat thread ---------------------------------------------------------------------------------

    def snapshot(self, job_id: str, rank: int, time_ns: int, group_index: dict[ParallelGroup, int]) -> Heartbeat:
        """The state as a :class:`Heartbeat` taken at ``time_ns`` (ns since the epoch)."""
        d = min(self.depth, MAX_DEPTH)
        rec = self.stack[d - 1] if d > 0 else None
        kind, work = self.coll_kind, self.coll_work
        reasons, ack, error, pauses = self.control
        if kind is not None and work is not None and _completed(work):
            kind = None
        name, pkind = (rec.name, rec.kind) if rec else ("", None)
        if kind is None:
            return Heartbeat(job_id, rank, time_ns, self.step, name, pkind, kernels_paused=bool(reasons),
                             pause_reasons=reasons, control_ack=ack, control_error=error, kernel_pauses=pauses)
        group = self.coll_group
        return Heartbeat(job_id, rank, time_ns, self.step, name, pkind, kind, group, group_index.get(group, -1),
                         self.coll_seq, epoch_ns(self.coll_t0), bool(reasons), reasons, ack, error, pauses)


class HeartbeatThread:
    """Publishes the :class:`LiveState` of one rank as heartbeats (see the module docstring).

    Args:
        interval_s: seconds between periodic heartbeats.
        group_index: per group kind, the index of this rank's group (the topology's ``*_group`` column).
    """

    def __init__(self, job_id: str, rank: int, state: LiveState, publisher: PublisherLike, interval_s: float,
                 group_index: dict[ParallelGroup, int] | None = None) -> None:
        self.job_id, self.rank, self.state = job_id, rank, state
        self._publisher = publisher
        self.set_interval(interval_s)
        self.group_index = dict(group_index or {})
        self.published = self.dropped = self.errors = 0
        self._stop = threading.Event()
        self._key = job_key(job_id)
        self._thread: threading.Thread | None = None

    def set_interval(self, interval_s: float) -> None:
        """Seconds between periodic heartbeats (``argus control set heartbeat_interval_s=...``); from the next."""
        self.interval_s = interval_s
        self.tick_s = min(0.25, interval_s / 4)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"argus-heartbeat-{self.rank}", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop publishing (no heartbeat after it returns, unless the thread was stuck past ``timeout_s``)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def beat(self) -> None:
        """Publish one heartbeat now (the thread's work; also usable from tests)."""
        try:
            hb = self.state.snapshot(self.job_id, self.rank, time.time_ns(), self.group_index)
            if self._publisher.publish(Topic.HEARTBEATS, self._key, hb):
                self.published += 1
            else:
                self.dropped += 1
        except Exception as exc:  # never let the thread die: a dead heartbeat would look like a hang
            self.errors += 1
            if self.errors <= 10:
                log.warning("rank %d: heartbeat failed: %s: %s", self.rank, type(exc).__name__, exc)

    def _run(self) -> None:
        state = self.state
        next_due = time.monotonic()
        sent_version = seen_version = -1
        while not self._stop.is_set():
            now = time.monotonic()
            v = state.version
            # On entry: the state changed since the last heartbeat and held still for a whole tick.
            settled = v != sent_version and v == seen_version
            if now >= next_due or settled:
                self.beat()
                sent_version = v
                next_due = now + self.interval_s
            seen_version = v
            self._stop.wait(self.tick_s)
