"""The ACL table of argus's Kafka principals and the per-role users of a secure home, without a broker (the
broker's enforcement: tests/integration/test_kafka_acls.py)."""

from __future__ import annotations

import os
import stat
from collections import defaultdict
from pathlib import Path

import pytest

from argus.core.errors import ConfigError
from argus.core.settings import Settings
from argus.kafka_acls import READS, WRITES, Operation, Pattern, Resource, acl_table
from argus.kafka_users import Role, ensure_passwords, password_path, role_env, role_settings
from argus.sinks.tables import TABLE_OF_TOPIC
from argus.supervisor import Service, Supervisor
from argus.topics import Topic

#: Who writes each topic, stated apart from the table (README's "Data flow" and each producer's code).
EXPECTED_WRITERS = {
    Topic.KERNELS: {"rank", "worker"},  # the worker: a job's end marker in every kernel partition
    Topic.STEPS: {"rank"}, Topic.PHASES: {"rank"}, Topic.TOPOLOGY: {"rank"},
    Topic.HEARTBEATS: {"rank"}, Topic.STACKS: {"rank"},
    Topic.LIFECYCLE: {"rank", "worker"},  # START/END from the tracer; DIAGNOSED/ABANDONED from the worker
    Topic.SUMMARIES: {"worker"}, Topic.FINDINGS: {"worker"}, Topic.FINDINGS_JSON: {"worker"},
    Topic.CONTEXT: {"worker"}, Topic.DEAD_LETTER: {"worker", "sink"},
}


def _by_topic(settings: Settings, op: Operation) -> dict[str, set[str]]:
    out: dict[str, set[str]] = defaultdict(set)
    for a in acl_table(settings):
        if a.resource is Resource.TOPIC and a.pattern is Pattern.LITERAL and a.operation is op:
            out[a.name].add(a.principal)
    return out


def test_every_topic_has_exactly_its_writers() -> None:
    settings = Settings.load(env={}, topic_prefix="p.")
    writers = _by_topic(settings, Operation.WRITE)
    # Every topic has a writer, no other name is written; argus control's commands are the admin's (a super user).
    assert set(writers) == {t.full(settings) for t in Topic if t is not Topic.CONTROL}
    for topic, who in EXPECTED_WRITERS.items():
        assert writers[topic.full(settings)] == who, topic
    assert writers["p.findings"] == writers["p.findings.json"] == {"worker"}  # no one else writes findings
    assert not WRITES[Role.READER]


def test_readers_of_each_topic() -> None:
    settings = Settings.load(env={})
    readers = _by_topic(settings, Operation.READ)
    assert set(READS[Role.SINK]) == set(TABLE_OF_TOPIC)  # the sink reads what it stores, nothing else
    assert readers[Topic.FINDINGS.full(settings)] == {"rank", "sink", "reader"}  # rank: argus stacks
    assert readers[Topic.FINDINGS_JSON.full(settings)] == {"reader"}
    assert readers[Topic.KERNELS.full(settings)] == {"worker"}
    for topic in READS[Role.READER]:
        assert topic in (Topic.FINDINGS, Topic.FINDINGS_JSON)
    # Every binding that lets a role read or write a topic lets it describe it too (clients need metadata).
    table = acl_table(settings)
    for a in table:
        if a.resource is Resource.TOPIC and a.operation is not Operation.DESCRIBE:
            assert any(b.operation is Operation.DESCRIBE and (b.principal, b.name, b.pattern) ==
                       (a.principal, a.name, a.pattern) for b in table), a


def test_groups_and_prefixes() -> None:
    settings = Settings.load(env={}, app_id="app", sink_group="snk")
    table = acl_table(settings, users={Role.READER: "alice"})
    groups = {(a.principal, a.name, a.pattern) for a in table if a.resource is Resource.GROUP}
    assert groups == {("rank", "app-stacks-", Pattern.PREFIXED), ("rank", "app-control-", Pattern.PREFIXED),
                      ("worker", "app", Pattern.LITERAL),
                      ("worker", "app-scan", Pattern.LITERAL), ("worker", "app-context-", Pattern.PREFIXED),
                      ("sink", "snk", Pattern.LITERAL), ("alice", "app-follow-", Pattern.PREFIXED)}
    assert all(a.operation is Operation.READ for a in table if a.resource is Resource.GROUP)
    prefixed_topics = {(a.principal, a.name) for a in table if a.resource is Resource.TOPIC
                       and a.pattern is Pattern.PREFIXED}
    assert prefixed_topics == {("worker", "app-")}  # Faust's own topics (its leader topic, changelogs)
    assert "admin" not in {a.principal for a in table}  # a super user
    with pytest.raises(ConfigError, match="overlap"):
        acl_table(Settings.load(env={}, app_id="argus", topic_prefix="argus-x."))


def test_passwords_are_private_and_kept(tmp_path: Path) -> None:
    home = tmp_path / "home"
    settings = Settings.load(env={}, home=home, kafka_secure=True)
    files = ensure_passwords(settings)
    assert set(files) == set(Role)
    assert stat.S_IMODE(os.stat(home).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(home / "secrets").st_mode) == 0o700
    first = {r: p.read_text() for r, p in files.items()}
    assert all(stat.S_IMODE(os.stat(p).st_mode) == 0o600 and len(first[r].strip()) == 48 for r, p in files.items())
    assert len(set(first.values())) == len(Role)
    assert {r: p.read_text() for r, p in ensure_passwords(settings).items()} == first  # kept, not rotated


def test_role_settings_and_env(tmp_path: Path) -> None:
    plain = Settings.load(env={}, home=tmp_path)
    assert role_settings(plain, Role.RANK) is plain and role_env(plain, Role.RANK) == {}
    secure = plain.replace(kafka_secure=True)
    with pytest.raises(ConfigError, match="argus up --secure"):
        role_settings(secure, Role.RANK)  # no password yet
    ensure_passwords(secure)
    rank = role_settings(secure, Role.RANK)
    assert (rank.kafka_security_protocol, rank.kafka_sasl_mechanism, rank.kafka_sasl_username) == (
        "SASL_PLAINTEXT", "SCRAM-SHA-512", "rank")
    assert rank.kafka_sasl_password.reveal() == password_path(secure, Role.RANK).read_text().strip()
    assert role_settings(rank, Role.ADMIN) is rank  # credentials already given win
    env = role_env(secure, Role.SINK)
    assert env["ARGUS_KAFKA_SASL_USERNAME"] == "sink"
    assert env["ARGUS_KAFKA_SASL_PASSWORD_FILE"] == str(password_path(secure, Role.SINK))
    assert not any(v == rank.kafka_sasl_password.reveal() for v in env.values())  # a file, never the value
    # The child's own settings from that environment: the role's user, secure stays on.
    child = Settings.load(env={**secure.to_env(), **env})
    assert child.kafka_sasl_username == "sink" and child.kafka_secure


def test_secure_needs_one_broker() -> None:
    with pytest.raises(ConfigError, match="needs one broker"):
        Settings.load(env={"ARGUS_KAFKA_SECURE": "1", "ARGUS_BROKERS": "3"})


def test_supervisor_starts_each_service_as_its_role(tmp_path: Path) -> None:
    settings = Settings.load(env={}, home=tmp_path, kafka_secure=True)
    ensure_passwords(settings)
    sup = Supervisor(settings)
    users = {s: sup.child_env(s)["ARGUS_KAFKA_SASL_USERNAME"] for s in Service}
    assert users == {Service.WORKER: "worker", Service.SINK: "sink", Service.QUERY_SERVICE: "reader"}
    for service in Service:
        env = sup.child_env(service)
        assert env["ARGUS_KAFKA_SASL_PASSWORD_FILE"] == str(password_path(settings, Role(users[service])))
        assert "ARGUS_KAFKA_SASL_PASSWORD" not in env
    plain = Supervisor(Settings.load(env={}, home=tmp_path / "plain"))
    env = plain.child_env(Service.WORKER)
    assert env["ARGUS_KAFKA_SECURITY_PROTOCOL"] == "PLAINTEXT" and env["ARGUS_KAFKA_SASL_USERNAME"] == ""
