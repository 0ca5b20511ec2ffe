"""The rank-side publisher: records to Kafka without ever blocking or crashing the training process.

``publish`` only puts the record on a bounded in-memory queue (``put_nowait``); when the queue is full the
record is dropped and counted. A daemon sender thread encodes records to Avro and hands them to an
idempotent confluent-kafka producer (zstd/lz4, batched with a short linger). Kafka errors are counted
and logged, never raised into the caller.

The sender survives any exception of one record (its encoding, its hand-over to Kafka, a delivery callback):
the record is dropped, counted (``encode_errors`` or ``failed``) and logged with its topic, key and rank. And
``close(timeout_s)`` returns within about ``timeout_s`` whatever state the sender is in (dead, stuck on a full
Kafka queue, behind a full record queue): a training process never hangs at exit on its publisher.

Details and reasoning: docs/internals/producers.md.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from argus.core.errors import ProducerError
from argus.core.kafka_security import producer_config
from argus.core.settings import Settings
from argus.topics import PARTITIONER, Topic

if TYPE_CHECKING:
    from argus.metrics import MetricsServer

__all__ = ["MAX_MESSAGE_BYTES", "EncodableRecord", "Publisher", "PublisherStats"]

#: Largest message the publisher sends, bytes (under the local broker's 16 MiB ``message.max.bytes``).
MAX_MESSAGE_BYTES = 8_000_000

log = logging.getLogger(__name__)

# Errors of one record that are logged one by one; beyond, one in _LOG_EVERY (a record type that never
# encodes must not flood a training process's log).
_LOG_FIRST, _LOG_EVERY = 10, 1000


class EncodableRecord(Protocol):
    def encode(self) -> bytes: ...


@dataclass(frozen=True)
class PublisherStats:
    """Counters of a :class:`Publisher` (records, not bytes, except ``bytes_sent``)."""

    accepted: int
    dropped: int
    encode_errors: int
    delivered: int
    failed: int
    bytes_sent: int
    queued: int
    #: Delivered value bytes (Avro, before Kafka compression) per full topic name.
    bytes_by_topic: dict[str, int]


class Publisher:
    """Publishes argus records to Kafka from a training process (or a simulator, or an importer).

    Args:
        settings: bootstrap servers, topic prefix, queue bound and compression come from here.
        extra_config: librdkafka settings that override the defaults (not the security ones, which come
            from the ``kafka_*`` settings, nor ``acks=all`` and idempotence).
        sender: start the background sender thread (disable only in tests of the queue itself).
        lossless: when the queue is full, ``publish`` waits for room instead of dropping. For offline
            sources (the simulator, trace imports, replays) only; a training process keeps the default.

    Raises:
        ProducerError: the Kafka producer could not be created (bad configuration).
        ConfigError: ``extra_config`` sets a security option or weakens ``acks``/idempotence.
    """

    def __init__(self, settings: Settings, extra_config: dict[str, Any] | None = None,
                 sender: bool = True, lossless: bool = False) -> None:
        self._settings = settings
        config: dict[str, Any] = {
            "compression.type": settings.compression,
            "linger.ms": 20,
            "batch.size": 1_000_000,
            "message.max.bytes": MAX_MESSAGE_BYTES,
            "queue.buffering.max.messages": max(10_000, settings.publisher_queue_max * 4),
            "queue.buffering.max.kbytes": 256 * 1024,
            "message.timeout.ms": 120_000,
            "partitioner": PARTITIONER,  # as the workers' producers: one job, one partition number
        }
        config.update(extra_config or {})
        try:
            # Brokers, TLS and SASL from the kafka_* settings, acks=all and idempotence, as every argus producer
            # (argus.core.kafka_security).
            self._producer = Producer(producer_config(settings.kafka, config))
        except KafkaException as exc:
            raise ProducerError(f"cannot create Kafka producer: {exc}") from exc
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=settings.publisher_queue_max)
        self._lock = threading.Lock()
        self._accepted = self._dropped = self._encode_errors = 0
        self._delivered = self._failed = self._bytes = 0
        self._topics = {t: t.full(settings) for t in Topic}
        self._closed = False
        self._stop = threading.Event()  # set by close(): the sender exits at its next record or poll
        self._lossless = lossless
        self._bytes_by_topic: dict[str, int] = {}
        self._thread: threading.Thread | None = None
        if sender:
            self._thread = threading.Thread(target=self._run, name="argus-publisher", daemon=True)
            self._thread.start()
        self._metrics: MetricsServer | None = None
        if settings.publisher_metrics_port > 0:
            self._metrics = self._start_metrics()

    def publish(self, topic: Topic, key: bytes, record: EncodableRecord) -> bool:
        """Queue ``record`` for ``topic`` under ``key``; never blocks, never raises.

        Returns False (and counts a drop) when the queue is full or the publisher is closed. A lossless
        publisher waits for room instead, as long as its sender thread is there to make some.
        """
        try:
            if self._closed:
                raise queue.Full
            if self._lossless:
                self._put_waiting((topic, key, record))
            else:
                self._queue.put_nowait((topic, key, record))
        except queue.Full:
            with self._lock:
                self._dropped += 1
            return False
        with self._lock:
            self._accepted += 1
        return True

    def flush(self, timeout_s: float = 30.0) -> int:
        """Wait until queued records are delivered or ``timeout_s`` passes; returns records still pending."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline and self._sending():
            time.sleep(0.005)
        remaining = max(0.0, deadline - time.monotonic())
        try:
            in_kafka = int(self._producer.flush(remaining))
        except Exception as exc:  # a delivery callback's error surfaces here: the caller is never raised into
            log.error("flushing the Kafka producer failed: %s", exc)
            in_kafka = len(self._producer)
        return in_kafka + self._queue.unfinished_tasks

    def close(self, timeout_s: float = 30.0) -> PublisherStats:
        """Flush, stop the sender thread and return the final counters; returns within about ``timeout_s``,
        whatever state the sender is in. Records still queued then, or handed to Kafka and not delivered, are
        given up, logged and counted as failed: after close, every accepted record is delivered, failed or an
        encode error. Idempotent."""
        if not self._closed:
            deadline = time.monotonic() + timeout_s
            pending = self.flush(timeout_s)
            if pending:
                log.warning("publisher closed with %d records undelivered", pending)
            self._closed = True
            self._stop.set()
            if self._thread is not None:
                # The sender checks the flag at least every 0.1 s; a put of a sentinel could block on a full queue.
                self._thread.join(timeout=max(0.2, deadline - time.monotonic()))
            if pending:
                self._give_up()
            self._stop_metrics()
        return self.stats()

    def _give_up(self) -> None:
        """Count what close() leaves behind as failed: records never handed to Kafka, and those librdkafka
        still holds (purged, so their delivery callbacks report them)."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            self._count_error("failed", item, "not sent before close", TimeoutError("publisher closed"))
            self._queue.task_done()
        try:
            self._producer.purge(in_queue=True, in_flight=True, blocking=False)
            self._producer.flush(0)  # serves the purged messages' delivery callbacks: counted as failed
        except Exception as exc:  # a broken producer: its messages cannot be told apart any more
            log.error("purging the Kafka producer at close failed: %s", exc)

    def stats(self) -> PublisherStats:
        with self._lock:
            return PublisherStats(
                accepted=self._accepted, dropped=self._dropped, encode_errors=self._encode_errors,
                delivered=self._delivered, failed=self._failed, bytes_sent=self._bytes,
                queued=self._queue.qsize(), bytes_by_topic=dict(self._bytes_by_topic),
            )

    @property
    def queue_capacity(self) -> int:
        """The bound of the record queue (``publisher_queue_max``)."""
        return self._queue.maxsize

    @property
    def metrics_url(self) -> str | None:
        """Where this publisher's metrics are served, or ``None`` (off, or the port could not be bound)."""
        return self._metrics.url if self._metrics is not None else None

    def kafka_queued(self) -> int:
        """Messages handed to the Kafka producer and not delivered yet (0 if it cannot tell)."""
        try:
            return len(self._producer)
        except Exception:  # a closed or broken producer: metrics never raise
            return 0

    def _start_metrics(self) -> MetricsServer | None:
        try:
            from argus.producers.publisher_metrics import start_publisher_metrics

            return start_publisher_metrics(self._settings, self)
        except Exception as exc:  # metrics must never cost the training process anything but a log line
            log.warning("publisher metrics not started: %s: %s", type(exc).__name__, exc)
            return None

    def _stop_metrics(self) -> None:
        server, self._metrics = self._metrics, None
        if server is not None:
            try:
                server.stop()
            except Exception as exc:
                log.warning("stopping the publisher metrics server failed: %s", exc)

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _sending(self) -> bool:
        """Whether a sender thread is there to drain the queue."""
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    def _put_waiting(self, item: tuple[Topic, bytes, EncodableRecord]) -> None:
        """Lossless put: wait for room while the sender drains the queue (queue.Full once it cannot)."""
        while True:
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                if self._closed or not self._sending():
                    raise

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                item = self._queue.get(timeout=0.1)
            except queue.Empty:
                self._poll(0)
                continue
            try:
                self._send(*item)
            except Exception as exc:  # the last line: whatever one record does, the sender goes on
                self._count_error("failed", item, "could not be sent", exc)
            finally:
                self._queue.task_done()

    def _poll(self, timeout_s: float) -> None:
        try:
            self._producer.poll(timeout_s)
        except Exception as exc:  # an exception of a delivery callback is re-raised by poll
            log.error("polling the Kafka producer failed: %s", exc)

    def _send(self, topic: Topic, key: bytes, record: EncodableRecord) -> None:
        try:
            payload = record.encode()
            if not isinstance(payload, bytes):
                raise TypeError(f"encode() returned {type(payload).__name__}, not bytes")
        except Exception as exc:  # any encoder bug or bad value (OverflowError, RecursionError, ...): drop it
            self._count_error("encode_errors", (topic, key, record), "not encodable", exc)
            return
        while True:
            try:
                self._producer.produce(self._topics[topic], payload, key, on_delivery=self._on_delivery)
                break
            except BufferError:
                # librdkafka's own queue is full: the sender thread (not the caller) waits for room, until close.
                if self._stop.is_set():
                    self._count_error("failed", (topic, key, record), "not handed to Kafka before close",
                                      BufferError("the Kafka producer queue is full"))
                    return
                self._poll(0.05)
            except KafkaException as exc:
                self._count_error("failed", (topic, key, record), "could not be produced", exc)
                return
        self._poll(0)

    def _count_error(self, counter: str, item: Any, what: str, exc: BaseException) -> None:
        """Count a dropped record under ``counter`` and log it (its topic, key and rank), throttled."""
        with self._lock:
            if counter == "encode_errors":
                self._encode_errors += 1
                n = self._encode_errors
            else:
                self._failed += 1
                n = self._failed
        if n > _LOG_FIRST and n % _LOG_EVERY:
            return
        topic, key, record = item if isinstance(item, tuple) and len(item) == 3 else (None, None, item)
        try:
            rank = getattr(record, "rank", None)
        except Exception:  # a hostile record's attribute may raise too
            rank = None
        name = topic.value if isinstance(topic, Topic) else str(topic)
        log.error("record for topic %s (key %r, rank %s) %s, dropped (%s %d): %s: %s", name, key, rank, what,
                  counter, n, type(exc).__name__, exc)

    def _on_delivery(self, err: KafkaError | None, msg: Message) -> None:
        if err is not None:  # counted and logged as any dropped record (throttled: a purge reports thousands)
            self._count_error("failed", (msg.topic(), msg.key(), None), "not delivered", KafkaException(err))
            return
        with self._lock:
            size = len(msg.value() or b"")
            self._delivered += 1
            self._bytes += size
            topic = msg.topic() or ""
            self._bytes_by_topic[topic] = self._bytes_by_topic.get(topic, 0) + size
