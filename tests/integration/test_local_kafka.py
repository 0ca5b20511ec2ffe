"""The project-managed local Kafka broker: start, reuse, produce/consume, stop.

Runs its own broker on a non-default port in a temporary home, so it never touches the broker a
developer keeps on the default port. The jar cache is the default one (``Settings.kafka_cache``), so
the jars are downloaded at most once per machine.
"""

from __future__ import annotations

import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from argus.core.settings import Settings
from argus.local_kafka import LocalKafka

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("java") is None or shutil.which("mvn") is None,
                       reason="the local Kafka broker needs java and mvn on PATH"),
]

PORT = 29092


@pytest.fixture
def kafka(tmp_path: Path) -> Iterator[LocalKafka]:
    settings = Settings.load(home=tmp_path / "argus-home", bootstrap_servers=f"127.0.0.1:{PORT}")
    broker = LocalKafka(settings)
    if broker.is_healthy():
        pytest.skip(f"another broker already answers on port {PORT}")
    try:
        yield broker
    finally:
        broker.stop()


@pytest.mark.timeout(180)
def test_start_produce_consume_reuse_stop(kafka: LocalKafka) -> None:
    from confluent_kafka import Consumer, Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    bootstrap = kafka.start(timeout_s=90)
    assert bootstrap == f"127.0.0.1:{PORT}"
    first = kafka.status()
    assert first["running"] and first["healthy"] and first["pid"]
    assert Path(first["log"]).is_file()

    t0 = time.monotonic()
    assert kafka.start() == bootstrap  # idempotent: reuses the healthy broker
    assert time.monotonic() - t0 < 5
    assert kafka.status()["pid"] == first["pid"]

    topic = f"test-local-kafka-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, 2, 1)])[topic].result(15)

    producer = Producer({"bootstrap.servers": bootstrap, "compression.type": "zstd"})
    producer.produce(topic, key=b"k", value=b"hello argus")
    assert producer.flush(15) == 0

    consumer = Consumer({
        "bootstrap.servers": bootstrap,
        "group.id": f"g-{topic}",
        "auto.offset.reset": "earliest",
        "session.timeout.ms": 6000,
    })
    try:
        consumer.subscribe([topic])
        deadline = time.monotonic() + 30
        value = None
        while value is None and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is not None and msg.error() is None:
                value = msg.value()
    finally:
        consumer.close()
    assert value == b"hello argus"

    kafka.stop()
    after = kafka.status()
    assert not after["running"] and after["pid"] is None
    assert not kafka.is_healthy()
    kafka.stop()  # stopping a stopped broker is not an error
