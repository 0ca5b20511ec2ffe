"""Who may write what, on a real broker: the secure local broker of ``argus up --secure`` (SASL/SCRAM users per
role, the KRaft StandardAuthorizer, ``allow.everyone.if.no.acl.found=false``) with the ACLs of
:mod:`argus.kafka_acls`.

One broker of its own on free ports, in its own home, set up as ``argus up --secure`` sets it up
(:func:`argus.kafka_acls.secure_local_kafka`). Each role produces one message to every argus topic and is refused
(``TOPIC_AUTHORIZATION_FAILED`` as the delivery error) exactly where the table gives it no WRITE; a reader is
refused reading an input topic and reads the findings; the real worker process and the sink, each with its own
user, diagnose a simulated job end to end, whose findings the reader then follows; only the admin manages ACLs.
Last, ``argus up --secure`` as a user runs it, on a home and broker of its own: each service as its role's user,
a job simulated as the rank and diagnosed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer

from argus.core.errors import ArgusError
from argus.core.kafka_security import client_config, producer_config
from argus.core.settings import Settings
from argus.kafka_acls import READS, WRITES, acl_table, apply_acls, describe_acls, secure_local_kafka
from argus.kafka_users import Role, ensure_passwords, password_path, role_env, role_settings
from argus.local_kafka import LocalKafka
from argus.producers.control import ControlThread, RankControl
from argus.producers.faults import Fault
from argus.producers.publisher import Publisher
from argus.producers.seed_cases import paper_case
from argus.producers.simulator import JobSimulator
from argus.rank_control import make_command, send_command
from argus.schemas.control import ControlAction
from argus.sinks.clickhouse import ClickHouseStore
from argus.sinks.findings_feed import follow_findings
from argus.topics import Topic, ensure_topics
from load_tests.detection_eval import free_port
from tests.integration.conftest import SinkThread, WorkerProcess, fresh_settings

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    """The settings of a secure home (``kafka_secure``, no credentials of their own) whose broker runs with its
    users and ACLs."""
    if shutil.which("java") is None or shutil.which("mvn") is None:
        raise AssertionError("the local Kafka broker needs java and mvn on PATH")
    home = tmp_path_factory.mktemp("acl-home")
    tag = uuid.uuid4().hex[:8]
    base = Settings.load(env={}, home=home, bootstrap_servers=f"127.0.0.1:{free_port(pair=True)}",
                         kafka_secure=True, partitions=2, topic_prefix=f"a{tag}.", app_id=f"argus-acl-{tag}",
                         sink_group=f"sink-{tag}", clickhouse_database=f"acl_{tag}", session_timeout_s=6.0,
                         worker_web_port=free_port(), query_port=free_port(), sink_metrics_port=free_port(),
                         window_ns=1_000_000_000, allowed_lateness_ns=500_000_000, publisher_batch_events=2048)
    ensure_passwords(base)
    kafka = LocalKafka(base)
    kafka.start(timeout_s=120)
    try:
        admin = kafka.settings
        assert admin.kafka_sasl_username == "admin" and admin.kafka_sasl_mechanism == "SCRAM-SHA-512"
        assert len(ensure_topics(admin)) == len(Topic) + 1
        users, created, removed = secure_local_kafka(admin, base)
        assert sorted(users) == ["rank", "reader", "sink", "worker"]
        assert len(created) == len(acl_table(base)) and removed == []
        yield base
    finally:
        kafka.stop()


def _produce_errors(settings: Settings, topics: list[Topic]) -> dict[Topic, str | None]:
    """Produce one message to each topic as ``settings``' user (durable, idempotent, as every argus producer);
    each topic's delivery error name, or None where it was delivered."""
    producer = Producer(producer_config(settings.kafka, {"message.timeout.ms": 20000}))
    results: dict[str, str | None] = {}

    def on_delivery(err: KafkaError | None, msg: Message) -> None:
        results[str(msg.topic())] = None if err is None else err.name()

    for t in topics:
        producer.produce(t.full(settings), b"not a record", b"acl-test", on_delivery=on_delivery)
    assert producer.flush(40) == 0
    return {t: results[t.full(settings)] for t in topics}


def test_secrets_are_private(secure: Settings) -> None:
    assert stat.S_IMODE(os.stat(secure.home).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(secure.home / "secrets").st_mode) == 0o700
    for role in Role:
        assert stat.S_IMODE(os.stat(password_path(secure, role)).st_mode) == 0o600


def test_each_role_writes_exactly_its_topics(secure: Settings) -> None:
    """A second topic prefix on the same broker, its ACLs applied beside the first's: every role produces to
    every topic and is refused exactly where the table gives it no WRITE (the rank on findings among them)."""
    other = secure.replace(topic_prefix=f"m{uuid.uuid4().hex[:6]}.")
    admin = role_settings(other, Role.ADMIN)
    ensure_topics(admin)
    created, extra = apply_acls(admin)
    # Its topics' bindings are new (groups and the worker's own topics are the first prefix's); the first
    # prefix's topic bindings are "extra" to this table, and kept.
    assert set(created) == set(acl_table(other)) - set(acl_table(secure))
    assert set(extra) == set(acl_table(secure)) - set(acl_table(other))
    for role in (Role.RANK, Role.WORKER, Role.SINK):
        errors = _produce_errors(role_settings(other, role), list(Topic))
        refused = {t for t, e in errors.items() if e is not None}
        assert refused == set(Topic) - WRITES[role], role
        assert {errors[t] for t in refused} == {"TOPIC_AUTHORIZATION_FAILED"}, (role, errors)
    # The reader may write no topic at all, so its idempotent producer is refused a producer id: a fatal error.
    assert not WRITES[Role.READER]
    with pytest.raises(KafkaException, match="CLUSTER_AUTHORIZATION_FAILED"):
        _produce_errors(role_settings(other, Role.READER), list(Topic))
    rank = _produce_errors(role_settings(other, Role.RANK), [Topic.FINDINGS, Topic.KERNELS])
    assert rank == {Topic.FINDINGS: "TOPIC_AUTHORIZATION_FAILED", Topic.KERNELS: None}
    # The rank's own publisher (idempotent, acks=all) delivers its inputs: no IdempotentWrite needed.
    spec = paper_case(Fault.COMPUTE_STRAGGLER, job_id="acl-rank", steps=2)
    with Publisher(role_settings(other, Role.RANK), lossless=True) as pub:
        for rec in JobSimulator(spec, batch_events=512).records():
            assert pub.publish(rec.topic, rec.key, rec.record)
        assert pub.flush(30) == 0
        stats = pub.close()
    assert stats.failed == 0 and stats.delivered > 0


def test_the_admin_commands_running_ranks_and_the_rank_reads_them(secure: Settings) -> None:
    """argus control runs as the admin; a rank's control thread, as the rank user, reads its job's commands (by
    assignment, with its own group prefix) and may not write one."""
    cmd = make_command("acl-ctl", ControlAction.PAUSE_KERNELS, ranks=(1,))
    send_command(role_settings(secure, Role.ADMIN), cmd)
    with pytest.raises(ArgusError, match=r"TOPIC_AUTHORIZATION_FAILED|not written"):
        send_command(role_settings(secure, Role.RANK), make_command("acl-ctl", ControlAction.RESUME_KERNELS),
                     timeout_s=20)
    acks: list[tuple[str, str]] = []

    class Target:
        def pause_kernels(self, reason: object) -> None:
            pass

        def resume_kernels(self, reason: object) -> None:
            pass

        def set_runtime(self, key: str, value: float | int) -> None:
            pass

        def acknowledge(self, command_id: str, error: str) -> None:
            acks.append((command_id, error))

    thread = ControlThread(role_settings(secure, Role.RANK).replace(control_poll_s=0.2), "acl-ctl",
                           RankControl(1, 2, Target()))
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not acks and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        thread.stop()
    assert acks == [(cmd.command_id, "")] and thread.errors == 0


def _first_error(settings: Settings, topic: Topic, timeout_s: float = 30) -> tuple[str | None, bytes | None]:
    """Read ``topic`` from its start as ``settings``' user in a consumer group of the reader's prefix (``argus
    findings --follow``'s): (the first error's name, or the first message's value)."""
    consumer = Consumer(client_config(settings.kafka, {"group.id": f"{settings.app_id}-follow-{uuid.uuid4().hex[:6]}",
                                                       "enable.auto.commit": False, "auto.offset.reset": "earliest"}))
    try:
        consumer.subscribe([topic.full(settings)])
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            if msg.error() is not None:
                return msg.error().name(), None
            return None, msg.value()
        return None, None
    finally:
        consumer.close()


def test_worker_and_sink_diagnose_with_their_own_users(secure: Settings, chdb_store: ClickHouseStore,
                                                      tmp_path: Path) -> None:
    worker_settings = role_settings(secure, Role.WORKER).replace(home=tmp_path)
    assert worker_settings.kafka_sasl_username == "worker"
    worker = WorkerProcess(worker_settings, tmp_path / "worker.log")
    sink = None
    try:
        worker.wait_healthy()
        sink = SinkThread(role_settings(secure, Role.SINK), chdb_store)
        spec = paper_case(Fault.COMPUTE_STRAGGLER, job_id="acl-job", steps=20)
        records = list(JobSimulator(spec, batch_events=secure.publisher_batch_events).records())
        kernel_events = sum(len(r.record) for r in records if r.topic is Topic.KERNELS)
        with Publisher(role_settings(secure, Role.RANK), lossless=True) as pub:
            for rec in records:
                assert pub.publish(rec.topic, rec.key, rec.record)
            assert pub.flush(30) == 0
            assert pub.close().failed == 0
        sink.wait_for("SELECT sum(n_events) FROM {db}.kernel_summaries FINAL WHERE job_id = 'acl-job'",
                      kernel_events, timeout_s=120)
        # Every part of the diagnosis ran: L1/L2, and L3 on each partition of the summaries.
        diagnosed = "SELECT countIf({part}) FROM {{db}}.jobs FINAL WHERE job_id = 'acl-job' AND event = 'DIAGNOSED'"
        sink.wait_for(diagnosed.format(part="startsWith(part, 'l3/')"), secure.partitions, timeout_s=120)
        sink.wait_for(diagnosed.format(part="part = 'l1l2'"), 1, timeout_s=60)
        # The DIAGNOSED record names how many findings it wrote; the sink may store them after it.
        sink.wait_for("SELECT count() > 0 FROM {db}.findings FINAL WHERE job_id = 'acl-job'", 1, timeout_s=60)
        stored = sink.scalar("SELECT count() FROM {db}.findings FINAL WHERE job_id = 'acl-job'")
        assert sink.scalar("SELECT count() FROM {db}.dead_letters FINAL") == 0
        # The reader follows the worker's findings (argus findings --follow as user reader).
        followed = list(follow_findings(role_settings(secure, Role.READER), "acl-job", from_beginning=True,
                                        idle_timeout_s=5))
        assert len({f["finding_id"] for f in followed}) == stored
    finally:
        if sink is not None:
            sink.stop()
        worker.stop()
    # Nothing the worker does was refused (aiokafka says TopicAuthorizationFailedError, librdkafka ..._FAILED).
    assert not re.search(r"(?i)authorization_?failed", (tmp_path / "worker.log").read_text(errors="replace"))


def test_reader_reads_findings_only(secure: Settings) -> None:
    """After the job of the test before: the reader reads the worker's JSON findings, and is refused the
    inputs (metadata too) that hold the job's records."""
    reader = role_settings(secure, Role.READER)
    error, value = _first_error(reader, Topic.FINDINGS_JSON)
    assert error is None and value is not None and json.loads(value)["job"] == "acl-job"
    for topic in (Topic.KERNELS, Topic.STEPS, Topic.SUMMARIES):  # holding the job of the test before
        assert topic not in READS[Role.READER]
        assert _first_error(reader, topic)[0] == "TOPIC_AUTHORIZATION_FAILED", topic
        # Nor does the reader see the input topics in metadata.
        meta = Consumer(client_config(reader.kafka, {"group.id": "x"})).list_topics(topic.full(reader), timeout=10)
        assert meta.topics[topic.full(reader)].error.name() == "TOPIC_AUTHORIZATION_FAILED"


def test_only_the_admin_manages_acls(secure: Settings, kafka: str, tmp_path: Path) -> None:
    with pytest.raises(ArgusError, match="user 'rank' may not manage ACLs"):
        apply_acls(role_settings(secure, Role.RANK))
    # Nor do they see the bindings (Kafka 4.1 answers a user without DESCRIBE on the cluster with none).
    assert describe_acls(role_settings(secure, Role.READER)) == []
    assert len(describe_acls(role_settings(secure, Role.ADMIN))) >= len(acl_table(secure))
    # A broker without an authorizer (the session's PLAINTEXT test broker) says so.
    with pytest.raises(ArgusError, match="runs no authorizer"):
        apply_acls(fresh_settings(kafka, tmp_path))
    # The command: `argus acls` against the secure home takes its admin; `--describe` lists the table.
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("ARGUS_")}, **secure.to_env()}
    done = subprocess.run([sys.executable, "-m", "argus.cli", "acls"], env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("created 0 ACL binding(s)")
    shown = subprocess.run([sys.executable, "-m", "argus.cli", "acls", "--describe"], env=env, capture_output=True,
                           text=True, timeout=120, check=False)
    assert shown.returncode == 0, shown.stderr
    assert {str(a) for a in acl_table(secure)} <= set(shown.stdout.splitlines())
    # A role whose user has another name: its bindings for that user (the others' exist already).
    alice = subprocess.run([sys.executable, "-m", "argus.cli", "acls", "--user", "reader=alice"], env=env,
                           capture_output=True, text=True, timeout=120, check=False)
    assert alice.returncode == 0, alice.stderr
    readers = [a for a in acl_table(secure) if a.principal == "reader"]
    assert alice.stdout.startswith(f"created {len(readers)} ACL binding(s)"), alice.stdout
    assert f"+ User:alice READ topic {Topic.FINDINGS.full(secure)}\n" in alice.stdout
    # A rank's credentials given explicitly win over the home's admin: refused, one line, exit 1.
    as_rank = {**env, **role_env(secure, Role.RANK)}
    refused = subprocess.run([sys.executable, "-m", "argus.cli", "acls"], env=as_rank, capture_output=True,
                             text=True, timeout=120, check=False)
    assert refused.returncode == 1 and "user 'rank' may not manage ACLs" in refused.stderr, refused.stderr


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


def test_argus_up_secure(tmp_path: Path) -> None:
    """``argus up --secure`` as a user runs it: each service as its role's user, a job simulated as the rank
    and diagnosed, ``status`` healthy as the admin; ``--secure`` with three brokers refused clearly."""
    home = tmp_path / "home"
    settings = Settings.load(env={}, home=home, bootstrap_servers=f"127.0.0.1:{free_port(pair=True)}",
                             partitions=2, query_port=free_port(), worker_web_port=free_port(),
                             sink_metrics_port=free_port(), query_service_port=free_port(), session_timeout_s=6.0)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("ARGUS_")}, **settings.to_env()}
    three = subprocess.run([sys.executable, "-m", "argus.cli", "up", "--secure", "--brokers", "3"], env=env,
                           capture_output=True, text=True, timeout=60, check=False)
    assert three.returncode == 2 and "needs one broker" in three.stderr, three.stderr

    def argus(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "argus.cli", *args], env={**env, "ARGUS_KAFKA_SECURE": "1"},
                              capture_output=True, text=True, timeout=timeout, check=False)

    up = subprocess.run([sys.executable, "-m", "argus.cli", "up", "--secure"], env=env, capture_output=True,
                        text=True, timeout=300, check=False)
    try:
        assert up.returncode == 0, up.stderr
        assert "SASL/SCRAM users rank, worker, sink, reader" in up.stderr, up.stderr
        status = argus("status", "--json")
        assert status.returncode == 0, status.stdout + status.stderr
        doc = json.loads(status.stdout)
        for service, user in (("worker", "worker"), ("sink", "sink"), ("query-service", "reader")):
            child = _environ(doc[service]["pid"])
            assert child["ARGUS_KAFKA_SASL_USERNAME"] == user, service
            assert child["ARGUS_KAFKA_SASL_PASSWORD_FILE"] == str(password_path(settings, Role(user)))
            assert "ARGUS_KAFKA_SASL_PASSWORD" not in child
        # A plain `argus up` does not take the secure broker for its own.
        plain_up = subprocess.run([sys.executable, "-m", "argus.cli", "up"], env=env, capture_output=True,
                                  text=True, timeout=120, check=False)
        assert plain_up.returncode == 1 and "runs with --secure: use argus up --secure" in plain_up.stderr
        sim = argus("simulate", "--job", "secure-job", "--dp", "8", "--tp", "1", "--pp", "1", "--steps", "20",
                    "--fault", "case1")
        assert sim.returncode == 0, sim.stderr
        done = argus("findings", "--job", "secure-job", "--wait", "180", "--json")
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout), "case1 raises findings"
        for log in (home / "run").glob("*.log"):
            assert not re.search(r"(?i)authorization_?failed", log.read_text(errors="replace")), log
        # A plain status (no ARGUS_KAFKA_SECURE) still reaches the broker as the admin: up recorded it secure.
        plain = subprocess.run([sys.executable, "-m", "argus.cli", "status", "--json"], env=env,
                               capture_output=True, text=True, timeout=120, check=False)
        assert json.loads(plain.stdout)["kafka"]["healthy"], plain.stdout
    finally:
        down = argus("down")
    assert down.returncode == 0, down.stderr
