"""The sink survives every record: a poison message is dead-lettered, the rest of its batch is stored, other
topics keep flowing, and a dead letter the broker refuses holds the offsets back until it is delivered."""

from __future__ import annotations

import io
import json
import time

import fastavro
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource, ResourceType

from argus.core.settings import Settings
from argus.schemas.codec import MAGIC, SCHEMA_DIR
from argus.schemas.records import JobLifecycle, LifecycleEvent, Step
from argus.topics import Topic
from tests.integration.conftest import SinkThread

pytestmark = pytest.mark.integration

JOB = "job-good"


def poison_step(job: str) -> bytes:
    """A ``Step`` with ``rank = 2**31`` on the wire (Avro ints and longs share the varint encoding), which no
    ``Step`` can encode: what a foreign or buggy producer can still send."""
    schema = json.loads((SCHEMA_DIR / "step.v1.avsc").read_text())
    for f in schema["fields"]:
        if f["name"] == "rank":
            f["type"] = "long"
    buf = io.BytesIO()
    buf.write(bytes((MAGIC, 1)))
    fastavro.schemaless_writer(buf, fastavro.parse_schema(schema),
                               {"job_id": job, "rank": 2**31, "step": 0, "start_ns": 0, "wall_ns": 1, "gpu_ns": None})
    return buf.getvalue()


def publish_batch_with_poison(settings: Settings) -> None:
    """Ten good steps, the poison, ten more (one partition: the job's key), then a lifecycle record."""
    raw = Producer({"bootstrap.servers": settings.bootstrap_servers})
    steps = Topic.STEPS.full(settings)
    for i in range(21):
        value = poison_step(JOB) if i == 10 else Step(JOB, 0, i, 1_000 * i, 10, None).encode()
        raw.produce(steps, value, JOB.encode())
    end = JobLifecycle("job-other", LifecycleEvent.START, time.time_ns(), 4)
    raw.produce(Topic.LIFECYCLE.full(settings), end.encode(), b"job-other")
    assert raw.flush(10) == 0


@pytest.mark.parametrize("stage", ["decode", "insert"])
def test_poison_step_is_dead_lettered_and_the_rest_is_stored(
        settings: Settings, sink: SinkThread, stage: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if stage == "insert":
        # A record the schema's checks let through but the table refuses: found by splitting the insert.
        monkeypatch.setattr(Step, "check", lambda self: None)
    publish_batch_with_poison(settings)
    sink.wait_for(f"SELECT count() FROM {{db}}.steps FINAL WHERE job_id = '{JOB}'", 20)
    sink.wait_for("SELECT count() FROM {db}.dead_letters FINAL", 1)
    rows = sink.store.query(f"SELECT topic, stage, reason, payload FROM {sink.store.database}.dead_letters").rows
    topic, dl_stage, reason, _ = rows[0]
    assert topic == Topic.STEPS.full(settings) and dl_stage == "sink"
    assert ("rank" in reason) if stage == "decode" else ("refused" in reason and "steps" in reason), reason
    sink.wait_for("SELECT count() FROM {db}.jobs FINAL WHERE job_id = 'job-other'", 1)
    # The sink keeps ingesting afterwards.
    raw = Producer({"bootstrap.servers": settings.bootstrap_servers})
    raw.produce(Topic.STEPS.full(settings), Step("job-later", 1, 0, 0, 5, 4).encode(), b"job-later")
    assert raw.flush(10) == 0
    sink.wait_for("SELECT count() FROM {db}.steps FINAL WHERE job_id = 'job-later'", 1)
    assert sink.writer.stats.dead_lettered == 1


def _set_topic_max_bytes(settings: Settings, topic: str, value: str | None) -> None:
    op = AlterConfigOpType.SET if value is not None else AlterConfigOpType.DELETE
    res = ConfigResource(ResourceType.TOPIC, topic, incremental_configs=[
        ConfigEntry("max.message.bytes", value or "", incremental_operation=op)])
    admin = AdminClient({"bootstrap.servers": settings.bootstrap_servers})  # alive until the futures resolve
    for fut in admin.incremental_alter_configs([res]).values():
        fut.result(timeout=30)


def _committed(settings: Settings, topic: str) -> int:
    c = Consumer({"bootstrap.servers": settings.bootstrap_servers, "group.id": settings.sink_group})
    try:
        parts = [TopicPartition(topic, p) for p in range(settings.partitions)]
        return sum(max(tp.offset, 0) for tp in c.committed(parts, timeout=10))
    finally:
        c.close()


def test_refused_dead_letter_holds_the_offsets_until_delivered(settings: Settings, sink: SinkThread) -> None:
    dead_letters = Topic.DEAD_LETTER.full(settings)
    _set_topic_max_bytes(settings, dead_letters, "64")  # the broker now refuses every dead letter
    try:
        raw = Producer({"bootstrap.servers": settings.bootstrap_servers})
        raw.produce(Topic.STEPS.full(settings), b"not avro", JOB.encode())
        raw.produce(Topic.STEPS.full(settings), Step(JOB, 0, 0, 0, 10, None).encode(), JOB.encode())
        assert raw.flush(10) == 0
        deadline = time.monotonic() + 60
        while sink.writer.stats.insert_failures < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert sink.writer.stats.insert_failures >= 2  # the batch failed and was retried, not skipped
        assert _committed(settings, Topic.STEPS.full(settings)) == 0
    finally:
        _set_topic_max_bytes(settings, dead_letters, None)
    sink.wait_for("SELECT count() FROM {db}.dead_letters FINAL", 1, timeout_s=60)
    deadline = time.monotonic() + 30
    while _committed(settings, Topic.STEPS.full(settings)) != 2 and time.monotonic() < deadline:
        time.sleep(0.3)
    assert _committed(settings, Topic.STEPS.full(settings)) == 2
    assert sink.scalar(f"SELECT count() FROM {{db}}.steps FINAL WHERE job_id = '{JOB}'") == 1
