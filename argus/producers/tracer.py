"""The rank-side tracer a training script adopts in a few lines: steps, phases, collectives, kernels.

:class:`Tracer` (``with Tracer(settings, job_id=..., rank=..., world_size=...) as tracer``) times steps
(``tracer.step()``), phases (``tracer.phase(name, kind)``, or hooks: ``instrument``, ``instrument_optimizer``) and
collectives (its wrappers, or ``tracer.collective(...)`` for your own) and publishes per step a Step and a
PhaseBatch, with CUPTI KernelBatches, through the non-blocking publisher. With CUDA the training thread only
records timing events (:mod:`argus.producers.cuda_timing`); nothing here raises into training.

The full example, what it publishes and why collectives are timed on their own stream: docs/internals/producers.md.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from argus.core.settings import Settings
from argus.producers.control import ControlThread, RankControl
from argus.producers.cuda_timing import EventPool, PhaseRec, StepRec, StepResolver, epoch_ns
from argus.producers.cupti_kernels import CuptiKernels, CuptiState, CuptiStatus, StepMarks
from argus.producers.heartbeat import HeartbeatThread, LiveState
from argus.producers.profiler_guard import ProfilerGuard
from argus.producers.rank_registry import RankRegistry
from argus.producers.tracer_auto import AutoMixin
from argus.producers.tracer_collectives import CollectiveMixin
from argus.producers.tracer_ddp import DDPMixin
from argus.producers.tracer_graphs import GraphMixin
from argus.producers.tracer_hooks import HookMixin
from argus.producers.tracer_patch import PatchMixin
from argus.schemas.records import JobLifecycle, JobTopology, LifecycleEvent, ParallelGroup, PauseReason, PhaseKind
from argus.topics import PublisherLike, Topic, job_key, publish_in_order

try:  # torch is optional: without it the tracer still times steps and phases with the host clock
    import torch as _torch
except ImportError:  # pragma: no cover - torch is installed wherever training runs
    _torch = None  # type: ignore[assignment]
torch: Any = _torch

__all__ = ["PublisherLike", "Tracer", "TracerStats"]

log = logging.getLogger(__name__)

_perf = time.perf_counter_ns


class _NullPublisher:
    def publish(self, topic: Topic, key: bytes, record: Any) -> bool:
        return False

    def flush(self, timeout_s: float = 30.0) -> int:
        return 0


@dataclass(frozen=True)
class TracerStats:
    """Counters of a :class:`Tracer` (counts of records, steps and phases)."""

    steps: int
    steps_published: int
    phase_batches_published: int
    phases: int
    steps_dropped: int
    phases_dropped: int
    publish_dropped: int
    errors: int
    kernel_events: int
    cupti: CuptiStatus
    cuda: bool
    #: Heartbeats handed to the publisher / refused by its full queue.
    heartbeats_published: int = 0
    heartbeats_dropped: int = 0
    #: Times kernel records were paused (argus control, sampling, a profiler); control commands applied/refused.
    kernel_pauses: int = 0
    control_applied: int = 0
    control_refused: int = 0
    #: torch.profiler sessions of this process that argus stepped aside for.
    profiler_sessions: int = 0
    #: Phases opened while a CUDA graph was being captured (left out: the GPU runs nothing then).
    phases_captured: int = 0


class _PhaseScope:
    """``with tracer.phase(...)``: opens a phase on entry, closes it on exit (never raises)."""

    __slots__ = ("_group", "_kind", "_name", "_rec", "_stream", "_tracer")

    def __init__(self, tracer: Tracer, name: str, kind: PhaseKind, group: ParallelGroup, stream: Any) -> None:
        self._tracer, self._name, self._kind, self._group, self._stream = tracer, name, kind, group, stream
        self._rec: PhaseRec | None = None

    def __enter__(self) -> _PhaseScope:
        self._rec = self._tracer._open(self._name, self._kind, self._group, self._stream)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._rec is not None:
            self._tracer._close(self._rec)


class _StepScope:
    __slots__ = ("_step", "_tracer")

    def __init__(self, tracer: Tracer, step: int | None) -> None:
        self._tracer, self._step = tracer, step

    def __enter__(self) -> int:
        return self._tracer._begin_step(self._step)

    def __exit__(self, *exc: object) -> None:
        self._tracer._end_step()


class Tracer(CollectiveMixin, HookMixin, AutoMixin, DDPMixin, PatchMixin, GraphMixin):
    """Always-on tracing of one rank of a training job (see the module docstring for an example).

    Args:
        settings: Kafka and batching settings (``Settings.load()`` when None).
        job_id: the training job's id (the same on every rank).
        rank, world_size: this process's global rank and the number of ranks.
        publisher: where records go; by default a :class:`~argus.producers.publisher.Publisher` created from
            ``settings`` (and closed by :meth:`close`).
        dp, tp, pp, ep: parallel degrees for the published topology (default ``dp = world_size / (tp * pp)``).
        topology: publish this topology instead of building one.
        cuda: time with CUDA events (default: when ``torch.cuda.is_available()``).
        kernels: trace GPU kernels with CUPTI (see :mod:`argus.producers.cupti_kernels`; a no-op without a GPU).
        lifecycle: publish topology, START and END (default: on rank 0).
        registry: the host's rank registry (``False`` to not register).
        max_pending_steps, max_phases_per_step, max_events: memory bounds (steps awaiting their GPU events,
            phases kept per step, live CUDA events).
        reduce_counts: at :meth:`close`, sum the record counts of all ranks with one ``all_reduce`` when
            ``torch.distributed`` is initialized (every rank must then call :meth:`close`), so that END
            carries the job's totals; otherwise a multi-rank END carries no counts.
        heartbeat: publish :class:`~argus.schemas.records.Heartbeat` s from :meth:`start` to :meth:`close`, every
            ``settings.heartbeat_interval_s`` seconds and on phase entry (see :mod:`argus.producers.heartbeat`).
        control: read ``argus control``'s commands to this job on a background thread
            (:mod:`argus.producers.control`); default ``settings.control`` when the tracer creates its own
            publisher (a publisher passed in is a test's or a tool's, not a live job's).

    :meth:`from_env` builds one from the launcher's environment, and ``argus.attach`` (:mod:`argus.producers.attach`)
    also starts it and instruments a model and optimizer. Raises ValueError for an empty ``job_id`` or a rank
    outside ``[0, world_size)``.
    """

    def __init__(self, settings: Settings | None, job_id: str, rank: int, world_size: int,
                 publisher: PublisherLike | None = None, *, dp: int | None = None, tp: int = 1, pp: int = 1,
                 ep: int = 1, topology: JobTopology | None = None, cuda: bool | None = None, kernels: bool = True,
                 lifecycle: bool | None = None, registry: RankRegistry | bool | None = None,
                 max_pending_steps: int = 256, max_phases_per_step: int = 4096, max_events: int = 65_536,
                 reduce_counts: bool = True, host: str | None = None, heartbeat: bool = True,
                 control: bool | None = None) -> None:
        if not job_id or rank < 0 or world_size < 1 or rank >= world_size:
            raise ValueError(f"invalid job_id {job_id!r}, rank {rank} or world_size {world_size}")
        self.job_id, self.rank, self.world_size = job_id, rank, world_size
        self.local_rank = rank  #: the rank on its host (``LOCAL_RANK``; from_env sets it)
        self.host = host or socket.gethostname()
        self._errors = 0
        try:
            self.settings = settings if settings is not None else Settings.load()
        except Exception as exc:
            self._error("settings", exc)
            self.settings = Settings()
        self._owns_publisher = publisher is None
        self._control_on = self.settings.control and publisher is None if control is None else control
        if publisher is None:
            try:
                from argus.producers.publisher import Publisher
                publisher = Publisher(self.settings)
            except Exception as exc:
                self._error("publisher", exc)
                publisher = _NullPublisher()
        self._publisher: PublisherLike = publisher
        self._dims = (dp, tp, pp, ep)
        self._topology = topology
        self._cuda = bool(torch is not None and torch.cuda.is_available()) if cuda is None else bool(cuda)
        self._lifecycle = (rank == 0) if lifecycle is None else lifecycle
        self._registry = (RankRegistry() if registry is None or registry is True
                          else registry if isinstance(registry, RankRegistry) else None)
        self._max_phases = max_phases_per_step
        self._reduce_counts = reduce_counts
        self._marks = StepMarks()
        self._pool: EventPool | None = None
        if self._cuda:
            self._pool = EventPool(lambda: torch.cuda.Event(enable_timing=True), capacity=max_events)
        self._resolver = StepResolver(job_id, rank, self._publisher, self._pool, max_pending=max_pending_steps)
        self._kernels: CuptiKernels | None = None
        if kernels:
            self._kernels = CuptiKernels(job_id, rank, world_size, self._publisher, self._marks,
                                         batch_events=self.settings.publisher_batch_events, host=self.host,
                                         retry_s=self.settings.cupti_retry_s, on_change=self._kernels_changed)
        self._cur: StepRec | None = None
        self._next_step = 0
        self._steps = 0
        self._outside = 0
        self._stream_ids: dict[int, int] = {}
        self._handles: list[Any] = []
        self._comm_streams: dict[tuple[int, int], Any] = {}
        self._started = self._closed = False
        # Written by the training thread (a few attribute stores per phase), read by the heartbeat thread.
        self._live = LiveState()
        self._ack = ("", "")  # the last control command applied, and why it was refused ('' if applied)
        self._control = RankControl(rank, world_size, self)
        self._control_thread: ControlThread | None = None
        self._graph_ids: dict[int, int] = {}  # id(torch.cuda.CUDAGraph) -> its number in phase names
        self._graph_patch: tuple[Any, Any, Any] | None = None
        self._captured = 0
        self._guard = ProfilerGuard(lambda: self.pause_kernels(PauseReason.PROFILER),
                                    lambda: self.resume_kernels(PauseReason.PROFILER))
        self._heartbeat = heartbeat
        self._beat: HeartbeatThread | None = None
        self._step_mode = "auto"  # iteration boundaries of the hooks: see argus.producers.tracer_auto
        self._group_kinds: dict[int, ParallelGroup] = {}  # id(process group) -> kind (argus.producers.tracer_patch)
        #: when set (argus.attach), the lifecycle rank resolves the topology with it on a background thread
        #: at start (it may wait for the other ranks) and publishes TOPOLOGY and START then.
        self._topology_fn: Callable[[], JobTopology | None] | None = None
        self._topology_thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._start_sent = False

    @classmethod
    def from_env(cls, settings: Settings | None = None, *, env: Mapping[str, str] | None = None,
                 publisher: PublisherLike | None = None, **overrides: Any) -> Tracer:
        """A tracer (not started) for this rank from the launcher's environment: ``RANK``, ``WORLD_SIZE``,
        ``LOCAL_RANK``, ``ARGUS_JOB_ID`` / ``TORCHELASTIC_RUN_ID``, ``ARGUS_TOPOLOGY`` and the process groups
        torch knows (details in :func:`argus.producers.attach.tracer_from_env`); ``overrides`` are Tracer
        arguments that win over the environment. Raises ValueError when the environment is inconsistent
        (``argus.attach`` never raises)."""
        from argus.producers.attach import tracer_from_env

        return tracer_from_env(settings, env=env, publisher=publisher, cls=cls, **overrides)

    # -- lifecycle -------------------------------------------------------------------------------------------

    def start(self) -> Tracer:
        """Publish topology and START (lifecycle rank), register the rank, start CUPTI. Idempotent.

        With ``torch.distributed`` initialized, the topology's host names are gathered from all ranks
        (``all_gather_object``): call it on every rank.
        """
        if self._started:
            return self
        self._started = True
        if self._pool is not None:
            try:
                self._pool.put([self._pool.get() for _ in range(min(256, self._pool.capacity))])
            except Exception as exc:
                self._error("event pool", exc)
        topology: JobTopology | None = None
        try:
            topology = self._topology or self._build_topology()
            if self._lifecycle and self._topology_fn is None:
                self._publish_start(topology)
        except Exception as exc:
            self._error("topology/START", exc)
        if self._registry is not None:
            try:
                self._registry.register(self.job_id, self.rank, host=self.host)
            except Exception as exc:
                self._error("rank registry", exc)
        if self._kernels is not None:
            state = self._kernels.start().state
            if state in (CuptiState.RUNNING, CuptiState.PAUSED):  # a profiler in the process: step aside for it
                try:
                    self._guard.install()
                except Exception as exc:
                    self._error("profiler guard", exc)
        if self._cuda:
            try:
                self.time_graph_replays()
            except Exception as exc:
                self._error("graph replays", exc)
        if self._heartbeat:
            try:
                self._beat = HeartbeatThread(self.job_id, self.rank, self._live, self._publisher,
                                             self.settings.heartbeat_interval_s, _group_index(topology, self.rank))
                self._beat.start()
            except Exception as exc:
                self._error("heartbeat", exc)
        if self._control_on:
            try:
                self._control_thread = ControlThread(self.settings, self.job_id, self._control)
                self._control_thread.start()
            except Exception as exc:
                self._error("control thread", exc)
        if self._topology_fn is not None and topology is not None:  # last: it updates the heartbeat's groups
            try:
                self._topology_thread = threading.Thread(target=self._resolve_topology, args=(topology,),
                                                         name=f"argus-topology-{self.rank}", daemon=True)
                self._topology_thread.start()
            except Exception as exc:
                self._error("topology thread", exc)
        return self

    def _publish_start(self, topology: JobTopology) -> None:
        with self._start_lock:  # once: from start(), the topology thread, or close() if that thread is late
            if self._start_sent:
                return
            self._start_sent = True
        key = job_key(self.job_id)
        self._publisher.publish(Topic.TOPOLOGY, key, topology)
        self._publisher.publish(Topic.LIFECYCLE, key, JobLifecycle(
            self.job_id, LifecycleEvent.START, time.time_ns(), self.world_size, source="live"))

    def _resolve_topology(self, local: JobTopology) -> None:
        """Off the training thread: the job's topology from the other ranks (``_topology_fn``); the lifecycle
        rank then publishes it and START (its local one if the exchange failed)."""
        topology = local
        try:
            fn = self._topology_fn
            resolved = fn() if fn is not None else None
            if resolved is not None:
                topology = resolved
                self._topology = resolved
                if self._beat is not None:
                    self._beat.group_index = _group_index(resolved, self.rank)
        except Exception as exc:
            self._error("topology exchange", exc)
        if not self._lifecycle:
            return
        try:
            self._publish_start(topology)
        except Exception as exc:
            self._error("topology/START", exc)

    def close(self, timeout_s: float = 30.0) -> TracerStats:
        """End the open step, stop CUPTI, resolve queued steps, publish END (lifecycle rank) and flush.
        Idempotent; never raises. See ``reduce_counts`` for the one collective it may run."""
        if self._closed:
            return self.stats()
        self._closed = True
        self.unpatch_collectives()
        self.untime_graph_replays()
        self._guard.uninstall()
        if self._control_thread is not None:
            self._control_thread.stop()
        if self._beat is not None:  # first: a closing rank is not a live one
            self._beat.stop()
        if self._cur is not None:
            self._end_step()
        for h in self._handles:
            try:
                h.remove()
            except Exception as exc:
                self._error("hook removal", exc)
        self._handles.clear()
        self._resolver.close(timeout_s=min(timeout_s, 10.0))  # the last Steps and PhaseBatches first,
        if self._kernels is not None:  # then the rank's end_of_stream kernel batch, then END (as the simulator)
            self._kernels.stop()
        # Every rank's records delivered before the count all_reduce, which the lifecycle rank's END follows: an
        # END delivered ahead of a rank's last kernel batches closes the job's windows without them.
        deadline = time.monotonic() + timeout_s
        try:
            if left := self._publisher.flush(timeout_s / 2):
                log.warning("rank %d: %d records not delivered before END", self.rank, left)
        except Exception as exc:
            self._error("publisher flush", exc)
        r = self._resolver
        counts = self._sum_over_ranks([r.steps_published, r.phase_batches_published,
                                       self._kernels.events if self._kernels else 0])
        if self._topology_thread is not None:  # START before END
            self._topology_thread.join(min(timeout_s, 10.0))
            if self._lifecycle and self._topology is not None:
                try:
                    self._publish_start(self._topology)  # the exchange is late: the local topology
                except Exception as exc:
                    self._error("topology/START", exc)
        if self._lifecycle and self._started:
            steps, phases, kernels = counts if counts is not None else (None, None, None)
            try:
                publish_in_order(self._publisher, Topic.LIFECYCLE, job_key(self.job_id), JobLifecycle(
                    self.job_id, LifecycleEvent.END, time.time_ns(), self.world_size, source="live",
                    kernel_events=kernels, steps=steps, phase_batches=phases),
                    max(0.0, (deadline - time.monotonic()) / 2))
            except Exception as exc:
                self._error("END", exc)
        try:
            left = self._publisher.flush(max(0.0, deadline - time.monotonic()))
            if left:
                log.warning("rank %d: %d records not delivered at close", self.rank, left)
            if self._owns_publisher:
                close = getattr(self._publisher, "close", None)
                if callable(close):
                    close(timeout_s=1.0)
        except Exception as exc:
            self._error("publisher flush", exc)
        if self._registry is not None:
            self._registry.unregister(self.job_id, self.rank)
        stats = self.stats()
        log.info("rank %d tracer closed: %s", self.rank, stats)
        return stats

    def __enter__(self) -> Tracer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> TracerStats:
        r = self._resolver
        return TracerStats(
            steps=self._steps, steps_published=r.steps_published, phase_batches_published=r.phase_batches_published,
            phases=r.phases, steps_dropped=r.steps_dropped,
            phases_dropped=r.phases_dropped + self._outside + (self._pool.exhausted if self._pool else 0),
            publish_dropped=r.publish_dropped, errors=self._errors + r.errors,
            kernel_events=self._kernels.events if self._kernels else 0,
            cupti=self._kernels.status if self._kernels else CuptiStatus(CuptiState.DISABLED, "kernels=False"),
            cuda=self._cuda, heartbeats_published=self._beat.published if self._beat else 0,
            heartbeats_dropped=self._beat.dropped if self._beat else 0,
            kernel_pauses=self._kernels.pauses if self._kernels else 0,
            control_applied=self._control.applied, control_refused=self._control.refused,
            profiler_sessions=self._guard.sessions, phases_captured=self._captured)

    @property
    def cupti_status(self) -> CuptiStatus:
        return self._kernels.status if self._kernels else CuptiStatus(CuptiState.DISABLED, "kernels=False")

    # -- control (argus control, a profiler alongside; never the training thread's work) ----------------

    def pause_kernels(self, reason: PauseReason) -> None:
        """Pause kernel records for ``reason`` (steps and phases go on); see :meth:`CuptiKernels.pause`."""
        if self._kernels is not None:
            self._kernels.pause(reason)

    def resume_kernels(self, reason: PauseReason) -> None:
        """Drop the pause for ``reason``; kernel records resume when no reason is left."""
        if self._kernels is not None:
            self._kernels.resume(reason)

    def set_runtime(self, key: str, value: float | int) -> None:
        """Apply runtime setting ``key`` (one of :data:`argus.schemas.control.RUNTIME_SETTINGS`, value checked)."""
        if key == "heartbeat_interval_s":
            if self._beat is not None:
                self._beat.set_interval(float(value))
        elif key == "kernel_batch_events":
            if self._kernels is not None:
                self._kernels.tune(batch_events=int(value))
        elif key == "kernel_max_latency_s":
            if self._kernels is not None:
                self._kernels.tune(max_latency_s=float(value))
        else:  # RUNTIME_SETTINGS and this method disagree: a bug, said in the ack
            raise ValueError(f"runtime setting {key!r} has no effect on this rank")

    def acknowledge(self, command_id: str, error: str) -> None:
        """The next heartbeat acknowledges control command ``command_id`` (refused for ``error`` unless empty)."""
        self._ack = (command_id, error)
        self._kernels_changed()

    def _kernels_changed(self) -> None:
        k = self._kernels
        ack, error = self._ack
        self._live.set_control(k.pause_reasons if k else (), ack, error, k.pauses if k else 0)

    # -- steps and phases (training thread) ----------------------------------------------------------------

    def step(self, step: int | None = None) -> _StepScope:
        """``with tracer.step():`` times one iteration (steps count from 0 unless ``step`` is given). Using it
        switches the hooks of ``argus.attach`` to ``"manual"`` boundaries: they no longer begin or end steps."""
        self._step_mode = "manual"
        return _StepScope(self, step)

    def phase(self, name: str, kind: PhaseKind = PhaseKind.OTHER, group: ParallelGroup = ParallelGroup.NONE,
              stream: Any = None) -> _PhaseScope:
        """``with tracer.phase("forward", PhaseKind.FORWARD):`` times a named phase of the current step.

        With CUDA the phase's events go on ``stream`` (a ``torch.cuda.Stream``; default the current stream).
        A phase outside a step is ignored and counted.
        """
        return _PhaseScope(self, name, kind, group, stream)

    def collective(self, name: str, kind: PhaseKind, group: ParallelGroup = ParallelGroup.NONE,
                   stream: Any = None) -> _PhaseScope:
        """A communication phase timed on ``stream``, the stream the collective is ordered on (see the module
        docstring: events on the compute stream make an async collective look instant)."""
        return _PhaseScope(self, name, kind, group, stream)

    def _begin_step(self, step: int | None) -> int:
        n = self._next_step if step is None else step
        try:
            if not self._started:
                self.start()
            if self._cur is not None:
                self._end_step()
            self._next_step = n + 1
            ev = None
            if self._pool is not None and not self._capturing():
                ev = self._pool.get()
                if ev is not None:
                    ev.record()
            t0 = _perf()
            self._cur = StepRec(n, t0, ev)
            self._live.begin_step(n)
            self._marks.mark(n, epoch_ns(t0))
            self._steps += 1
        except Exception as exc:
            self._error("step begin", exc)
        return n

    def _end_step(self) -> None:
        rec, self._cur = self._cur, None
        if rec is None:
            return
        try:
            if rec.ev0 is not None and self._pool is not None:
                ev = self._pool.get() if not self._capturing() else None  # a capture: host time only
                if ev is not None:
                    ev.record()
                    rec.ev1 = ev
            rec.t1 = _perf()
            self._resolver.submit(rec)
        except Exception as exc:
            self._error("step end", exc)

    def _open(self, name: str, kind: PhaseKind, group: ParallelGroup, stream: Any, host: bool = False,
              track: bool = True) -> PhaseRec | None:
        cur = self._cur
        if cur is None:
            self._outside += 1
            return None
        try:
            if self._capturing():  # the GPU runs nothing now, and a timing event would break the capture
                self._captured += 1
                return None
            if len(cur.phases) >= self._max_phases:
                cur.dropped_phases += 1
                return None
            if self._pool is not None and cur.ev0 is not None and not host:
                ev = self._pool.get()
                if ev is None:
                    cur.dropped_phases += 1
                    return None
                s = stream if stream is not None else torch.cuda.current_stream()
                ev.record(s)
                rec = PhaseRec(name, kind, group, self._stream_id(s), _perf(), ev, s)
            else:
                rec = PhaseRec(name, kind, group, -1, _perf())
            cur.phases.append(rec)
            if track:  # not for phases that overlap others instead of nesting (async collectives)
                self._live.enter(rec)
            return rec
        except Exception as exc:
            self._error("phase begin", exc)
            return None

    def _close(self, rec: PhaseRec) -> None:
        try:
            self._live.exit(rec)
            if rec.ev0 is not None and self._pool is not None and self._capturing():
                rec.on = None  # a capture began inside the phase: no event now (the phase is dropped, counted)
            elif rec.ev0 is not None and self._pool is not None:
                s, rec.on = rec.on, None
                ev = self._pool.get()
                if ev is not None:
                    ev.record(s)
                    rec.ev1 = ev
            rec.t1 = _perf()
        except Exception as exc:
            rec.ev1 = None
            self._error("phase end", exc)

    def _stream_id(self, stream: Any) -> int:
        ptr = int(stream.cuda_stream)
        sid = self._stream_ids.get(ptr)
        if sid is None:
            cupti_id = self._kernels.stream_id(ptr) if self._kernels is not None else None
            sid = cupti_id if cupti_id is not None else int(stream.stream_id)
            self._stream_ids[ptr] = sid
        return sid

    # -- helpers ---------------------------------------------------------------------------------------------

    def _torch(self) -> Any:
        return torch

    def _error(self, where: str, exc: BaseException) -> None:
        self._errors += 1
        if self._errors <= 10 or self._errors % 1000 == 0:
            log.warning("argus tracer (rank %s, pid %d): %s failed (%d errors so far): %s: %s",
                        getattr(self, "rank", "?"), os.getpid(), where, self._errors, type(exc).__name__, exc)


def _group_index(topology: JobTopology | None, rank: int) -> dict[ParallelGroup, int]:
    """Per group kind, the index of ``rank``'s group in ``topology`` (empty without one)."""
    if topology is None or rank not in topology.rank:
        return {}
    i = topology.rank.index(rank)
    return {ParallelGroup.DP: topology.dp_group[i], ParallelGroup.TP: topology.tp_group[i],
            ParallelGroup.PP: topology.pp_group[i], ParallelGroup.EP: topology.ep_group[i]}
