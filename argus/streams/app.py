"""The Faust application of argus (``argus worker``): its Kafka clients, its agents and its web pages.

:func:`create_app` makes the app (durable producers: ``acks=all`` and idempotence), adds the compression agent
(:mod:`argus.streams.compression_agent`) and the diagnosis agents (:mod:`argus.streams.diagnosis_agents`), and
serves ``/health``, ``/stats`` (the counters as JSON) and ``/metrics`` (the same counters for Prometheus, read at
scrape time: see :mod:`argus.streams.metrics`) on ``metrics_host:worker_web_port``. Every topic is consumed
without automatic acks: the agents ack once what a message caused was delivered (docs/stream-agents.md).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import faust
from aiokafka.partitioner import DefaultPartitioner, murmur2
from faust.transport.drivers import aiokafka as faust_aiokafka
from faust.types import EventT

from argus.core.kafka_security import aiokafka_durable_config, faust_credentials
from argus.core.settings import Settings
from argus.metrics import CONTENT_TYPE, exposition
from argus.streams.compression_agent import install_compression
from argus.streams.compression_router import CompressionRouter, CompressionStats, Staging
from argus.streams.dead_letters import DeadLetters
from argus.streams.diagnosis_agents import install_diagnosis
from argus.streams.diagnosis_stats import DiagnosisStats
from argus.streams.metrics import WorkerCollector, worker_registry
from argus.topics import Topic

__all__ = ["CompressionStats", "create_app"]

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
    """A Faust app wired to ``settings``: the kernel and job topics in; summaries, findings, lifecycle and
    context records and dead letters out; its web pages."""
    app = _faust_app(settings)
    # Set before anything reads app.transport (app.topic does): every producer Faust makes is durable.
    app.transport = DurableTransport(app.conf.broker_consumer, app)
    dead = DeadLetters(app.topic(Topic.DEAD_LETTER.full(settings), key_type=bytes, value_type=bytes))
    router: CompressionRouter[EventT] = install_compression(app, settings, dead, STAGING)
    diagnosis = install_diagnosis(app, settings, dead=dead)
    _add_pages(app, settings, router, diagnosis)
    return app


def _faust_app(settings: Settings) -> faust.App:
    """The app's Faust and Kafka client settings."""
    brokers = ";".join(f"kafka://{b}" for b in settings.bootstrap_servers.split(","))
    datadir = settings.home / "faust" / f"{settings.app_id}-data"
    # Faust creates only the last folder of its datadir.
    datadir.parent.mkdir(parents=True, exist_ok=True)
    return faust.App(
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
        producer_acks=-1,  # all (and idempotence: the DurableTransport)
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


def _add_pages(app: faust.App, settings: Settings, router: CompressionRouter[EventT],
               diagnosis: DiagnosisStats) -> None:
    """``/health``, ``/stats`` and ``/metrics``; the counters also as ``app.argus_stats`` and the registry as
    ``app.argus_metrics``."""
    stats = router.stats

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
