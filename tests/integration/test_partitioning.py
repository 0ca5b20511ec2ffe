"""The rank side's producer puts a job's records on the partition the workers compute for it."""

from __future__ import annotations

import time

import pytest
from confluent_kafka import Consumer

from argus.core.settings import Settings
from argus.producers.publisher import Publisher
from argus.schemas.records import Step
from argus.topics import Topic, job_key, key_partition

pytestmark = pytest.mark.integration


def test_publisher_partitions_like_the_workers(settings: Settings) -> None:
    jobs = [f"job-{i}" for i in range(24)]
    with Publisher(settings, lossless=True) as pub:
        for job in jobs:
            pub.publish(Topic.STEPS, job_key(job), Step(job, 0, 1, 1_000, 10))
        assert pub.flush(15) == 0
    consumer = Consumer({"bootstrap.servers": settings.bootstrap_servers, "group.id": f"{settings.app_id}-p",
                         "auto.offset.reset": "earliest", "session.timeout.ms": 6000})
    seen: dict[str, int] = {}
    try:
        consumer.subscribe([Topic.STEPS.full(settings)])
        deadline = time.monotonic() + 60
        while len(seen) < len(jobs) and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is not None and msg.error() is None:
                seen[Step.decode(msg.value() or b"").job_id] = msg.partition() or 0
    finally:
        consumer.close()
    assert seen == {job: key_partition(job_key(job), settings.partitions) for job in jobs}
    assert len(set(seen.values())) > 1  # the jobs spread: the check is not trivially one partition
