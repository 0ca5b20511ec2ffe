"""The Faust application of argus and its compression agent's shell.

The compression agent decodes kernel batches, hands each to its
:class:`~argus.streams.compression_router.CompressionRouter` (the windows, the at-least-once rules: when a
message may be acked, what is dead-lettered, when a job-end marker is passed on, what a rebalance forgets), and
carries out what the router answers: dead letters, summaries, end markers, acks. The kernel topic is consumed
without automatic acks. A dead letter that cannot be delivered stops the agent without acking
(:class:`~argus.core.errors.DeadLetterError`). A job that never ends is closed by its ABANDONED lifecycle record
(written by the diagnosis agents after ``Settings.job_idle_timeout_s``, or by the router for a job of kernels
only after twice that) exactly as by its END.
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
import functools
import logging
import time
from collections.abc import AsyncIterable, Mapping
from typing import Any

import faust
from aiokafka.partitioner import DefaultPartitioner, murmur2
from faust.transport.drivers import aiokafka as faust_aiokafka
from faust.types import EventT

from argus.core.errors import SchemaError, failure_reason
from argus.core.kafka_security import aiokafka_durable_config, faust_credentials
from argus.core.settings import Settings
from argus.metrics import CONTENT_TYPE, exposition
from argus.schemas.records import JobLifecycle, KernelBatch, KernelSummary
from argus.streams.compression_router import (
    CompressionRouter,
    CompressionStats,
    DeadLetter,
    Emission,
    Routed,
    Staging,
)
from argus.streams.dead_letters import DeadLetters
from argus.streams.diagnosis_agents import install_diagnosis
from argus.streams.metrics import WorkerCollector, worker_registry
from argus.streams.summary_pieces import summary_end_marker
from argus.topics import Topic, job_key, kernel_key

__all__ = ["CompressionStats", "create_app"]

log = logging.getLogger(__name__)
#: Closed windows whose summaries are on their way to the broker at once (their messages not acked yet).
MAX_DELIVERIES_IN_FLIGHT = 256
#: Closed windows summarized together (see :class:`Staging`): each kernel message closes its rank's windows;
#: 512 such windows, or those that waited 0.25 s, make one summary per (job, kernel, stream) instead of one per
#: message, kernel and stream (L3 read 14,352 messages for a 1,024-rank job of 20 steps, docs/scaling.md).
#: Off (1: each message's windows at once) until L3 publishes a finding's final judgement rather than its
#: first: summaries grouped by timing change which window first shows a finding, and a replay then differs from
#: the live run in its evidence (tests/integration/test_replay.py). 512 windows / 0.25 s is the measured setting.
STAGING = Staging(windows=1, max_age_s=0.25)


class KeyHashPartitioner:
    """aiokafka's default partitioner (murmur2 of the key, as the Java client and librdkafka's
    ``murmur2_random``) with each key's hash remembered. aiokafka hashes in pure Python, ~40 us a key, on
    every summary sent; a worker sends few distinct keys (one per job, kernel and stream) over and over."""

    def __init__(self, max_keys: int = 1 << 16) -> None:
        self._default = DefaultPartitioner()
        self._hash = functools.lru_cache(maxsize=max_keys)(murmur2)

    def __call__(self, key: bytes | None, all_partitions: list[int], available: list[int]) -> int:
        if key is None:
            return int(self._default(key, all_partitions, available))
        return all_partitions[(self._hash(key) & 0x7FFFFFFF) % len(all_partitions)]


class DurableProducer(faust_aiokafka.Producer):
    """Faust's aiokafka producer with ``acks=all`` and idempotence (:data:`argus.core.kafka_security.DURABLE_PRODUCER`),
    as every argus producer. Faust turns idempotence on only inside its transactions (``_settings_extra``),
    and its ``producer_*`` settings have no idempotence, so this producer adds it to every producer it makes."""

    def _settings_extra(self) -> Mapping[str, Any]:
        return {**super()._settings_extra(), **aiokafka_durable_config()}


class DurableTransport(faust_aiokafka.Transport):
    """Faust's aiokafka transport making :class:`DurableProducer` producers."""

    Producer = DurableProducer


def create_app(settings: Settings) -> faust.App:
    """A Faust app wired to ``settings``: the kernel topic in, summaries and dead letters out."""
    brokers = ";".join(f"kafka://{b}" for b in settings.bootstrap_servers.split(","))
    datadir = settings.home / "faust" / f"{settings.app_id}-data"
    # Faust creates only the last folder of its datadir.
    datadir.parent.mkdir(parents=True, exist_ok=True)
    app = faust.App(
        settings.app_id,
        broker=brokers,
        broker_credentials=faust_credentials(settings.kafka),  # TLS/SASL as every other client
        store="memory://",
        # Faust writes a data folder even with the memory store; keep it with argus's own state.
        datadir=str(datadir),
        key_serializer="raw",
        value_serializer="raw",
        topic_partitions=settings.partitions,
        topic_allow_declare=False,
        # The web server's /health, /stats and /metrics (loopback by default): web_bind is the address it binds,
        # web_host only the host name Faust writes into its URLs.
        web_bind=settings.metrics_host,
        web_host=settings.metrics_host,
        web_port=settings.worker_web_port,
        web_in_thread=False,
        broker_session_timeout=settings.session_timeout_s,
        broker_heartbeat_interval=max(0.5, settings.session_timeout_s / 6),
        broker_commit_interval=0.5,
        consumer_auto_offset_reset="earliest",
        # Held (un-acked) messages are re-delivered after a restart: shutdown must not wait for them.
        stream_wait_empty=False,
        producer_acks=-1,  # all (and idempotence: the DurableTransport below)
        # Faust's own topics (none with the memory store; its leader topic is made by ensure_topics) as argus's.
        topic_replication_factor=settings.replication_factor,
        producer_compression_type=None if settings.compression == "none" else settings.compression,
        producer_max_request_size=8_000_000,
        # Summaries come in bursts (every window of a rank closes at once): a few ms of linger sends a burst
        # in one request instead of one request (and socket write) per summary.
        producer_linger=0.005,
        producer_partitioner=KeyHashPartitioner(),
        producer_max_batch_size=1_000_000,
        consumer_max_fetch_size=8_000_000,
        # Messages read ahead per stream before the agent takes them: Faust's default (4,096) lets one burst of
        # kernel batches (tens of KB each) fill ~100 MB, which the allocator then keeps (the soak's RSS step).
        stream_buffer_maxsize=256,
    )
    # Set before anything reads app.transport (app.topic does): every producer Faust makes is durable.
    app.transport = DurableTransport(app.conf.broker_consumer, app)
    kernels = app.topic(Topic.KERNELS.full(settings), key_type=bytes, value_type=bytes)
    lifecycle = app.topic(Topic.LIFECYCLE.full(settings), key_type=bytes, value_type=bytes)
    summaries = app.topic(Topic.SUMMARIES.full(settings), key_type=bytes, value_type=bytes)
    router: CompressionRouter[EventT] = CompressionRouter(settings.worker, settings.detector, time.monotonic(),
                                                          STAGING)
    stats = router.stats
    deliveries: set[asyncio.Future[None]] = set()  # summaries sent, their windows' messages not acked yet
    delivery_failures: list[BaseException] = []
    dead = DeadLetters(app.topic(Topic.DEAD_LETTER.full(settings), key_type=bytes, value_type=bytes))
    # Held while summaries are handed to the producer (and their delivery task made) and while a job-end marker
    # waits for every summary sent before it: the staging timer's emissions and the agent's interleave.
    sending = asyncio.Lock()

    async def send_dead(letters: list[DeadLetter], event: EventT) -> None:
        for d in letters:
            await dead.send(event, "compress", d.reason, payload=d.payload, job=d.job, rank=d.rank)

    async def carry_out(routed: Routed[EventT], event: EventT) -> None:
        """Do what the router said, in its order: dead letters, summaries, the job-end marker, acks."""
        await send_dead(routed.dead, event)
        if routed.emission is not None:
            async with sending:
                await send(routed.emission)
        if routed.end_marker is not None:
            job_id, part = routed.end_marker
            async with sending:
                await all_delivered()  # the marker must follow every summary of the job sent before it
                marker = summary_end_marker(job_id, part).encode()
                futs = [await summaries.send(key=job_key(job_id), value=marker, partition=q, force=True)
                        for q in range(settings.partitions)]
                for fut in futs:
                    await fut
        for e in routed.ack:
            e.ack()

    async def send(emission: Emission[EventT]) -> None:
        futs = []
        # Straight to the producer, not Topic.send: Faust's message wrapper, sensors and debug formatting cost
        # about as much as aiokafka's send itself, per summary. The delivery future is the same.
        producer, topic = app.producer, summaries.get_topic_name()
        for s in emission.summaries:
            payload = s.encode()
            stats.summary_bytes_out += len(payload)
            futs.append((s, payload, await producer.send(topic, kernel_key(s.job_id, s.kernel, s.stream), payload,
                                                         partition=None, timestamp=None, headers=None)))
        # The windows' messages are acked once their summaries are delivered; waiting for the broker here
        # would idle the agent for a round trip per closed window, so a task waits while the next messages
        # are read (bounded: at most MAX_DELIVERIES_IN_FLIGHT).
        while len(deliveries) >= MAX_DELIVERIES_IN_FLIGHT:
            await asyncio.wait(deliveries, return_when=asyncio.FIRST_COMPLETED)
        task = asyncio.ensure_future(deliver(emission, futs))
        deliveries.add(task)
        task.add_done_callback(delivered)

    async def deliver(emission: Emission[EventT], futs: list[tuple[KernelSummary, bytes, Any]]) -> None:
        failures = []
        for s, payload, fut in futs:
            try:
                await fut
            except Exception as exc:  # e.g. refused by the broker: kept as a dead letter, never dropped
                failures.append((s, payload, exc))
        await carry_out(router.delivered(emission, failures), emission.handle)

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

    @app.agent(kernels, name="argus.compress")
    async def compress(stream: Any) -> AsyncIterable[None]:
        async for event in stream.noack().events():
            t0 = time.perf_counter()
            msg = event.message
            try:
                batch = KernelBatch.decode(event.value)
            except SchemaError as exc:
                await carry_out(router.undecodable(failure_reason(exc)), event)
                event.ack()
            else:
                await carry_out(router.take(batch, event, msg.partition, msg.offset, time.monotonic(),
                                            time.time_ns()), event)
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
            if router.job_closed(rec):
                # An ABANDONED job (idle past job_idle_timeout_s, see argus.streams.diagnosis_agents) is closed
                # like an ended one. A marker appended to every kernel partition closes the job's windows
                # there once everything produced before the END has been read.
                marker = KernelBatch.job_end_marker(rec.job_id).encode()
                futs = [await kernels.send(key=job_key(rec.job_id), value=marker, partition=p, force=True)
                        for p in range(settings.partitions)]
                for fut in futs:
                    await fut
            yield None

    @app.timer(interval=STAGING.max_age_s / 2, name="argus.staged-windows")
    async def summarize_staged() -> None:
        routed = router.flush_staged(time.monotonic())
        if routed.emission is not None:
            await carry_out(routed, routed.emission.handle)

    @app.timer(interval=router.idle_tick_s, name="argus.idle-kernel-jobs")
    async def abandon_kernel_only_jobs() -> None:
        for rec in router.idle_jobs(time.monotonic()):
            fut = await lifecycle.send(key=job_key(rec.job_id), value=rec.encode(), force=True)
            await fut

    @app.on_partitions_revoked.connect  # type: ignore[arg-type]
    async def on_revoked(sender: Any, *args: Any, **kwargs: Any) -> None:
        router.revoked()

    diagnosis = install_diagnosis(app, settings, dead=dead)

    @app.page("/health")
    async def health(web: Any, request: Any) -> Any:
        return web.json({"ok": True, "app": settings.app_id})

    @app.page("/stats")
    async def stats_page(web: Any, request: Any) -> Any:
        return web.json({**stats.as_dict(), "open_windows": router.open_windows,
                         "pending_messages": router.pending_messages,
                         "assigned_partitions": len(app.consumer.assignment()),
                         "diagnosis": dataclasses.asdict(diagnosis)})

    # Read at scrape time only: the agents keep their counters as before, a scrape adds nothing per event.
    registry = worker_registry(WorkerCollector(stats, diagnosis, open_windows=lambda: router.open_windows,
                                               pending_messages=lambda: router.pending_messages,
                                               consumer=lambda: app.consumer,
                                               topics={t.full(settings) for t in Topic}))

    @app.page("/metrics")
    async def metrics_page(web: Any, request: Any) -> Any:
        return web.bytes(exposition(registry), headers={"Content-Type": CONTENT_TYPE})

    app.argus_stats = stats  # type: ignore[attr-defined]
    app.argus_metrics = registry  # type: ignore[attr-defined]
    return app
