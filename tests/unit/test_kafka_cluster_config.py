"""The local Kafka cluster's settings and node configuration, and the durable producer configuration every argus
producer takes (no broker: see tests/faults/test_cluster_failover.py for the real cluster)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from argus.core.errors import ConfigError, KafkaLocalError
from argus.core.kafka_security import DURABLE_PRODUCER, aiokafka_durable_config, producer_config
from argus.core.settings import Settings
from argus.local_kafka import LocalKafka, broker_nodes


def test_brokers_expand_bootstrap_and_replication() -> None:
    s = Settings.load(env={"ARGUS_BROKERS": "3", "ARGUS_BOOTSTRAP_SERVERS": "127.0.0.1:39400"})
    assert s.bootstrap_servers == "127.0.0.1:39400,127.0.0.1:39402,127.0.0.1:39404"
    assert (s.replication_factor, s.min_insync_replicas) == (3, 2)
    one = Settings.load(env={"ARGUS_BOOTSTRAP_SERVERS": "127.0.0.1:39400"})
    assert (one.brokers, one.replication_factor, one.min_insync_replicas) == (1, 1, 1)
    assert one.bootstrap_servers == "127.0.0.1:39400"
    # Explicit > env: --brokers 1 over ARGUS_BROKERS=3.
    assert Settings.load(env={"ARGUS_BROKERS": "3"}, brokers=1).brokers == 1
    # Two brokers: RF 2 with one in sync (two in sync would stop every producer when one fails).
    two = Settings.load(env={}, brokers=2)
    assert (two.replication_factor, two.min_insync_replicas) == (2, 1)
    assert len(two.bootstrap_servers.split(",")) == 2
    # A replication factor set explicitly is kept (within the brokers).
    assert Settings.load(env={"ARGUS_REPLICATION_FACTOR": "2"}, brokers=3).replication_factor == 2
    # Children get the cluster as it is (to_env): loading it again changes nothing.
    again = Settings.load(env=s.to_env())
    assert (again.brokers, again.bootstrap_servers, again.replication_factor) == (3, s.bootstrap_servers, 3)


@pytest.mark.parametrize(("env", "needle"), [
    ({"ARGUS_BROKERS": "0"}, "brokers must be in 1..9"),
    ({"ARGUS_BROKERS": "10"}, "brokers must be in 1..9"),
    ({"ARGUS_BROKERS": "x"}, "brokers"),
    ({"ARGUS_BROKERS": "3", "ARGUS_BOOTSTRAP_SERVERS": "h:1,h:3"}, "must list the 3 local brokers"),
    ({"ARGUS_BROKERS": "3", "ARGUS_REPLICATION_FACTOR": "4"}, "exceeds the 3 brokers"),
])
def test_bad_broker_settings_are_refused(env: dict[str, str], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        Settings.load(env=env)


def test_nodes_take_two_ports_each_and_must_not_overlap() -> None:
    nodes = broker_nodes(Settings.load(env={}, brokers=3, bootstrap_servers="127.0.0.1:39400"))
    assert [(n.node_id, n.port, n.controller_port) for n in nodes] == [(1, 39400, 39401), (2, 39402, 39403),
                                                                        (3, 39404, 39405)]
    with pytest.raises(KafkaLocalError, match="overlap"):
        broker_nodes(Settings.load(env={}, brokers=2, bootstrap_servers="h:100,h:101"))


def _props(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if line and not line.startswith("#"))


def test_cluster_nodes_are_configured_as_one_replicated_quorum(tmp_path: Path) -> None:
    settings = Settings.load(env={}, home=tmp_path, brokers=3, bootstrap_servers="127.0.0.1:39400")
    voters = broker_nodes(settings)
    nodes = [LocalKafka(settings, n, voters) for n in voters]
    for n in nodes:
        n._write_configs()
    props = [_props(n.properties_path) for n in nodes]
    assert [p["node.id"] for p in props] == ["1", "2", "3"]
    assert {p["controller.quorum.voters"] for p in props} == {
        "1@127.0.0.1:39401,2@127.0.0.1:39403,3@127.0.0.1:39405"}
    assert len({p["log.dirs"] for p in props}) == 3 and len({p["listeners"] for p in props}) == 3
    for p in props:
        for key in ("default.replication.factor", "offsets.topic.replication.factor",
                    "transaction.state.log.replication.factor"):
            assert p[key] == "3", key
        assert p["min.insync.replicas"] == p["transaction.state.log.min.isr"] == "2"
    assert len({n.cluster_id_path for n in nodes}) == 1  # one cluster id formatted into each
    assert [n.name for n in nodes] == ["kafka-1", "kafka-2", "kafka-3"]
    single = LocalKafka(Settings.load(env={}, home=tmp_path))
    single._write_configs()
    p1 = _props(single.properties_path)
    assert single.name == "kafka" and p1["node.id"] == "1" and p1["offsets.topic.replication.factor"] == "1"
    assert single.dir == (tmp_path / "kafka").resolve()


def test_a_cluster_refuses_sasl_clearly(tmp_path: Path) -> None:
    settings = Settings.load(env={}, home=tmp_path, brokers=3, kafka_security_protocol="SASL_PLAINTEXT",
                             kafka_sasl_mechanism="PLAIN", kafka_sasl_username="u", kafka_sasl_password="p")
    with pytest.raises(KafkaLocalError, match="PLAINTEXT only"):
        LocalKafka(settings)._write_configs()


def test_durable_producer_config_cannot_be_weakened() -> None:
    kafka = Settings.load(env={}).kafka
    conf = producer_config(kafka, {"linger.ms": 5, "acks": "all"})
    assert conf["acks"] == "all" and conf["enable.idempotence"] is True and conf["linger.ms"] == 5
    for weak in ({"acks": 1}, {"enable.idempotence": False}):
        with pytest.raises(ConfigError, match="nothing lost"):
            producer_config(kafka, weak)
    assert aiokafka_durable_config() == {"acks": "all", "enable_idempotence": True}


class _CapturedError(Exception):
    pass


def _capture(store: list[dict[str, Any]], stop: bool = False) -> Any:
    class Fake:
        def __init__(self, conf: dict[str, Any]) -> None:
            store.append(conf)
            if stop:
                raise _CapturedError

        def __getattr__(self, name: str) -> Any:
            return lambda *a, **k: 0

        def __len__(self) -> int:
            return 0

    return Fake


def _durable(conf: dict[str, Any]) -> bool:
    return all(conf.get(k) == v for k, v in DURABLE_PRODUCER.items())


def test_every_producer_is_durable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The rank-side publisher, the sink's dead letters, the replay's copier and Faust's producer all write
    with acks=all and idempotence, from the one DURABLE_PRODUCER."""
    import argus.producers.publisher as publisher
    import argus.replay as replay
    import argus.sinks.writer as writer
    from argus.streams.app import DurableProducer, create_app

    settings = Settings.load(env={}, home=tmp_path)
    seen: list[dict[str, Any]] = []
    monkeypatch.setattr(publisher, "Producer", _capture(seen))
    publisher.Publisher(settings, sender=False).close(timeout_s=0.1)
    monkeypatch.setattr(writer, "Producer", _capture(seen))
    monkeypatch.setattr(writer, "Consumer", _capture([]))
    writer.SinkWriter(settings, store=None)  # type: ignore[arg-type]
    monkeypatch.setattr(replay, "Consumer", _capture([]))
    monkeypatch.setattr(replay, "Producer", _capture(seen, stop=True))
    with pytest.raises(_CapturedError):
        replay.copy_job_records(settings, settings, "job")
    assert len(seen) == 3 and all(_durable(c) for c in seen), seen

    app = create_app(settings)
    producer = app.producer
    assert isinstance(producer, DurableProducer)

    async def build() -> Any:
        return producer._new_producer()

    aio = asyncio.run(build())
    assert aio._txn_manager is not None  # aiokafka's idempotence (a producer id, sequence numbers)
    assert aio._sender._acks == -1  # all
    assert producer._settings_extra()["enable_idempotence"] is True and producer.acks == -1


def test_the_supervisor_keeps_each_node_of_a_cluster(tmp_path: Path) -> None:
    from argus.supervisor import Service, Supervisor

    settings = Settings.load(env={}, home=tmp_path, brokers=3, supervisor_backoff_s=0.5)
    sup = Supervisor(settings)
    sup.run_dir.mkdir(parents=True)
    services = {s.value for s in Service}
    assert set(sup.states) == services | {"kafka-1", "kafka-2", "kafka-3"}
    sup._started("kafka-2", 4242)
    sup._exited("kafka-2", -9)
    state = sup.states["kafka-2"]
    assert state.state == "backoff" and state.last_exit is not None and state.last_exit["signal"] == "SIGKILL"
    assert sup.states["kafka-1"].state == sup.states["kafka-3"].state == "stopped"
    assert set(Supervisor(Settings.load(env={}, home=tmp_path)).states) == services | {"kafka"}


def test_status_folds_the_brokers_into_one_kafka_entry() -> None:
    from argus.stack import _brokers_view

    def broker(state: str | None, healthy: bool, restarts: int, at: str | None) -> dict[str, Any]:
        return {"supervised": True, "healthy": healthy, "foreign": False, "state": state, "restarts": restarts,
                "last_exit": None if at is None else {"signal": "SIGKILL", "at": at},
                "up_since": "2026-12-06T10:00:00+00:00", "uptime_s": 5.0}

    view = _brokers_view([broker("running", True, 0, None), broker("backoff", False, 2, "2026-12-06T10:01:00"),
                          broker("running", True, 1, "2026-12-06T10:00:30")])
    assert view["state"] == "backoff" and not view["healthy"] and view["restarts"] == 3
    assert view["last_exit"]["at"] == "2026-12-06T10:01:00" and view["supervised"] and not view["foreign"]
    whole = _brokers_view([broker("running", True, 0, None)] * 3)
    assert whole["state"] == "running" and whole["healthy"]


def test_down_stops_every_broker_of_the_home_whatever_the_count(tmp_path: Path) -> None:
    """``stop_local_brokers`` (what ``argus down`` ends with) stops the single broker and the nodes of any cluster
    started from the home, and never a process that only took a broker's old pid."""
    import subprocess
    import sys

    from argus.kafka_cluster import stop_local_brokers
    from argus.local_kafka import pid_alive

    def fake_broker(*argv: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", *argv])

    procs = {"kafka/kafka.pid": fake_broker("kafka.Kafka"),
             "kafka/cluster3/node2/kafka.pid": fake_broker("kafka.Kafka"),
             "kafka/cluster3/node3/kafka.pid": fake_broker("something.Else")}
    try:
        for rel, proc in procs.items():
            (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / rel).write_text(f"{proc.pid}\n")
        stopped = stop_local_brokers(tmp_path, timeout_s=10)
        assert sorted(stopped) == sorted(p.pid for r, p in procs.items() if "node3" not in r)
        for rel, proc in procs.items():
            alive = proc.poll() is None and pid_alive(proc.pid)
            assert alive == ("node3" in rel), rel
        assert not (tmp_path / "kafka/kafka.pid").exists()
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()


def test_up_brokers_option_over_the_environment(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    import argus.stack
    from argus.cli import main

    seen: list[Settings] = []

    class FakeStack:
        def __init__(self, settings: Settings) -> None:
            seen.append(settings)

        def up(self, progress: Any = None) -> dict[str, Any]:
            return {}

    monkeypatch.setattr(argus.stack, "Stack", FakeStack)
    monkeypatch.setenv("ARGUS_BROKERS", "2")
    monkeypatch.setenv("ARGUS_BOOTSTRAP_SERVERS", "127.0.0.1:39400")
    monkeypatch.delenv("ARGUS_REPLICATION_FACTOR", raising=False)
    assert main(["up", "--brokers", "3"]) == 0
    assert main(["up"]) == 0
    assert [(s.brokers, s.replication_factor, len(s.bootstrap_servers.split(","))) for s in seen] == [
        (3, 3, 3), (2, 2, 2)]
    with pytest.raises(SystemExit) as exc:  # not a count at all: argparse's usage error
        main(["up", "--brokers", "0"])
    assert exc.value.code == 2 and "must be in 1..65536, got 0" in capsys.readouterr().err
    assert main(["up", "--brokers", "12"]) == 2  # more than a local cluster runs: the settings' check
    assert "brokers must be in 1..9" in capsys.readouterr().err
