"""Findings as they arrive: ``argus findings --follow``, read from the diagnosis topic.

The stream worker publishes every finding twice: as an Avro :class:`~argus.schemas.records.Finding` on the
``findings`` topic (what the sink stores) and as one JSON object per message on ``findings.json`` (the
``argus findings --json`` contract, UTF-8, keyed by job id). The JSON topic is for programs that do not want
argus's schemas -- kcat, kafka-console-consumer, a 30-line confluent-kafka consumer
(``examples/consume_findings.py``). A schema registry would have made the Avro topic self-describing too, but
it is one more service to run, secure and keep available for every reader, for records this small; JSON costs
a few hundred bytes per finding and no coordination.

:func:`follow_findings` reads the Avro topic (the source of truth) without a consumer group: it assigns every
partition at its end (from now) or its start, so followers never disturb each other or the sink, and it
drops the copies that at-least-once delivery may bring (same ``finding_id``).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, Consumer, KafkaException, TopicPartition

from argus.core.errors import SchemaError, SinkError
from argus.core.kafka_security import client_config
from argus.core.settings import Settings
from argus.detectors.findings import finding_json
from argus.schemas.records import Finding
from argus.topics import Topic

__all__ = ["follow_findings"]

log = logging.getLogger(__name__)

#: Finding ids remembered to drop re-deliveries (the oldest are forgotten beyond it).
_SEEN_MAX = 100_000


def follow_findings(settings: Settings, job_id: str | None = None, from_beginning: bool = False,
                    stop: threading.Event | None = None, idle_timeout_s: float | None = None,
                    timeout_s: float = 30.0) -> Iterator[dict[str, Any]]:
    """Yield findings (``argus findings --json`` objects) of ``job_id`` (default: every job) as they arrive.

    ``from_beginning``: start at the oldest retained finding instead of now. Stops when ``stop`` is set, or
    after ``idle_timeout_s`` seconds without a finding (``None``: never). Undecodable messages are logged and
    skipped (the worker dead-letters nothing here: it wrote them).

    Raises:
        SinkError: the broker cannot be reached or the topic does not exist.
    """
    topic = Topic.FINDINGS.full(settings)
    consumer = Consumer(client_config(settings.kafka, {"group.id": f"{settings.app_id}-follow-{uuid.uuid4().hex[:8]}",
                                                 "enable.auto.commit": False}))
    seen: dict[str, None] = {}
    try:
        try:
            meta = consumer.list_topics(topic, timeout=timeout_s)
        except KafkaException as exc:
            raise SinkError(f"cannot reach Kafka on {settings.bootstrap_servers}: {exc}") from exc
        if topic not in meta.topics or meta.topics[topic].error is not None:
            raise SinkError(f"topic {topic} not found on {settings.bootstrap_servers} (is the stack up?)")
        start = OFFSET_BEGINNING if from_beginning else OFFSET_END
        consumer.assign([TopicPartition(topic, p, start) for p in sorted(meta.topics[topic].partitions)])
        last = time.monotonic()
        while stop is None or not stop.is_set():
            msg = consumer.poll(0.5)
            if msg is None or msg.error() is not None:
                if idle_timeout_s is not None and time.monotonic() - last > idle_timeout_s:
                    return
                continue
            last = time.monotonic()
            try:
                f = Finding.decode(msg.value() or b"")
            except SchemaError as exc:
                log.warning("undecodable finding at %s[%s]@%s skipped: %s", topic, msg.partition(), msg.offset(),
                            exc)
                continue
            if (job_id is not None and f.job_id != job_id) or f.finding_id in seen:
                continue
            seen[f.finding_id] = None
            if len(seen) > _SEEN_MAX:
                del seen[next(iter(seen))]
            yield {**finding_json(f), "finding_id": f.finding_id}
    finally:
        consumer.close()
