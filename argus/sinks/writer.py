"""The ClickHouse sink: consume argus topics, insert in Arrow batches, commit offsets only after the insert.

At-least-once: offsets are committed after ClickHouse accepted the rows, so a crash re-delivers what was not
yet committed; the tables' ReplacingMergeTree keys (see :mod:`argus.sinks.tables`) turn the re-delivered copies
into replacements, so nothing is lost and nothing doubles. A message that does not decode, or whose rows a
table refuses, goes to the dead-letter topic with the reason and the rest of its batch is stored; a
transient ClickHouse failure, or a dead letter the broker does not take, rewinds and retries the batch.
The sink process (:func:`serve`) exports its counters for Prometheus on ``metrics_host:sink_metrics_port``
(default ``127.0.0.1:16067``; see :mod:`argus.sinks.metrics`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition

from argus.core.errors import ArgusError, SchemaError, SinkError
from argus.core.kafka_security import client_config, producer_config
from argus.core.settings import Settings
from argus.metrics import Histogram
from argus.schemas.records import DeadLetter
from argus.sinks.clickhouse import ClickHouseStore, is_transient
from argus.sinks.tables import TABLE_OF_TOPIC, Table
from argus.topics import PARTITIONER, RECORD_OF, Topic

__all__ = ["DEAD_LETTER_MAX_BYTES", "SinkStats", "SinkWriter", "serve"]

log = logging.getLogger(__name__)

#: Largest message the sink fetches per partition, bytes (the publisher's messages stay under 8,000,000).
_FETCH_MAX_BYTES = 8_000_000
#: Largest dead letter the sink produces, bytes (8 MiB: a fetched message plus the dead letter's fields).
DEAD_LETTER_MAX_BYTES = 8 * 1024 * 1024
#: Room for the Kafka record and batch headers around a dead letter's key and value, bytes.
_RECORD_OVERHEAD_BYTES = 4096
#: Pauses between retries of an insert that failed transiently, seconds (then the batch is rewound).
_INSERT_RETRY_DELAYS_S = (0.25, 1.0, 4.0)
#: Longest pause before a rewound batch is consumed again, seconds (doubling from 1 s per failed batch).
_BATCH_BACKOFF_MAX_S = 10.0
#: How long a batch waits for its dead letters to be acknowledged by the broker, seconds.
_DEAD_LETTER_FLUSH_S = 30.0
#: How often the consumer reports its statistics (the lag per partition of the metrics), milliseconds.
_STATS_INTERVAL_MS = 5000


@dataclass
class SinkStats:
    """Running counters of a sink (messages and rows)."""

    messages: int = 0
    rows: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    dead_lettered: int = 0
    #: Batches that failed (rewound to be retried).
    insert_failures: int = 0
    commits: int = 0
    last_commit_ns: int = 0
    #: Batches consumed (non-empty polls), whether stored or rewound.
    batches: int = 0
    #: Seconds per successful insert into each table (one per table per batch, more when a refused insert is
    #: split to find the bad messages).
    insert_latency_s: dict[str, Histogram] = field(default_factory=dict)
    #: Findings stored, per level and kind: ``{level: {kind: count}}``.
    findings: dict[str, dict[str, int]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"messages": self.messages, "rows": dict(self.rows), "dead_lettered": self.dead_lettered,
                "insert_failures": self.insert_failures, "commits": self.commits}


@dataclass
class _Pending:
    """One decoded message and the rows it becomes: the unit a failed insert is split into."""

    msg: Message
    rows: list[tuple[Any, ...]]


class SinkWriter:
    """Moves records from Kafka into ClickHouse.

    No record stops the sink: a message that does not decode or map to rows, and the messages whose rows a
    table refuses (found by splitting the failed insert in halves), go to the dead-letter topic with stage
    ``sink`` and the reason, and the rest of the batch is stored. Transient ClickHouse errors (connection,
    timeout, memory, too many parts) are retried with backoff, then the batch is rewound and retried later
    (nothing committed). A dead letter the broker refuses fails the batch too, so nothing is lost.

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
        self._refused: list[str] = []
        self._failed_batches = 0
        self._lag: dict[tuple[str, str], float] = {}
        consumer_config: dict[str, Any] = {
            "group.id": group or settings.sink_group,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "session.timeout.ms": int(settings.session_timeout_s * 1000),
            "heartbeat.interval.ms": max(500, int(settings.session_timeout_s * 1000) // 5),
            "max.partition.fetch.bytes": _FETCH_MAX_BYTES,
        }
        if settings.sink_metrics_port > 0:
            # librdkafka's statistics (lag per partition) arrive in consume(), on the sink's own thread: a
            # scrape never calls into the consumer, which could wait for the sink thread's consume().
            consumer_config.update({"statistics.interval.ms": _STATS_INTERVAL_MS, "stats_cb": self._on_stats})
        try:
            self._consumer = Consumer(client_config(settings.kafka, consumer_config))
            # A dead letter wraps a message of up to a fetch's size, so it needs more than the 1 MB default.
            self._dlq = Producer(producer_config(settings.kafka, {
                "compression.type": settings.compression, "linger.ms": 5,
                "message.max.bytes": DEAD_LETTER_MAX_BYTES, "partitioner": PARTITIONER}))
        except KafkaException as exc:
            raise SinkError(f"cannot create Kafka clients: {exc}") from exc
        self._consumer.subscribe(list(self._topics))

    def poll_once(self) -> int:
        """Consume up to ``sink_batch_max`` messages, insert them, commit. Returns messages handled (0 when
        the batch failed and was rewound to be retried)."""
        msgs = self._consumer.consume(num_messages=self.settings.sink_batch_max,
                                      timeout=self.settings.sink_flush_ms / 1000)
        if not msgs:
            return 0
        self.stats.batches += 1
        first: dict[tuple[str, int], int] = {}
        self._refused.clear()
        try:
            pending = self._decode(msgs, first)
            for topic, items in pending.items():
                self._insert(TABLE_OF_TOPIC[topic], items)
            self._flush_dead_letters()
        except SinkError as exc:
            self.stats.insert_failures += 1
            self._failed_batches += 1
            delay = min(_BATCH_BACKOFF_MAX_S, 2.0 ** (self._failed_batches - 1))
            log.error("sink batch of %d messages failed, rewinding to retry in %.0f s: %s", len(msgs), delay, exc)
            for (t, p), off in first.items():
                self._consumer.seek(TopicPartition(t, p, off))
            time.sleep(delay)
            return 0
        self._failed_batches = 0
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

    def _decode(self, msgs: list[Message], first: dict[tuple[str, int], int]) -> dict[Topic, list[_Pending]]:
        """Decode each message into its table's rows; a message that fails in any way is dead-lettered."""
        pending: dict[Topic, list[_Pending]] = defaultdict(list)
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
                rows = list(TABLE_OF_TOPIC[topic].rows(record))
            except SchemaError as exc:
                self._dead_letter(msg, str(exc))
                continue
            except Exception as exc:  # a record that decodes but breaks the row mapping must not stop the sink
                self._dead_letter(msg, f"{TABLE_OF_TOPIC[topic].name} rows: {type(exc).__name__}: {exc}")
                continue
            pending[topic].append(_Pending(msg, rows))
        return pending

    def _insert(self, table: Table, pending: list[_Pending]) -> None:
        """Insert the messages' rows; when the table refuses them, split the messages in halves until the
        offenders are single messages, dead-letter those and store the rest. Raises :class:`SinkError` on a
        transient error that outlived its retries (the caller rewinds the whole batch)."""
        rows = [r for p in pending for r in p.rows]
        try:
            self._insert_retrying(table, rows)
        except SinkError as exc:
            if is_transient(exc):
                raise
            if len(pending) == 1:
                self._dead_letter(pending[0].msg, f"insert into {table.name} refused: {exc}")
                return
            log.warning("insert of %d messages into %s refused, splitting to find the bad ones: %s",
                        len(pending), table.name, exc)
            mid = len(pending) // 2
            self._insert(table, pending[:mid])
            self._insert(table, pending[mid:])
            return
        self.stats.rows[table.name] += len(rows)
        if table.name == "findings":
            self._count_findings(table, rows)

    def _count_findings(self, table: Table, rows: list[tuple[Any, ...]]) -> None:
        names = [c[0] for c in table.columns]
        level, kind = names.index("level"), names.index("kind")
        for r in rows:
            by_kind = self.stats.findings.setdefault(str(r[level]), {})
            by_kind[str(r[kind])] = by_kind.get(str(r[kind]), 0) + 1

    def consumer_lag(self) -> dict[tuple[str, str], float]:
        """``{(topic, partition): high-water offset - committed offset}`` of the partitions assigned to this
        sink, as librdkafka last reported them (every 5 s, with ``sink_metrics_port`` set; empty otherwise):
        messages not stored yet. Safe to call from any thread (a metrics scrape)."""
        return self._lag

    def _on_stats(self, raw: str) -> None:
        """librdkafka's statistics callback (in ``consume``, on the sink's thread): keep the lag per partition."""
        try:
            stats = json.loads(raw)
            lag: dict[tuple[str, str], float] = {}
            for topic, t in (stats.get("topics") or {}).items():
                for part, p in (t.get("partitions") or {}).items():
                    n = p.get("consumer_lag", -1)
                    if int(part) >= 0 and n >= 0 and p.get("fetch_state") not in ("none", "stopped"):
                        lag[(topic, str(part))] = float(n)
            self._lag = lag  # replaced whole: a scrape reads one report or the next
        except Exception as exc:  # statistics never stop the sink
            log.debug("consumer statistics not understood: %s", exc)

    def _insert_retrying(self, table: Table, rows: list[tuple[Any, ...]]) -> None:
        for attempt, delay in enumerate(_INSERT_RETRY_DELAYS_S, start=1):
            try:
                self._timed_insert(table, rows)
                return
            except SinkError as exc:
                if not is_transient(exc):
                    raise
                log.warning("insert into %s failed (attempt %d), retrying in %.2f s: %s",
                            table.name, attempt, delay, exc)
            time.sleep(delay)
            try:
                self.store.ensure_schema()  # a dropped table or database is recreated, as at start-up
            except SinkError as exc:
                log.debug("schema check before retry failed: %s", exc)
        self._timed_insert(table, rows)  # the last attempt: its error goes to the caller

    def _timed_insert(self, table: Table, rows: list[tuple[Any, ...]]) -> None:
        t0 = time.perf_counter()
        self.store.insert(table, rows)
        hist = self.stats.insert_latency_s.get(table.name)
        if hist is None:
            hist = self.stats.insert_latency_s[table.name] = Histogram()
        hist.observe(time.perf_counter() - t0)

    def _dead_letter(self, msg: Message, reason: str) -> None:
        """Queue ``msg`` for the dead-letter topic. Raises :class:`SinkError` when it cannot be queued."""
        topic = msg.topic() or ""
        part, offset, payload = msg.partition() or 0, msg.offset() or 0, msg.value() or b""
        log.warning("dead-lettering %s[%s]@%s: %s", topic, part, offset, reason)
        self.stats.dead_lettered += 1
        if self._topics[topic] is Topic.DEAD_LETTER:
            return  # never loop on the dead-letter topic itself; the message stays there as it is
        key = msg.key()
        dl = DeadLetter(topic=topic, partition=part, offset=offset, payload=payload, reason=reason, stage="sink",
                        time_ns=time.time_ns(), key=key)
        try:
            value = dl.encode()
            if len(value) + len(key or b"") + _RECORD_OVERHEAD_BYTES > DEAD_LETTER_MAX_BYTES:
                # Too big to wrap: the original stays in its topic for the retention, so point at it.
                value = dataclasses.replace(dl, payload=b"", reason=(
                    f"{reason} [payload of {len(payload)} bytes not copied: over the dead-letter size limit; "
                    f"the original is {topic}[{part}]@{offset}]")).encode()
            self._dlq.produce(Topic.DEAD_LETTER.full(self.settings), value, key, on_delivery=self._delivered)
        except (ArgusError, KafkaException, BufferError) as exc:
            raise SinkError(f"dead letter for {topic}[{part}]@{offset} not queued: {exc}") from exc
        self._dlq.poll(0)

    def _delivered(self, err: KafkaError | None, msg: Message) -> None:
        if err is not None:
            self._refused.append(str(err))

    def _flush_dead_letters(self) -> None:
        """Wait for every queued dead letter; raises :class:`SinkError` if one is undelivered or refused."""
        left = self._dlq.flush(_DEAD_LETTER_FLUSH_S)
        if left:
            raise SinkError(f"{left} dead letter(s) not delivered within {_DEAD_LETTER_FLUSH_S:.0f} s")
        if self._refused:
            raise SinkError(f"{len(self._refused)} dead letter(s) refused by the broker: {self._refused[0]}")


def serve(settings: Settings) -> None:
    """Run the sink process until SIGTERM/SIGINT: ClickHouse schema, query endpoint, consume loop.

    Raises:
        SinkError: ClickHouse unreachable or the chDB directory owned by another process.
    """
    import signal

    from argus.heap_trim import start_heap_trimmer
    from argus.sinks.metrics import start_sink_metrics
    from argus.sinks.query_server import QueryServer

    store = ClickHouseStore(settings.clickhouse)
    store.ensure_schema()
    start_heap_trimmer()
    stop = threading.Event()
    writer = SinkWriter(settings, store)
    health: dict[str, Any] = {"embedded": store.embedded}
    server = QueryServer(store, settings, health)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server.start()
    metrics = start_sink_metrics(settings, writer)  # None when sink_metrics_port is 0 or cannot be bound
    try:
        while not stop.is_set():
            writer.poll_once()
            health["stats"] = writer.stats.as_dict()
    finally:
        if metrics is not None:
            metrics.stop()
        writer.close()
        server.stop()
        store.close()
        log.info("sink stopped: %s", writer.stats.as_dict())
