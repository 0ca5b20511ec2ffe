"""The ClickHouse sink: consume argus topics, insert in Arrow batches, commit offsets only after the insert.

At-least-once: offsets are committed after ClickHouse accepted the rows, so a crash re-delivers what was not
yet committed; the tables' ReplacingMergeTree keys (see :mod:`sinks.tables`) turn the re-delivered copies
into replacements, so nothing is lost and nothing doubles. A message that does not decode goes to the
dead-letter topic with the reason and is skipped; a failed insert rewinds and retries the batch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition

from argus.errors import ArgusError, SchemaError, SinkError
from argus.settings import Settings
from argus.topics import RECORD_OF, Topic
from schemas.records import DeadLetter
from sinks.clickhouse import ClickHouseStore
from sinks.tables import TABLE_OF_TOPIC

__all__ = ["SinkStats", "SinkWriter", "serve"]

log = logging.getLogger(__name__)


@dataclass
class SinkStats:
    """Running counters of a sink (messages and rows)."""

    messages: int = 0
    rows: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    dead_lettered: int = 0
    insert_failures: int = 0
    commits: int = 0
    last_commit_ns: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"messages": self.messages, "rows": dict(self.rows), "dead_lettered": self.dead_lettered,
                "insert_failures": self.insert_failures, "commits": self.commits}


class SinkWriter:
    """Moves records from Kafka into ClickHouse.

    Args:
        settings: topics, consumer group (``sink_group``), batch size and flush interval.
        store: an open :class:`ClickHouseStore` (the sink owns it; embedded chDB allows one process).
        group: consumer group override (tests give each test its own).
    """

    def __init__(self, settings: Settings, store: ClickHouseStore, group: str | None = None) -> None:
        self.settings = settings
        self.store = store
        self.stats = SinkStats()
        self._topics = {t.full(settings): t for t in TABLE_OF_TOPIC}
        try:
            self._consumer = Consumer({
                "bootstrap.servers": settings.bootstrap_servers,
                "group.id": group or settings.sink_group,
                "enable.auto.commit": False,
                "auto.offset.reset": "earliest",
                "session.timeout.ms": int(settings.session_timeout_s * 1000),
                "heartbeat.interval.ms": max(500, int(settings.session_timeout_s * 1000) // 5),
                "max.partition.fetch.bytes": 8_000_000,
            })
            self._dlq = Producer({"bootstrap.servers": settings.bootstrap_servers, "enable.idempotence": True,
                                  "compression.type": settings.compression, "linger.ms": 5})
        except KafkaException as exc:
            raise SinkError(f"cannot create Kafka clients: {exc}") from exc
        self._consumer.subscribe(list(self._topics))

    def poll_once(self) -> int:
        """Consume up to ``sink_batch_max`` messages, insert them, commit. Returns messages handled."""
        msgs = self._consumer.consume(num_messages=self.settings.sink_batch_max,
                                      timeout=self.settings.sink_flush_ms / 1000)
        if not msgs:
            return 0
        rows: dict[Topic, list[tuple[Any, ...]]] = defaultdict(list)
        first: dict[tuple[str, int], int] = {}
        for msg in msgs:
            err = msg.error()
            if err is not None:
                if err.code() != KafkaError._PARTITION_EOF:
                    log.warning("consumer error: %s", err)
                continue
            topic_name, part, offset = msg.topic() or "", msg.partition() or 0, msg.offset() or 0
            first.setdefault((topic_name, part), offset)
            topic = self._topics[topic_name]
            try:
                record = RECORD_OF[topic].decode(msg.value() or b"")
            except SchemaError as exc:
                self._dead_letter(msg, str(exc))
                continue
            rows[topic].extend(TABLE_OF_TOPIC[topic].rows(record))
        try:
            for topic, trows in rows.items():
                self.store.insert(TABLE_OF_TOPIC[topic], trows)
                self.stats.rows[TABLE_OF_TOPIC[topic].name] += len(trows)
            if self._dlq.flush(30):
                raise SinkError("dead-letter messages not delivered within 30 s")
        except ArgusError as exc:
            self.stats.insert_failures += 1
            log.error("sink batch of %d messages failed, rewinding to retry: %s", len(msgs), exc)
            for (t, p), off in first.items():
                self._consumer.seek(TopicPartition(t, p, off))
            time.sleep(1.0)
            return 0
        try:
            self._consumer.commit(asynchronous=False)
        except KafkaException as exc:
            # Rows are in; the next delivery of these messages will replace, not double them.
            log.warning("offset commit failed (rows will be re-delivered and replaced): %s", exc)
        else:
            self.stats.commits += 1
            self.stats.last_commit_ns = time.time_ns()
        self.stats.messages += len(msgs)
        return len(msgs)

    def run(self, stop: threading.Event) -> None:
        """Poll until ``stop`` is set, then close the consumer (leaving the group cleanly)."""
        log.info("sink consuming %s", ", ".join(sorted(self._topics)))
        try:
            while not stop.is_set():
                self.poll_once()
        finally:
            self.close()

    def close(self) -> None:
        self._dlq.flush(10)
        self._consumer.close()

    def _dead_letter(self, msg: Message, reason: str) -> None:
        topic = msg.topic() or ""
        log.warning("dead-lettering %s[%s]@%s: %s", topic, msg.partition(), msg.offset(), reason)
        self.stats.dead_lettered += 1
        if self._topics[topic] is Topic.DEAD_LETTER:
            return  # never loop on the dead-letter topic itself; the message stays there as it is
        dl = DeadLetter(topic=topic, partition=msg.partition() or 0, offset=msg.offset() or 0,
                        payload=msg.value() or b"", reason=reason, stage="sink", time_ns=time.time_ns(),
                        key=msg.key())
        self._dlq.produce(Topic.DEAD_LETTER.full(self.settings), dl.encode(), msg.key())


def serve(settings: Settings) -> None:
    """Run the sink process until SIGTERM/SIGINT: ClickHouse schema, query endpoint, consume loop.

    Raises:
        SinkError: ClickHouse unreachable or the chDB directory owned by another process.
    """
    import signal

    from sinks.query_server import QueryServer

    store = ClickHouseStore(settings)
    store.ensure_schema()
    stop = threading.Event()
    writer = SinkWriter(settings, store)
    health: dict[str, Any] = {"embedded": store.embedded, "dsn": settings.clickhouse_dsn}
    server = QueryServer(store, settings.query_port, health)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server.start()
    try:
        while not stop.is_set():
            writer.poll_once()
            health["stats"] = writer.stats.as_dict()
    finally:
        writer.close()
        server.stop()
        store.close()
        log.info("sink stopped: %s", writer.stats.as_dict())
