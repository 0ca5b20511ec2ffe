"""Kafka with SASL/SCRAM: every kind of argus client authenticates with the same settings, and a wrong
password is refused with an error that says so.

One local broker of its own (a SASL_PLAINTEXT listener, SCRAM-SHA-256, the user created when its storage is
formatted; the controller listener takes SASL/PLAIN), on free ports, in its own home. Through it: topic
creation (confluent admin), the rank-side publisher (confluent producer), the real Faust worker process
(aiokafka consumer and producer: it must read the kernels and deliver their summaries) and the sink
(confluent consumer, into chDB). A password with a comma, a quote, a backslash and a non-ASCII letter checks
the quoting of the broker's configuration.
"""

from __future__ import annotations

import os
import shutil
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from argus.core.errors import ArgusError, KafkaLocalError
from argus.core.settings import Secret, Settings
from argus.local_kafka import LocalKafka, fetch_jars
from argus.producers.publisher import Publisher
from argus.producers.simulator import JobSimulator, JobSpec
from argus.sinks.clickhouse import ClickHouseStore
from argus.topics import Topic, ensure_topics
from load_tests.detection_eval import free_port
from tests.integration.conftest import SinkThread, WorkerProcess

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("java") is None or shutil.which("mvn") is None,
                       reason="the local Kafka broker needs java and mvn on PATH"),
]

USER = "argus-it"
PASSWORD = 'pa,ss"w\\ord é ' + uuid.uuid4().hex[:8]


def _sasl_settings(home: Path, port: int, **overrides: object) -> Settings:
    values: dict[str, object] = {
        "home": home, "bootstrap_servers": f"127.0.0.1:{port}", "kafka_security_protocol": "SASL_PLAINTEXT",
        "kafka_sasl_mechanism": "SCRAM-SHA-256", "kafka_sasl_username": USER, "kafka_sasl_password": PASSWORD,
        "partitions": 2,
    }
    values.update(overrides)
    return Settings.load(env={}, **values)


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalKafka]:
    home = tmp_path_factory.mktemp("sasl-home")
    kafka = LocalKafka(_sasl_settings(home, free_port(pair=True)))
    kafka.start(timeout_s=120)
    try:
        yield kafka
    finally:
        kafka.stop()


def test_every_client_authenticates_with_scram(broker: LocalKafka, chdb_store: ClickHouseStore,
                                               tmp_path: Path) -> None:
    assert stat.S_IMODE(os.stat(broker.properties_path).st_mode) == 0o600  # it holds the password
    tag = uuid.uuid4().hex[:8]
    settings = broker.settings.replace(
        topic_prefix=f"s{tag}.", app_id=f"argus-sasl-{tag}", sink_group=f"sink-{tag}",
        clickhouse_database=f"sasl_{tag}", session_timeout_s=6.0, worker_web_port=free_port(pair=True), home=tmp_path,
        window_ns=1_000_000_000, allowed_lateness_ns=500_000_000, publisher_batch_events=1024)
    assert len(ensure_topics(settings)) == len(Topic) + 1

    worker = WorkerProcess(settings, tmp_path / "worker.log")  # Faust/aiokafka, settings from the environment
    sink = None
    try:
        worker.wait_healthy()
        sink = SinkThread(settings, chdb_store)  # the sink's confluent consumer and dead-letter producer
        spec = JobSpec("sasl-job", dp=2, steps=8, layers=1, microbatches=1)
        records = list(JobSimulator(spec, batch_events=settings.publisher_batch_events).records())
        kernel_events = sum(len(r.record) for r in records if r.topic is Topic.KERNELS)
        with Publisher(settings, lossless=True) as pub:  # the rank-side publisher
            for rec in records:
                assert pub.publish(rec.topic, rec.key, rec.record)
            assert pub.flush(30) == 0
            stats = pub.close()
        assert stats.failed == 0 and stats.delivered == len(records)
        # The worker read the kernels and delivered their summaries; the sink read and stored them.
        sink.wait_for("SELECT sum(n_events) FROM {db}.kernel_summaries FINAL WHERE job_id = 'sasl-job'",
                      kernel_events)
        sink.wait_for("SELECT count() FROM {db}.steps FINAL", spec.world_size * spec.steps)
        assert sink.scalar("SELECT count() FROM {db}.dead_letters FINAL") == 0
    finally:
        if sink is not None:
            sink.stop()
        worker.stop()


def test_wrong_credentials_are_refused_clearly(broker: LocalKafka) -> None:
    wrong = broker.settings.replace(kafka_sasl_password=Secret("not-the-password"))
    with pytest.raises(ArgusError, match=rf"refused SASL user '{USER}' \(SCRAM-SHA-256\).*Authentication failed"):
        ensure_topics(wrong, timeout_s=8)
    with pytest.raises(KafkaLocalError, match="refused SASL user"):
        LocalKafka(wrong).start(timeout_s=30)  # the running broker of this home, with the wrong password
    assert broker.is_healthy()  # ... was left running
    plaintext = Settings.load(env={}, bootstrap_servers=broker.settings.bootstrap_servers)
    with pytest.raises(ArgusError):  # no unauthenticated access
        ensure_topics(plaintext, timeout_s=5)
    # SCRAM users are created with the storage: a formatted one refuses to start for another password.
    with pytest.raises(KafkaLocalError, match="formatted without SCRAM user"):
        LocalKafka(wrong)._format(fetch_jars(wrong))
