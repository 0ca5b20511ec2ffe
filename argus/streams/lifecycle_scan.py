"""The DIAGNOSED parts already on the lifecycle topic, read once when a worker starts (see
:mod:`argus.streams.diagnosis_agents`: a restart must not diagnose a diagnosed job live again)."""

from __future__ import annotations

import logging
import time

from confluent_kafka import Consumer, TopicPartition

from argus.core.errors import SchemaError
from argus.core.kafka_security import client_config
from argus.core.settings import Settings
from argus.schemas.records import JobLifecycle, LifecycleEvent
from argus.topics import Topic

__all__ = ["scan_diagnosed"]

log = logging.getLogger(__name__)


def scan_diagnosed(settings: Settings, timeout_s: float = 30.0) -> dict[str, set[str]]:
    """The DIAGNOSED parts per job on the lifecycle topic, read from its start to its end at call time.

    A broker that does not answer within ``timeout_s`` gives what was read so far (logged): the agents then
    fall back to what they see live.
    """
    topic = Topic.LIFECYCLE.full(settings)
    out: dict[str, set[str]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        consumer = Consumer(client_config(settings.kafka, {"group.id": f"{settings.app_id}-scan",
                                                     "enable.auto.commit": False, "auto.offset.reset": "earliest"}))
    except Exception as exc:  # as below: never fatal
        log.warning("lifecycle scan for DIAGNOSED jobs not started: %s", exc)
        return out
    try:
        meta = consumer.list_topics(topic, timeout=timeout_s)
        ends: dict[int, int] = {}
        assign = []
        for p in meta.topics[topic].partitions:
            lo, hi = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout_s)
            if hi > lo:
                ends[p] = hi
                assign.append(TopicPartition(topic, p, lo))
        consumer.assign(assign)
        while ends and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None or msg.error() is not None:
                continue
            try:
                rec = JobLifecycle.decode(msg.value() or b"")
            except SchemaError:
                rec = None
            if rec is not None and rec.event is LifecycleEvent.DIAGNOSED:
                out.setdefault(rec.job_id, set()).add(rec.part)
            part, offset = msg.partition() or 0, msg.offset() or 0
            if offset >= ends.get(part, 0) - 1:
                ends.pop(part, None)
        if ends:
            log.warning("lifecycle scan for DIAGNOSED jobs incomplete after %.0f s (partitions %s)", timeout_s,
                        sorted(ends))
    except Exception as exc:  # the scan only narrows re-diagnosis; a failure must never stop the worker
        log.warning("lifecycle scan for DIAGNOSED jobs failed (%s: %s); relying on what is read live",
                    type(exc).__name__, exc)
    finally:
        consumer.close()
    return out
