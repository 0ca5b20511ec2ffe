"""The Faust application of argus and its compression agent.

The agent only decodes, calls the pure core (:mod:`streams.windows`, :mod:`streams.compression`) and
emits. At-least-once: the kernel topic is consumed without automatic acks; a message is acked (its offset
becomes committable) only after every window holding one of its events was summarized and the summaries
were delivered to Kafka. Undecodable messages and late events go to the dead-letter topic, with the reason,
before their message is acked. Run it with ``argus worker``.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import AsyncIterable
from dataclasses import dataclass, field
from typing import Any

import faust
from faust.types import EventT

from argus.errors import SchemaError
from argus.settings import Settings
from argus.topics import Topic, job_key, kernel_key
from detectors.kde_clusters import KdeParams
from schemas.records import DeadLetter, JobLifecycle, KernelBatch, LifecycleEvent
from streams.compression import summarize_windows
from streams.diagnosis_agents import install_diagnosis, summary_end_marker
from streams.windows import ClosedWindow, WindowBuffer

__all__ = ["CompressionStats", "create_app"]

log = logging.getLogger(__name__)


@dataclass
class CompressionStats:
    """Counters of the compression agent (events are kernel events, not Kafka messages)."""

    batches: int = 0
    events_in: int = 0
    events_summarized: int = 0
    windows_closed: int = 0
    summaries_out: int = 0
    summary_bytes_out: int = 0
    late_events: int = 0
    dead_letters: int = 0
    busy_s: float = 0.0
    by_job: dict[str, dict[str, int]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "by_job"}
        d["events_per_busy_s"] = round(self.events_in / self.busy_s) if self.busy_s else None
        return d


def create_app(settings: Settings) -> faust.App:
    """A Faust app wired to ``settings``: the kernel topic in, summaries and dead letters out."""
    brokers = ";".join(f"kafka://{b}" for b in settings.bootstrap_servers.split(","))
    app = faust.App(
        settings.app_id,
        broker=brokers,
        store="memory://",
        key_serializer="raw",
        value_serializer="raw",
        topic_partitions=settings.partitions,
        topic_allow_declare=False,
        web_host="127.0.0.1",
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
        consumer_max_fetch_size=8_000_000,
    )
    kernels = app.topic(Topic.KERNELS.full(settings), key_type=bytes, value_type=bytes)
    lifecycle = app.topic(Topic.LIFECYCLE.full(settings), key_type=bytes, value_type=bytes)
    summaries = app.topic(Topic.SUMMARIES.full(settings), key_type=bytes, value_type=bytes)
    dead = app.topic(Topic.DEAD_LETTER.full(settings), key_type=bytes, value_type=bytes)
    buffer = WindowBuffer(settings.window_ns, settings.allowed_lateness_ns)
    params = KdeParams(grid_points=settings.kde_grid_points, min_samples=settings.kde_min_samples,
                       min_log_gap=settings.kde_min_log_gap)
    stats = CompressionStats()
    pending: dict[int, EventT] = {}
    tokens = itertools.count()
    # Which partition each (job, rank) arrives on, so a job-end marker closes only that partition's ranks.
    partition_of: dict[tuple[str, int], int] = {}

    async def dead_letter(event: EventT, reason: str, payload: bytes | None = None) -> None:
        msg = event.message
        log.warning("dead-letter %s[%d]@%d: %s", msg.topic, msg.partition, msg.offset, reason)
        record = DeadLetter(topic=msg.topic, partition=msg.partition, offset=msg.offset,
                            payload=event.value if payload is None else payload, reason=reason,
                            stage="compress", time_ns=time.time_ns(), key=msg.key)
        fut = await dead.send(key=msg.key, value=record.encode(), force=True)
        await fut
        stats.dead_letters += 1

    async def emit(closed: list[ClosedWindow]) -> list[int]:
        if not closed:
            return []
        out = summarize_windows(closed, params)
        futs = []
        for s in out:
            payload = s.encode()
            stats.summary_bytes_out += len(payload)
            futs.append(await summaries.send(key=kernel_key(s.job_id, s.kernel, s.stream), value=payload,
                                             force=True))
        for fut in futs:
            await fut
        stats.summaries_out += len(out)
        stats.windows_closed += len(closed)
        free: list[int] = []
        for w in closed:
            stats.events_summarized += len(w)
            free.extend(buffer.release(w))
        return free

    def ack(free: list[int]) -> None:
        for token in free:
            event = pending.pop(token, None)
            if event is not None:
                event.ack()

    @app.agent(kernels, name="argus.compress")
    async def compress(stream: Any) -> AsyncIterable[None]:
        async for event in stream.noack().events():
            t0 = time.perf_counter()
            token = next(tokens)
            pending[token] = event
            try:
                batch = KernelBatch.decode(event.value)
            except SchemaError as exc:
                await dead_letter(event, str(exc))
                ack([token])
                continue
            if batch.is_job_end:
                part = event.message.partition
                ranks = {r for (j, r), p in partition_of.items() if j == batch.job_id and p == part}
                for r in ranks:
                    del partition_of[(batch.job_id, r)]
                free = await emit(buffer.flush_job(batch.job_id, ranks))
                # Tell every summaries partition that this kernel partition has finished the job (for L3).
                marker = summary_end_marker(batch.job_id, part).encode()
                futs = [await summaries.send(key=job_key(batch.job_id), value=marker, partition=q, force=True)
                        for q in range(settings.partitions)]
                for fut in futs:
                    await fut
                ack([token, *free])
                continue
            stats.batches += 1
            stats.events_in += len(batch)
            if batch.end_of_stream:
                partition_of.pop((batch.job_id, batch.rank), None)
            else:
                partition_of[(batch.job_id, batch.rank)] = event.message.partition
            update = buffer.add(batch, token)
            if update.late is not None:
                stats.late_events += len(update.late)
                await dead_letter(event, f"late: {len(update.late)} events of {batch.job_id}/{batch.rank} "
                                         f"for windows already closed", payload=update.late.encode())
            ack(update.free_tokens + await emit(update.closed))
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
            if rec.event is LifecycleEvent.END:
                # The END can overtake kernel batches still queued in other partitions, so it is not
                # applied here: a marker appended to every kernel partition closes the job's windows
                # there once everything produced before the END has been read.
                marker = KernelBatch.job_end_marker(rec.job_id).encode()
                futs = [await kernels.send(key=job_key(rec.job_id), value=marker, partition=p, force=True)
                        for p in range(settings.partitions)]
                for fut in futs:
                    await fut
            yield None

    @app.on_partitions_revoked.connect  # type: ignore[arg-type]
    async def on_revoked(sender: Any, *args: Any, **kwargs: Any) -> None:
        # Un-acked messages are re-delivered from the committed offsets after the rebalance.
        buffer.clear()
        pending.clear()
        partition_of.clear()

    diagnosis = install_diagnosis(app, settings)

    @app.page("/health")
    async def health(web: Any, request: Any) -> Any:
        return web.json({"ok": True, "app": settings.app_id})

    @app.page("/stats")
    async def stats_page(web: Any, request: Any) -> Any:
        return web.json({**stats.as_dict(), "open_windows": buffer.open_windows, "pending_messages": len(pending),
                         "diagnosis": dataclasses.asdict(diagnosis)})

    app.argus_stats = stats  # type: ignore[attr-defined]
    return app
