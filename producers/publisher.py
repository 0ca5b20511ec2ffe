"""The rank-side publisher: records to Kafka without ever blocking or crashing the training process.

``publish`` only puts the record on a bounded in-memory queue (``put_nowait``); when the queue is full the
record is dropped and counted. A daemon sender thread encodes records to Avro and hands them to an
idempotent confluent-kafka producer (zstd/lz4, batched with a short linger). Kafka errors are counted
and logged, never raised into the caller.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from argus.errors import ArgusError, ProducerError
from argus.settings import Settings
from argus.topics import Topic

__all__ = ["EncodableRecord", "Publisher", "PublisherStats"]

log = logging.getLogger(__name__)

_STOP = object()


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
        extra_config: librdkafka settings that override the defaults.
        sender: start the background sender thread (disable only in tests of the queue itself).
        lossless: when the queue is full, ``publish`` waits for room instead of dropping. For offline
            sources (the simulator, trace imports, replays) only; a training process keeps the default.

    Raises:
        ProducerError: the Kafka producer could not be created (bad configuration).
    """

    def __init__(self, settings: Settings, extra_config: dict[str, Any] | None = None,
                 sender: bool = True, lossless: bool = False) -> None:
        self._settings = settings
        config: dict[str, Any] = {
            "bootstrap.servers": settings.bootstrap_servers,
            "enable.idempotence": True,
            "acks": "all",
            "compression.type": settings.compression,
            "linger.ms": 20,
            "batch.size": 1_000_000,
            "message.max.bytes": 8_000_000,
            "queue.buffering.max.messages": max(10_000, settings.publisher_queue_max * 4),
            "queue.buffering.max.kbytes": 256 * 1024,
            "message.timeout.ms": 120_000,
        }
        config.update(extra_config or {})
        try:
            self._producer = Producer(config)
        except KafkaException as exc:
            raise ProducerError(f"cannot create Kafka producer: {exc}") from exc
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=settings.publisher_queue_max)
        self._lock = threading.Lock()
        self._accepted = self._dropped = self._encode_errors = 0
        self._delivered = self._failed = self._bytes = 0
        self._topics = {t: t.full(settings) for t in Topic}
        self._closed = False
        self._lossless = lossless
        self._bytes_by_topic: dict[str, int] = {}
        self._thread: threading.Thread | None = None
        if sender:
            self._thread = threading.Thread(target=self._run, name="argus-publisher", daemon=True)
            self._thread.start()

    def publish(self, topic: Topic, key: bytes, record: EncodableRecord) -> bool:
        """Queue ``record`` for ``topic`` under ``key``; never blocks, never raises.

        Returns False (and counts a drop) when the queue is full or the publisher is closed.
        """
        try:
            if self._closed:
                raise queue.Full
            if self._lossless:
                self._queue.put((topic, key, record))
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
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)
        remaining = max(0.0, deadline - time.monotonic())
        return int(self._producer.flush(remaining)) + self._queue.unfinished_tasks

    def close(self, timeout_s: float = 30.0) -> PublisherStats:
        """Flush, stop the sender thread and return the final counters. Idempotent."""
        if not self._closed:
            pending = self.flush(timeout_s)
            if pending:
                log.warning("publisher closed with %d records undelivered", pending)
            self._closed = True
            if self._thread is not None:
                self._queue.put(_STOP)
                self._thread.join(timeout=5)
        return self.stats()

    def stats(self) -> PublisherStats:
        with self._lock:
            return PublisherStats(
                accepted=self._accepted, dropped=self._dropped, encode_errors=self._encode_errors,
                delivered=self._delivered, failed=self._failed, bytes_sent=self._bytes,
                queued=self._queue.qsize(), bytes_by_topic=dict(self._bytes_by_topic),
            )

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=0.1)
            except queue.Empty:
                self._producer.poll(0)
                continue
            try:
                if item is _STOP:
                    return
                self._send(*item)
            finally:
                self._queue.task_done()

    def _send(self, topic: Topic, key: bytes, record: EncodableRecord) -> None:
        try:
            payload = record.encode()
            if not isinstance(payload, bytes):
                raise TypeError(f"encode() returned {type(payload).__name__}, not bytes")
        except (ArgusError, AttributeError, TypeError, ValueError) as exc:
            with self._lock:
                self._encode_errors += 1
            log.error("record for topic %s key %r not encodable, dropped: %s", topic.value, key, exc)
            return
        while True:
            try:
                self._producer.produce(self._topics[topic], payload, key, on_delivery=self._on_delivery)
                break
            except BufferError:
                # librdkafka's own queue is full: the sender thread (not the caller) waits for room.
                self._producer.poll(0.05)
            except KafkaException as exc:
                with self._lock:
                    self._failed += 1
                log.error("produce to %s failed: %s", self._topics[topic], exc)
                return
        self._producer.poll(0)

    def _on_delivery(self, err: KafkaError | None, msg: Message) -> None:
        with self._lock:
            if err is None:
                size = len(msg.value() or b"")
                self._delivered += 1
                self._bytes += size
                topic = msg.topic() or ""
                self._bytes_by_topic[topic] = self._bytes_by_topic.get(topic, 0) + size
            else:
                self._failed += 1
        if err is not None:
            log.error("delivery to %s failed: %s", msg.topic(), err)
