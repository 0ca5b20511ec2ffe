"""The Faust application of argus and its compression agent.

The agent only decodes, calls the pure core (:mod:`argus.streams.windows`, :mod:`argus.streams.compression`) and
emits. At-least-once: the kernel topic is consumed without automatic acks; a message is acked (its offset
becomes committable) only after every window holding one of its events was summarized and the summaries
were delivered to Kafka. Undecodable messages and events too far ahead of their rank's watermark
(``Settings.max_event_skew_ns``) go to the dead-letter topic, with the reason, before their message is acked.
Events for a window already summarized (after a broker outage, a restart, or a rank's end) are summarized as
a further *piece* of that window, identified by their message's offset, and merged downstream; a window
re-summarized from a replay is the same piece as before (see :mod:`argus.streams.windows`), so it replaces its
stored copy rather than adding to it. A message whose processing raises anything is dead-lettered whole
(stage ``compress``, the exception as reason), its events are taken out of the open windows and it is
acked, so the partition goes on; a window that cannot be summarized is dead-lettered with its events. A dead
letter that cannot be delivered stops the agent without acking (:class:`~argus.core.errors.DeadLetterError`).
A job that never ends is closed by its ABANDONED lifecycle record (written by the diagnosis agents after
``Settings.job_idle_timeout_s``) exactly as by its END: its open windows are summarized and its messages acked.
A job that publishes only kernels never reaches the diagnosis agents; so when a job's windows stay open here
with no kernel batch and no END or ABANDONED for twice that timeout (the worker's clock, counting a blocked
event loop as one tick), the compressor writes its ABANDONED itself (reason ``kernels only: ...``, last step
from its kernels). A job the diagnosis agents hold was abandoned by them long before.
Summaries are sent without waiting for the broker: the windows' messages are acked by a task once their
summaries are delivered (at most :data:`MAX_DELIVERIES_IN_FLIGHT` such tasks), so the agent reads on instead
of idling a round trip per closed window; a job-end marker waits for every summary sent before it.
Run it with ``argus worker``. Its web server (``metrics_host:worker_web_port``) answers ``/health``, ``/stats``
(the counters as JSON) and ``/metrics`` (the same counters for Prometheus, read at scrape time: see
:mod:`argus.streams.metrics`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections.abc import AsyncIterable
from dataclasses import dataclass, field
from typing import Any

import faust
from faust.types import EventT

from argus.core.errors import DeadLetterError, SchemaError
from argus.core.kafka_security import faust_credentials
from argus.core.settings import Settings
from argus.detectors.kde_clusters import KdeParams
from argus.metrics import CONTENT_TYPE, exposition
from argus.schemas.records import JobLifecycle, KernelBatch, KernelSummary, LifecycleEvent
from argus.streams.compression import summarize_isolated
from argus.streams.diagnosis_agents import DeadLetters, failure_reason, install_diagnosis, summary_end_marker
from argus.streams.idle import IdleJobs, QuietClock
from argus.streams.metrics import WorkerCollector, worker_registry
from argus.streams.windows import ClosedWindow, WindowBuffer
from argus.topics import Topic, job_key, kernel_key

__all__ = ["CompressionStats", "create_app"]

log = logging.getLogger(__name__)
#: Closed windows whose summaries are on their way to the broker at once (their messages not acked yet).
MAX_DELIVERIES_IN_FLIGHT = 256


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


def create_app(settings: Settings) -> faust.App:
    """A Faust app wired to ``settings``: the kernel topic in, summaries and dead letters out."""
    brokers = ";".join(f"kafka://{b}" for b in settings.bootstrap_servers.split(","))
    datadir = settings.home / "faust" / f"{settings.app_id}-data"
    # Faust creates only the last folder of its datadir.
    datadir.parent.mkdir(parents=True, exist_ok=True)
    app = faust.App(
        settings.app_id,
        broker=brokers,
        broker_credentials=faust_credentials(settings),  # TLS/SASL as every other client (argus.core.kafka_security)
        store="memory://",
        # Faust writes a data folder even with the memory store; keep it with argus's own state.
        datadir=str(datadir),
        key_serializer="raw",
        value_serializer="raw",
        topic_partitions=settings.partitions,
        topic_allow_declare=False,
        web_host=settings.metrics_host,  # the web server's /health, /stats and /metrics (loopback by default)
        web_port=settings.worker_web_port,
        web_in_thread=False,
        broker_session_timeout=settings.session_timeout_s,
        broker_heartbeat_interval=max(0.5, settings.session_timeout_s / 6),
        broker_commit_interval=0.5,
        consumer_auto_offset_reset="earliest",
        # Held (un-acked) messages are re-delivered after a restart: shutdown must not wait for them.
        stream_wait_empty=False,
        producer_compression_type=None if settings.compression == "none" else settings.compression,
        producer_max_request_size=8_000_000,
        # Summaries come in bursts (every window of a rank closes at once): a few ms of linger sends a burst
        # in one request instead of one request (and socket write) per summary.
        producer_linger=0.005,
        producer_max_batch_size=1_000_000,
        consumer_max_fetch_size=8_000_000,
        # Messages read ahead per stream before the agent takes them: Faust's default (4,096) lets one burst of
        # kernel batches (tens of KB each) fill ~100 MB, which the allocator then keeps (the soak's RSS step).
        stream_buffer_maxsize=256,
    )
    kernels = app.topic(Topic.KERNELS.full(settings), key_type=bytes, value_type=bytes)
    lifecycle = app.topic(Topic.LIFECYCLE.full(settings), key_type=bytes, value_type=bytes)
    summaries = app.topic(Topic.SUMMARIES.full(settings), key_type=bytes, value_type=bytes)
    buffer = WindowBuffer(settings.window_ns, settings.allowed_lateness_ns, max_skew_ns=settings.max_event_skew_ns,
                          max_names=settings.max_kernel_names, late_pieces=True)
    params = KdeParams(grid_points=settings.kde_grid_points, min_samples=settings.kde_min_samples,
                       min_log_gap=settings.kde_min_log_gap)
    stats = CompressionStats()
    pending: dict[int, EventT] = {}
    tokens = itertools.count()
    deliveries: set[asyncio.Future[None]] = set()  # summaries sent, their windows' messages not acked yet
    delivery_failures: list[BaseException] = []
    # Which partition each (job, rank) arrives on, so a job-end marker closes only that partition's ranks.
    partition_of: dict[tuple[str, int], int] = {}
    # Kernel-only jobs that never end: worker-clock time of each job's last batch, and its last step seen.
    idle_tick_s = min(max(settings.job_idle_timeout_s / 4, 0.05), 10.0)
    quiet = QuietClock(idle_tick_s, time.monotonic())
    arrivals = IdleJobs()
    last_seen: dict[str, tuple[int, int]] = {}  # job -> (last step, end of its last event in ns)

    dead = DeadLetters(app.topic(Topic.DEAD_LETTER.full(settings), key_type=bytes, value_type=bytes))

    async def dead_letter(event: EventT, reason: str, payload: bytes | None = None, job: str = "",
                          rank: int | None = None) -> None:
        await dead.send(event, "compress", reason, payload=payload, job=job, rank=rank)
        stats.dead_letters += 1

    async def emit(closed: list[ClosedWindow], event: EventT) -> list[int]:
        if not closed:
            return []
        out, failed = summarize_isolated(closed, params)
        for w, exc in failed:
            offsets = sorted(pending[t].message.offset for t in w.tokens if t in pending)
            stats.failed_windows += 1
            await dead_letter(event, f"window [{w.start_ns}, {w.end_ns}) of {w.job_id}/{w.rank} (messages at "
                                     f"offsets {offsets}) cannot be summarized: {failure_reason(exc)}",
                              payload=w.as_batch().encode(), job=w.job_id, rank=w.rank)
        futs = []
        for s in out:
            payload = s.encode()
            stats.summary_bytes_out += len(payload)
            futs.append((s, payload, await summaries.send(key=kernel_key(s.job_id, s.kernel, s.stream),
                                                          value=payload, force=True)))
        stats.summaries_out += len(out)
        stats.windows_closed += len(closed)
        # The windows' messages are acked once their summaries are delivered; waiting for the broker here
        # would idle the agent for a round trip per closed window, so a task waits while the next messages
        # are read (bounded: at most MAX_DELIVERIES_IN_FLIGHT).
        while len(deliveries) >= MAX_DELIVERIES_IN_FLIGHT:
            await asyncio.wait(deliveries, return_when=asyncio.FIRST_COMPLETED)
        task = asyncio.ensure_future(deliver(closed, futs, event))
        deliveries.add(task)
        task.add_done_callback(delivered)
        return []

    async def deliver(closed: list[ClosedWindow], futs: list[tuple[KernelSummary, bytes, Any]],
                      event: EventT) -> None:
        for s, payload, fut in futs:
            try:
                await fut
            except Exception as exc:  # e.g. refused by the broker: kept as a dead letter, never dropped
                await dead_letter(event, f"summary of {s.job_id}/{s.kernel}/{s.stream} not delivered: "
                                         f"{failure_reason(exc)}", payload=payload, job=s.job_id)
        free: list[int] = []
        for w in closed:
            stats.events_summarized += len(w)
            if w.late:
                stats.late_events += len(w)
            if w.folded_events:
                stats.folded_events += w.folded_events
                log.warning("%s/%s window [%d, %d): more than %d kernel names, %d events summarized as "
                            "'[other kernels]'", w.job_id, w.rank, w.start_ns, w.end_ns, settings.max_kernel_names,
                            w.folded_events)
            free.extend(buffer.release(w))
        ack(free)

    def delivered(task: asyncio.Future[None]) -> None:
        deliveries.discard(task)
        if not task.cancelled() and task.exception() is not None:
            delivery_failures.append(task.exception())  # type: ignore[arg-type]

    async def all_delivered() -> None:
        """Wait for every summary sent so far (e.g. before a job-end marker, which must follow them)."""
        while deliveries:
            await asyncio.wait(set(deliveries))
        if delivery_failures:
            raise delivery_failures[0]

    def ack(free: list[int]) -> None:
        for token in free:
            event = pending.pop(token, None)
            if event is not None:
                event.ack()

    async def end_job(batch: KernelBatch, event: EventT) -> list[int]:
        part = event.message.partition
        ranks = {r for (j, r), p in partition_of.items() if j == batch.job_id and p == part}
        for r in ranks:
            del partition_of[(batch.job_id, r)]
        # A rank with windows here but no partition (its partition's marker came first, or its end batch was
        # taken as a copy) is closed too: no window may stay open, and its messages un-acked, for good.
        ranks |= {r for r in buffer.ranks_of(batch.job_id) if (batch.job_id, r) not in partition_of}
        free = await emit(buffer.flush_job(batch.job_id, ranks), event)
        await all_delivered()
        # Tell every summaries partition that this kernel partition has finished the job (for L3).
        marker = summary_end_marker(batch.job_id, part).encode()
        futs = [await summaries.send(key=job_key(batch.job_id), value=marker, partition=q, force=True)
                for q in range(settings.partitions)]
        for fut in futs:
            await fut
        return free

    async def take(batch: KernelBatch, event: EventT, token: int) -> list[int]:
        """Process one decoded batch; returns the tokens now safe to ack."""
        if batch.is_job_end:
            return [token, *await end_job(batch, event)]
        stats.batches += 1
        stats.events_in += len(batch)
        arrivals.touch(batch.job_id, quiet.read(time.monotonic()))
        if len(batch):
            step, end_ns = last_seen.get(batch.job_id, (-1, 0))
            last_seen[batch.job_id] = (max(step, int(batch.step.max())),
                                       max(end_ns, int((batch.start_ns + batch.duration_ns).max())))
        if batch.end_of_stream:
            partition_of.pop((batch.job_id, batch.rank), None)
        else:
            partition_of[(batch.job_id, batch.rank)] = event.message.partition
        update = buffer.add(batch, token, position=event.message.offset, now_ns=time.time_ns())
        if update.duplicate:
            stats.duplicate_batches += 1
        where = f"{batch.job_id}/{batch.rank}"
        if update.skewed is not None:
            stats.skewed_events += len(update.skewed)
            await dead_letter(event, f"skew: {len(update.skewed)} events of {where} start more than "
                                     f"{settings.max_event_skew_ns} ns after the rank's watermark (first at "
                                     f"{int(update.skewed.start_ns.min())} ns)",
                              payload=update.skewed.encode(), job=batch.job_id, rank=batch.rank)
        if update.late is not None:  # not with late_pieces; kept for a buffer that returns late events
            stats.late_events += len(update.late)
            await dead_letter(event, f"late: {len(update.late)} events of {where} for windows already closed",
                              payload=update.late.encode(), job=batch.job_id, rank=batch.rank)
        return update.free_tokens + await emit(update.closed, event)

    @app.agent(kernels, name="argus.compress")
    async def compress(stream: Any) -> AsyncIterable[None]:
        async for event in stream.noack().events():
            t0 = time.perf_counter()
            token = next(tokens)
            pending[token] = event
            batch: KernelBatch | None = None
            try:
                batch = KernelBatch.decode(event.value)
                free = await take(batch, event, token)
            except DeadLetterError:
                raise
            except Exception as exc:  # one message never stops the partition: dead-letter it whole, go on
                if not isinstance(exc, SchemaError):
                    stats.failed_messages += 1
                    log.error("kernel batch at %s[%d]@%d failed: %s", event.message.topic,
                              event.message.partition, event.message.offset, failure_reason(exc))
                buffer.discard(token)
                await dead_letter(event, failure_reason(exc), job=batch.job_id if batch else "",
                                  rank=batch.rank if batch else None)
                free = [token]
            ack(free)
            if delivery_failures:  # a summary's dead letter was not delivered: stop without acking
                raise delivery_failures[0]
            stats.busy_s += time.perf_counter() - t0
            yield None

    @app.agent(lifecycle, name="argus.job-end")
    async def job_end(stream: faust.StreamT[bytes]) -> AsyncIterable[None]:
        async for value in stream:
            try:
                rec = JobLifecycle.decode(value)
            except SchemaError as exc:
                log.warning("undecodable lifecycle record ignored by the compressor (the sink dead-letters "
                            "it): %s", exc)
                continue
            if rec.event in (LifecycleEvent.END, LifecycleEvent.ABANDONED):
                arrivals.forget(rec.job_id)
                last_seen.pop(rec.job_id, None)
                # An ABANDONED job (idle past job_idle_timeout_s, see argus.streams.diagnosis_agents) is closed
                # like an ended one: its open windows are summarized and its held messages acked.
                # The END can overtake kernel batches still queued in other partitions, so it is not
                # applied here: a marker appended to every kernel partition closes the job's windows
                # there once everything produced before the END has been read.
                marker = KernelBatch.job_end_marker(rec.job_id).encode()
                futs = [await kernels.send(key=job_key(rec.job_id), value=marker, partition=p, force=True)
                        for p in range(settings.partitions)]
                for fut in futs:
                    await fut
            yield None

    @app.timer(interval=idle_tick_s, name="argus.idle-kernel-jobs")
    async def abandon_kernel_only_jobs() -> None:
        now = quiet.read(time.monotonic())
        timeout_s = 2 * settings.job_idle_timeout_s
        idle = arrivals.idle(now, timeout_s)
        if not idle:
            return
        open_jobs = buffer.open_jobs()
        for job_id in idle:
            age = arrivals.age(job_id, now)
            arrivals.forget(job_id)
            step, end_ns = last_seen.pop(job_id, (-1, 0))
            if job_id not in open_jobs:
                continue  # nothing held here
            world = 1 + max((r for j, r in partition_of if j == job_id), default=0)
            rec = JobLifecycle(job_id, LifecycleEvent.ABANDONED, end_ns, world, source="streams",
                               reason=f"kernels only: no kernel batch for {age or 0.0:.1f} s (twice job_idle_timeout_s "
                                      f"= {settings.job_idle_timeout_s:g})", last_step=step)
            fut = await lifecycle.send(key=job_key(job_id), value=rec.encode(), force=True)
            await fut
            stats.jobs_abandoned += 1
            log.warning("job %s: ABANDONED written by the compressor (kernels only, idle %.1f s, last step %d)",
                        job_id, age or 0.0, step)

    @app.on_partitions_revoked.connect  # type: ignore[arg-type]
    async def on_revoked(sender: Any, *args: Any, **kwargs: Any) -> None:
        # Un-acked messages are re-delivered from the committed offsets after the rebalance.
        buffer.clear()
        pending.clear()
        partition_of.clear()
        arrivals.clear()
        last_seen.clear()

    diagnosis = install_diagnosis(app, settings, dead=dead)

    @app.page("/health")
    async def health(web: Any, request: Any) -> Any:
        return web.json({"ok": True, "app": settings.app_id})

    @app.page("/stats")
    async def stats_page(web: Any, request: Any) -> Any:
        return web.json({**stats.as_dict(), "open_windows": buffer.open_windows, "pending_messages": len(pending),
                         "assigned_partitions": len(app.consumer.assignment()),
                         "diagnosis": dataclasses.asdict(diagnosis)})

    # Read at scrape time only: the agents keep their counters as before, a scrape adds nothing per event.
    registry = worker_registry(WorkerCollector(stats, diagnosis, open_windows=lambda: buffer.open_windows,
                                               pending_messages=lambda: len(pending), consumer=lambda: app.consumer,
                                               topics={t.full(settings) for t in Topic}))

    @app.page("/metrics")
    async def metrics_page(web: Any, request: Any) -> Any:
        return web.bytes(exposition(registry), headers={"Content-Type": CONTENT_TYPE})

    app.argus_stats = stats  # type: ignore[attr-defined]
    app.argus_metrics = registry  # type: ignore[attr-defined]
    return app
