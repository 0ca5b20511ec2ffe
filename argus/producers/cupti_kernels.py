"""GPU kernel events of one rank through CUPTI's Activity API (``cupti-python``), as columnar KernelBatches.

Three decoupled paths: control (:meth:`CuptiKernels.start` / :meth:`CuptiKernels.stop`, on the training thread,
once), enqueue (CUPTI's buffer callback only appends to a bounded inbox) and parse/export (a daemon thread runs
:mod:`argus.producers.cupti_parse` and hands KernelBatches to the non-blocking publisher). The training thread
never waits on any of it.

Details and reasoning (buffer sizes, the GIL): docs/internals/producers.md.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import enum
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from argus.producers.cupti_parse import (
    KIND_CONCURRENT_KERNEL,
    KIND_MEMCPY,
    KIND_MEMSET,
    ActivityColumns,
    NameTable,
    StepMarks,
    columns_to_batches,
    cupti_enabled_for,
    extract_columns,
)
from argus.schemas.records import KernelBatch, PauseReason
from argus.topics import PublisherLike, Topic, rank_key

__all__ = ["CuptiKernels", "CuptiState", "CuptiStats", "CuptiStatus", "StepMarks"]

log = logging.getLogger(__name__)


class CuptiState(enum.Enum):
    """Where kernel tracing stands in this process."""

    IDLE = "IDLE"  #: not started yet
    RUNNING = "RUNNING"  #: activities enabled, batches flowing
    PAUSED = "PAUSED"  #: CUPTI released for a while (a profiler, argus control, sampling): see pause()
    STOPPED = "STOPPED"  #: stopped cleanly after running
    DISABLED = "DISABLED"  #: this process is not selected (rank list, compile worker, launcher, env)
    UNAVAILABLE = "UNAVAILABLE"  #: no cupti-python, CUDA driver or GPU (CUPTI held by another tool: PAUSED)
    FAILED = "FAILED"  #: started, then an unexpected CUPTI error


@dataclass(frozen=True)
class CuptiStatus:
    """The state of kernel tracing and why (``reason`` is empty while running)."""

    state: CuptiState
    reason: str = ""


@dataclass(frozen=True)
class CuptiStats:
    """Counters of a :class:`CuptiKernels` (records = CUPTI activity records)."""

    buffers: int
    records: int
    events: int
    skipped_records: int
    dropped_records: int
    cupti_dropped_records: int
    batches: int
    publish_dropped: int
    parse_errors: int


# -- the CUPTI session -----------------------------------------------------------------------------------


def _held_by_another_tool(exc: BaseException) -> bool:
    """Whether CUPTI refused because another tool (a profiler, nsys) holds it, not for want of a driver or GPU."""
    return "MULTIPLE_SUBSCRIBERS" in f"{exc!r} {exc}".upper()


def _load_cupti() -> tuple[Any | None, str]:
    try:
        from cupti import cupti
    except Exception as exc:  # ImportError, or a broken install raising anything at import
        return None, f"cupti-python not importable: {exc}"
    return cupti, ""


class CuptiKernels:
    """Kernel tracing of one rank: CUPTI activities -> KernelBatches on ``Topic.KERNELS`` (key job/rank).

    Args:
        job_id, rank, world_size: the job and this process's rank.
        publisher: where batches go (non-blocking ``publish``).
        marks: step start marks from the tracer (kernels get step -1 without).
        batch_events: events per KernelBatch (``Settings.publisher_batch_events``).
        host: host name written on the batches (default: this machine's).
        buffer_bytes: size of each CUPTI host activity buffer.
        max_queued_records: bound of the inbox between the CUPTI callback and the parser thread.
        max_latency_s: a partial batch is published after this long at the latest.
        flush_period_ms: CUPTI's periodic flush, so that records arrive while buffers are not full.
        device_buffer_bytes, device_buffers_preallocated, device_buffer_pool_limit: CUPTI's device-side pool.
        kinds: activity kinds to enable (``cupti.ActivityKind`` values); default kernels, memcpy, memset.
        env: environment for :func:`cupti_enabled_for` (default ``os.environ``).

    Call :meth:`start` and :meth:`stop` from one thread; :meth:`pause` and :meth:`resume` may come from any
    thread (the control thread, a profiler's start on the training thread) and are serialized.

    Pausing releases CUPTI: a final flush of this process's buffers, then the activities disabled, so that a
    profiler (torch.profiler's Kineto, nsys) can register its own buffers; resuming registers argus's buffer
    callbacks again, enables the activities and measures the clock offset anew. Kernel records stop and start;
    steps and phases never do. When CUPTI refuses argus at :meth:`start` because another tool holds it
    (``MULTIPLE_SUBSCRIBERS``), argus pauses for :attr:`PauseReason.PROFILER` and tries again every
    ``retry_s`` seconds instead of giving up for the job.
    """

    def __init__(self, job_id: str, rank: int, world_size: int, publisher: PublisherLike,
                 marks: StepMarks | None = None, *, batch_events: int = 4096, host: str | None = None,
                 buffer_bytes: int = 2 << 20, max_queued_records: int = 1_000_000, max_latency_s: float = 1.0,
                 flush_period_ms: int = 500, device_buffer_bytes: int = 2 << 20,
                 device_buffers_preallocated: int = 4, device_buffer_pool_limit: int = 8,
                 kinds: Sequence[int] = (KIND_CONCURRENT_KERNEL, KIND_MEMCPY, KIND_MEMSET),
                 env: Mapping[str, str] | None = None, retry_s: float = 30.0,
                 on_change: Callable[[], None] | None = None) -> None:
        self.job_id, self.rank, self.world_size = job_id, rank, world_size
        self.host = host if host is not None else socket.gethostname()
        self._publisher = publisher
        self.marks = marks if marks is not None else StepMarks()
        self._batch_events = batch_events
        self._buffer_bytes = buffer_bytes
        self._max_queued = max_queued_records
        self._max_latency_s = max_latency_s
        self._flush_period_ms = flush_period_ms
        self._device = (device_buffer_bytes, device_buffers_preallocated, device_buffer_pool_limit)
        self._kinds = tuple(kinds)
        self._env = env
        self._cupti: Any | None = None
        self._enabled: list[int] = []
        self._status = CuptiStatus(CuptiState.IDLE, "not started")
        self._inbox: collections.deque[Sequence[Any]] = collections.deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._names = NameTable()
        self._clock_offset_ns = 0
        self._seq = 0
        self._events = 0
        self._queued = self._buffers = self._records = self._skipped = 0
        self._dropped = self._cupti_dropped = self._batches = self._publish_dropped = self._errors = 0
        self._unreported_drops = 0
        self._final_pending: list[ActivityColumns] = []
        self._final_published = False
        self._stream_ids: dict[int, int] = {}
        self._pid = os.getpid()
        # pause/resume: why kernel records are paused now, how often they were, and the retry of a held CUPTI.
        self._ctl = threading.RLock()
        self._reasons: set[PauseReason] = set()
        self._held_elsewhere = False
        self.pauses = 0
        self._retry_s = retry_s
        self._on_change = on_change

    # -- control -----------------------------------------------------------------------------------------

    @property
    def status(self) -> CuptiStatus:
        return self._status

    @property
    def seq(self) -> int:
        """The sequence number the next batch of this rank will carry."""
        return self._seq

    @property
    def events(self) -> int:
        """Kernel events published so far (accepted by the publisher)."""
        return self._events

    def start(self) -> CuptiStatus:
        """Enable kernel tracing if this process is selected and CUPTI works; never raises."""
        if self._status.state is not CuptiState.IDLE:
            return self._status
        ok, why = cupti_enabled_for(self.rank, self.world_size, self._env)
        if not ok:
            self._status = CuptiStatus(CuptiState.DISABLED, why)
            log.info("rank %d: CUPTI kernel tracing disabled: %s", self.rank, why)
            return self._status
        cupti, why = _load_cupti()
        if cupti is None:
            self._status = CuptiStatus(CuptiState.UNAVAILABLE, why)
            log.warning("rank %d: CUPTI kernel tracing unavailable: %s", self.rank, why)
            return self._status
        self._cupti = cupti
        try:
            self._acquire(cupti)
        except Exception as exc:  # cupti.cuptiError / NotSupportedError: no driver, no GPU, or CUPTI in use
            self._disable_quietly()
            if not _held_by_another_tool(exc):
                self._status = CuptiStatus(CuptiState.UNAVAILABLE, f"CUPTI activity API refused: {exc}"
                                           f" ({type(exc).__name__})")
                log.warning("rank %d: CUPTI kernel tracing unavailable: %s", self.rank, self._status.reason)
                return self._status
            log.warning("rank %d: CUPTI is held by another tool (%s): kernel records paused, retrying every "
                        "%.0f s", self.rank, exc, self._retry_s)
            self._held_elsewhere = True
        self._thread = threading.Thread(target=self._run, name=f"argus-cupti-parser-{self.rank}", daemon=True)
        self._thread.start()
        with self._ctl:
            self._status = CuptiStatus(CuptiState.RUNNING)
            if self._held_elsewhere:
                self._reasons.add(PauseReason.PROFILER)
                self._status = self._paused_status()
                self.pauses += 1
                threading.Thread(target=self._retry, name=f"argus-cupti-retry-{self.rank}", daemon=True).start()
            elif self._reasons:  # paused (argus control) before it started
                self._release()
                self._status = self._paused_status()
        if self._status.state is CuptiState.RUNNING:
            log.info("rank %d: CUPTI kernel tracing running (kinds %s)", self.rank, self._enabled)
        self._changed()
        return self._status

    def _acquire(self, cupti: Any) -> None:
        """Take CUPTI: buffers, callbacks, activities, clock offset, periodic flush (raises what CUPTI raises)."""
        self._configure_device_buffers(cupti)
        cupti.activity_register_callbacks(self._buffer_requested, self._buffer_completed)
        for kind in self._kinds:
            cupti.activity_enable(kind)
            self._enabled.append(kind)
        self._clock_offset_ns = self._measure_clock_offset(cupti)
        if self._flush_period_ms > 0:
            cupti.activity_flush_period(self._flush_period_ms)

    def _release(self) -> None:
        """Give CUPTI up: this process's records flushed to the parser first, then the activities disabled."""
        if self._cupti is None:
            return
        try:
            self._cupti.activity_flush_all(1)
        except Exception as exc:
            log.warning("rank %d: CUPTI flush before a pause failed: %s", self.rank, exc)
        self._disable_quietly()

    def _paused_status(self) -> CuptiStatus:
        return CuptiStatus(CuptiState.PAUSED, "paused: " + ",".join(sorted(r.value for r in self._reasons)))

    @property
    def pause_reasons(self) -> tuple[PauseReason, ...]:
        """Why kernel records are paused now (empty while they flow), in the enum's order."""
        reasons = self._reasons
        return tuple(r for r in PauseReason if r in reasons)

    def pause(self, reason: PauseReason) -> None:
        """Pause kernel records for ``reason`` (more reasons may hold at once; the first releases CUPTI). Never
        raises; a reason already held changes nothing."""
        with self._ctl:
            if reason in self._reasons:
                return
            self._reasons.add(reason)
            if self._status.state is CuptiState.PAUSED:  # paused already: one more reason
                self._status = self._paused_status()
            elif self._status.state is CuptiState.RUNNING:
                self._release()
                self._status = self._paused_status()
                self.pauses += 1
                log.info("rank %d: kernel records paused (%s); steps and phases go on", self.rank, reason.value)
        self._changed()

    def resume(self, reason: PauseReason) -> None:
        """Drop ``reason``; when none is left, take CUPTI again (a refusal keeps the rank paused for PROFILER and
        retries). Never raises."""
        with self._ctl:
            if reason not in self._reasons:
                return
            self._reasons.discard(reason)
            if self._status.state is not CuptiState.PAUSED:
                return
            if self._reasons:
                self._status = self._paused_status()
            else:
                self._take_back()
        self._changed()

    def _take_back(self) -> None:
        """With ``_ctl`` held and no reason left: acquire CUPTI, or pause for PROFILER and retry later."""
        assert self._cupti is not None
        try:
            self._acquire(self._cupti)
        except Exception as exc:
            self._disable_quietly()
            self._reasons.add(PauseReason.PROFILER)
            self._status = self._paused_status()
            if not self._held_elsewhere:
                self._held_elsewhere = True
                log.warning("rank %d: CUPTI refused argus on resume (%s): retrying every %.0f s", self.rank, exc,
                            self._retry_s)
                threading.Thread(target=self._retry, name=f"argus-cupti-retry-{self.rank}", daemon=True).start()
            return
        self._held_elsewhere = False
        self._status = CuptiStatus(CuptiState.RUNNING)
        log.info("rank %d: kernel records resumed", self.rank)

    def _retry(self) -> None:
        """While another tool holds CUPTI: try again every ``retry_s`` until it is free or argus stops."""
        while not self._stop.wait(self._retry_s):
            with self._ctl:
                if not self._held_elsewhere or self._status.state is not CuptiState.PAUSED:
                    return
                if self._reasons - {PauseReason.PROFILER}:
                    continue  # paused for another reason as well: the resume of that one tries
                self._reasons.discard(PauseReason.PROFILER)
                self._take_back()
                if self._held_elsewhere:
                    continue
            self._changed()
            return

    def _changed(self) -> None:
        if self._on_change is not None:
            try:
                self._on_change()
            except Exception as exc:  # the heartbeat's bookkeeping must not break tracing
                log.debug("CUPTI on_change failed: %s", exc)

    def stop(self, timeout_s: float = 10.0) -> CuptiStatus:
        """Flush CUPTI, disable the activities, drain the parser and publish the final ``end_of_stream`` batch
        (an empty one when nothing was traced). Idempotent; never raises."""
        if self._status.state is CuptiState.STOPPED:
            return self._status
        with self._ctl:
            running = self._status.state in (CuptiState.RUNNING, CuptiState.PAUSED)
            enabled = self._status.state is CuptiState.RUNNING
            self._status = CuptiStatus(CuptiState.STOPPED, "stopping") if running else self._status
        if enabled and self._cupti is not None:
            try:
                self._cupti.activity_flush_all(1)
            except Exception as exc:
                log.warning("rank %d: CUPTI flush failed: %s", self.rank, exc)
            self._disable_quietly()
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("rank %d: CUPTI parser thread did not finish within %.1f s", self.rank, timeout_s)
        self._publish_final()
        if running:
            self._status = CuptiStatus(CuptiState.STOPPED, "stopped")
        return self._status

    def tune(self, *, batch_events: int | None = None, max_latency_s: float | None = None) -> None:
        """Change the batching of later batches at run time (``argus control set``): events per batch, and the
        longest a partial batch waits (seconds)."""
        if batch_events is not None:
            self._batch_events = batch_events
        if max_latency_s is not None:
            self._max_latency_s = max_latency_s

    def stats(self) -> CuptiStats:
        with self._lock:
            return CuptiStats(buffers=self._buffers, records=self._records, events=self._events,
                              skipped_records=self._skipped, dropped_records=self._dropped,
                              cupti_dropped_records=self._cupti_dropped, batches=self._batches,
                              publish_dropped=self._publish_dropped, parse_errors=self._errors)

    def stream_id(self, cuda_stream: int) -> int | None:
        """CUPTI's id of a ``cudaStream_t`` (``torch.cuda.Stream.cuda_stream``), as in kernel records, or
        None when CUPTI is not running. Cached per stream."""
        if self._status.state is not CuptiState.RUNNING or self._cupti is None:
            return None
        sid = self._stream_ids.get(cuda_stream)
        if sid is None:
            try:
                sid = int(self._cupti.get_stream_id_ex(0, cuda_stream, 0))
            except Exception:
                return None
            self._stream_ids[cuda_stream] = sid
        return sid

    def _configure_device_buffers(self, cupti: Any) -> None:
        size, prealloc, limit = self._device
        attrs = cupti.ActivityAttribute
        for name, value in (("DEVICE_BUFFER_SIZE", size), ("DEVICE_BUFFER_PRE_ALLOCATE_VALUE", prealloc),
                            ("DEVICE_BUFFER_POOL_LIMIT", limit)):
            attr = getattr(attrs, "ATTR_" + name, None)
            if attr is None:
                continue
            v = ctypes.c_size_t(value)
            try:
                cupti.activity_set_attribute(attr, ctypes.sizeof(v), ctypes.addressof(v))
            except Exception as exc:  # older CUPTI, or no driver: the enable below reports the real problem
                log.debug("CUPTI attribute %s not set: %s", name, exc)

    @staticmethod
    def _measure_clock_offset(cupti: Any) -> int:
        best: tuple[int, int] | None = None
        for _ in range(5):
            t0 = time.time_ns()
            c = int(cupti.get_timestamp())
            t1 = time.time_ns()
            if best is None or t1 - t0 < best[0]:
                best = (t1 - t0, (t0 + t1) // 2 - c)
        return best[1] if best else 0

    def _disable_quietly(self) -> None:
        if self._cupti is None:
            return
        for kind in reversed(self._enabled):
            try:
                self._cupti.activity_disable(kind)
            except Exception as exc:
                log.debug("CUPTI disable %s failed: %s", kind, exc)
        self._enabled.clear()

    # -- enqueue path (CUPTI's thread) -------------------------------------------------------------------

    def _buffer_requested(self) -> tuple[int, int]:
        return self._buffer_bytes, 0

    def _buffer_completed(self, activities: Sequence[Any]) -> None:
        n = len(activities)
        with self._lock:
            self._buffers += 1
            if self._queued + n > self._max_queued or self._stop.is_set():
                self._dropped += n
                self._unreported_drops += n
                return
            self._queued += n
        self._inbox.append(activities)
        self._wake.set()

    # -- parse/export path (parser thread) ---------------------------------------------------------------

    def _run(self) -> None:
        pending: list[ActivityColumns] = []
        pending_n = 0
        oldest = 0.0
        while True:
            try:
                acts = self._inbox.popleft()
            except IndexError:
                if self._stop.is_set():
                    break
                if pending_n and time.monotonic() - oldest >= self._max_latency_s:
                    self._emit(pending, final=True)
                    pending, pending_n = [], 0
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            with self._lock:
                self._queued -= len(acts)
                self._records += len(acts)
            try:
                cols = extract_columns(acts, self._names, self._clock_offset_ns)
            except Exception:
                with self._lock:
                    self._errors += 1
                log.exception("rank %d: CUPTI buffer of %d records not parsed", self.rank, len(acts))
                continue
            with self._lock:
                self._skipped += cols.skipped
            if not len(cols):
                continue
            if not pending_n:
                oldest = time.monotonic()
            pending.append(cols)
            pending_n += len(cols)
            if pending_n >= self._batch_events:
                rest = self._emit(pending, final=False)
                pending, pending_n = ([rest], len(rest)) if len(rest) else ([], 0)
                oldest = time.monotonic()
        self._final_pending = pending

    def _emit(self, pending: list[ActivityColumns], *, final: bool, end_of_stream: bool = False) -> ActivityColumns:
        cols = ActivityColumns.concat(pending)
        with self._lock:
            dropped, self._unreported_drops = self._unreported_drops, 0
        try:
            batches, rest = columns_to_batches(cols, self._names, job_id=self.job_id, rank=self.rank,
                                               host=self.host, first_seq=self._seq,
                                               batch_events=self._batch_events, marks=self.marks.snapshot(),
                                               final=final, dropped=dropped)
        except Exception:
            with self._lock:
                self._errors += 1
            log.exception("rank %d: %d kernel events not batched", self.rank, len(cols))
            return ActivityColumns.empty()
        if end_of_stream:
            if batches:
                batches[-1] = dataclasses.replace(batches[-1], end_of_stream=True)
            else:
                batches = [KernelBatch.empty(self.job_id, self.rank, self._seq, end_of_stream=True, host=self.host)]
        for b in batches:
            self._seq += 1
            ok = self._publisher.publish(Topic.KERNELS, rank_key(self.job_id, self.rank), b)
            with self._lock:
                self._batches += 1
                if ok:
                    self._events += len(b)
                else:
                    self._publish_dropped += 1
        return rest

    def _publish_final(self) -> None:
        if self._pid != os.getpid() or self._final_published:  # a forked child must not end the parent's stream
            return
        self._final_published = True
        pending = list(self._final_pending)
        while self._inbox:  # the parser did not get to these (timeout): parse them here
            acts = self._inbox.popleft()
            try:
                pending.append(extract_columns(acts, self._names, self._clock_offset_ns))
            except Exception:
                self._errors += 1
        self._final_pending = []
        self._emit(pending, final=True, end_of_stream=True)
