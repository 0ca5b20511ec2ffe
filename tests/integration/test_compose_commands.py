"""docker-compose.yml run without Docker: its Kafka configuration on a real broker, and each argus service's
command with the service's own environment and secrets, checked by the service's own health check.

There is no Docker engine here, so the compose file is read with PyYAML (:mod:`tests.compose_config`) and
each piece runs as a local process:

* **Secrets.** ``deploy/make-secrets --dir <tmp>/secrets localhost`` writes the files; ``/run/secrets/<name>``
  becomes ``<tmp>/secrets/<name>`` (the file of the compose secret ``<name>``), and only for secrets the
  service lists.
* **Kafka.** The ``kafka`` service's ``KAFKA_*`` environment becomes ``server.properties`` as the apache/kafka
  image renders it, and the broker runs from the project's Kafka jars (``argus.local_kafka.fetch_jars``, the
  image's version). Its ports 9092 (INTERNAL, ``kafka:9092``), 9094 (EXTERNAL) and 9093 (CONTROLLER) become
  free loopback ports (a module-scoped broker of its own, not the session's PLAINTEXT test broker: compose's
  listeners are SASL_SSL); the host ``kafka`` and the all-interfaces bind become 127.0.0.1;
  ``ARGUS_KAFKA_EXTERNAL_HOST`` is ``localhost``, so a rank reaches the external listener by a DNS name of
  the certificate; ``log.dirs`` is a temporary directory. Everything else (TLS, SASL/PLAIN, the
  FileConfigProvider references, the PEM key store, the authorizer and its super users) is the file's.
* **ACLs.** The ``topics`` service (``argus topics --acls``, as user admin) grants each user its bindings; the
  worker, the sink and the cli then run as their own users (worker, sink, reader), and a rank is refused
  producing to the findings and summaries topics.
* **argus services.** ``ARGUS_BOOTSTRAP_SERVERS=kafka:9092`` becomes the INTERNAL port;
  ``ARGUS_CLICKHOUSE_DSN=http://clickhouse:8123`` becomes an embedded chDB (no ClickHouse server here; the
  sink owns it and serves its SQL, so every service shares one ``ARGUS_HOME`` for the sink's query token);
  ``0.0.0.0`` binds become 127.0.0.1; the ports of their endpoints (``ARGUS_WORKER_WEB_PORT``,
  ``ARGUS_SINK_METRICS_PORT``, ``ARGUS_QUERY_PORT``, ``ARGUS_QUERY_SERVICE_PORT``) become free ports, one per
  setting for all services (containers have a port space each; here the cli must find the sink's endpoint);
  ``ARGUS_PARTITIONS`` 32 becomes 4 and ``ARGUS_SESSION_TIMEOUT_S`` 6 (a worker's group join on 2 cores).
  The command is the service's ``command`` after the image's entrypoint ``argus`` (``python -m argus.cli``);
  its health check is the service's ``healthcheck.test`` (``CMD python ...`` run with this interpreter, with
  the service's environment).

``test_query_service_command`` runs the ``query`` service's ``argus query-service``: it passes once that
subcommand exists (issue 33's query service), and fails before.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from argus.core.settings import Settings
from argus.local_kafka import fetch_jars
from argus.producers.publisher import Publisher
from argus.producers.simulator import JobSimulator, JobSpec
from argus.topics import Topic
from load_tests.detection_eval import free_port
from tests.compose_config import ROOT, compose, interpolate, kafka_properties, secret_files
from tests.dashboards import exported_names, metric_names

pytestmark = pytest.mark.integration

EXTERNAL_HOST = "localhost"
#: Compose's container ports of the kafka service's listeners.
_KAFKA_PORTS = {"INTERNAL": 9092, "CONTROLLER": 9093, "EXTERNAL": 9094}
_RULES = ROOT / "deploy/prometheus/rules/argus.yml"


@dataclass
class ComposeStack:
    """The compose file's Kafka running locally, and how a service's environment maps onto this machine."""

    tmp: Path
    secrets: Path
    ports: dict[int, int]
    home: Path
    #: One free port per port setting, the same in every service (the cli reaches the sink's SQL endpoint).
    setting_ports: dict[str, int] = field(default_factory=dict)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def internal(self) -> str:
        return f"127.0.0.1:{self.ports[_KAFKA_PORTS['INTERNAL']]}"

    @property
    def external(self) -> str:
        return f"{EXTERNAL_HOST}:{self.ports[_KAFKA_PORTS['EXTERNAL']]}"

    def secret_path(self, service: Mapping[str, Any], value: str) -> str:
        """``/run/secrets/<name>`` as the local file; the service must list the secret."""
        def sub(m: re.Match[str]) -> str:
            name = m.group(1)
            assert name in service.get("secrets", []), f"{value} names secret {name!r} the service does not list"
            return str(self.secrets / Path(secret_files()[name]).name)

        return re.sub(r"/run/secrets/([A-Za-z0-9_.-]+)", sub, value)

    def service_env(self, name: str) -> dict[str, str]:
        """The ``ARGUS_*`` environment of compose service ``name`` on this machine (see the module doc)."""
        service = compose()["services"][name]
        env: dict[str, str] = {}
        for key, raw in service["environment"].items():
            value = self.secret_path(service, interpolate(str(raw), os.environ))
            if key == "ARGUS_BOOTSTRAP_SERVERS":
                assert value == "kafka:9092", value
                value = self.internal
            elif key == "ARGUS_CLICKHOUSE_DSN":
                assert value == "http://clickhouse:8123", value
                value = f"chdb://{self.tmp / 'chdb'}"
            elif value == "0.0.0.0":
                value = "127.0.0.1"
            elif key == "ARGUS_PARTITIONS":
                value = "4"
            env[key] = value
        for key in ("ARGUS_WORKER_WEB_PORT", "ARGUS_SINK_METRICS_PORT", "ARGUS_QUERY_PORT",
                    "ARGUS_QUERY_SERVICE_PORT"):
            env[key] = str(self.setting_ports.setdefault(key, free_port()))
        env.update(ARGUS_HOME=str(self.home), ARGUS_SESSION_TIMEOUT_S="6")
        return env

    def process_env(self, name: str) -> dict[str, str]:
        """This process's environment without its own ``ARGUS_*`` settings, plus the service's."""
        base = {k: v for k, v in os.environ.items() if not k.startswith("ARGUS_")}
        base["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        return {**base, **self.service_env(name)}

    def run(self, name: str, *args: str, timeout_s: float = 180) -> subprocess.CompletedProcess[str]:
        """Run service ``name``'s command (or ``args`` in its place, as ``docker compose run``) to its end."""
        command = list(args) or [str(a) for a in compose()["services"][name]["command"]]
        return subprocess.run([sys.executable, "-m", "argus.cli", *command], env=self.process_env(name),
                              capture_output=True, text=True, timeout=timeout_s, check=False)

    def start(self, name: str) -> subprocess.Popen[bytes]:
        command = [str(a) for a in compose()["services"][name]["command"]]
        log = open(self.tmp / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process's end
        proc = subprocess.Popen([sys.executable, "-m", "argus.cli", *command], env=self.process_env(name),
                                stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.procs.append(proc)
        return proc

    def check(self, name: str) -> subprocess.CompletedProcess[str]:
        """Run the service's own health check once (the argus image's checks run its Python)."""
        test = compose()["services"][name]["healthcheck"]["test"]
        assert test[:2] == ["CMD", "python"], test
        return subprocess.run([sys.executable, *test[2:]], env=self.process_env(name), capture_output=True,
                              text=True, timeout=30, check=False)

    def healthy(self, name: str, proc: subprocess.Popen[bytes], timeout_s: float = 120) -> None:
        """Wait until the service's own health check passes (the process must stay up meanwhile)."""
        deadline = time.monotonic() + timeout_s
        while True:
            check = self.check(name)
            if check.returncode == 0:
                return
            if proc.poll() is not None or time.monotonic() > deadline:
                log = (self.tmp / f"{name}.log").read_text(errors="replace")[-3000:]
                raise AssertionError(f"{name} never passed its health check (exit {proc.poll()}): "
                                     f"{check.stderr[-600:]}\n--- {name} log ---\n{log}")
            time.sleep(1)

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()


def _broker_properties(stack: ComposeStack) -> dict[str, str]:
    kafka = compose()["services"]["kafka"]
    props = kafka_properties(kafka, {"ARGUS_KAFKA_EXTERNAL_HOST": EXTERNAL_HOST})

    def endpoint(m: re.Match[str]) -> str:
        host, port = m.group(2), int(m.group(3))
        host = EXTERNAL_HOST if host == EXTERNAL_HOST else "127.0.0.1"  # kafka, 127.0.0.1 or all interfaces
        return f"{m.group(1)}{host}:{stack.ports[port]}"

    for key in ("listeners", "advertised.listeners", "controller.quorum.voters"):
        props[key] = re.sub(r"(//|@)([A-Za-z0-9.-]*):(\d+)", endpoint, props[key])
    props = {k: stack.secret_path(kafka, v) for k, v in props.items()}
    assert props["log.dirs"] == "/var/lib/kafka/data"
    assert kafka["volumes"] == ["kafka-data:/var/lib/kafka/data"]  # the data outlives the container
    props["log.dirs"] = str(stack.tmp / "kafka-data")
    return props


def _admin_config(stack: ComposeStack) -> dict[str, str]:
    """The broker health check's client (kafka_client_config, Java properties) for confluent-kafka."""
    text = (stack.secrets / "kafka_client_config").read_text()
    props = dict(line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#"))
    creds = dict(re.findall(r'(username|password)="([^"]*)"', props["sasl.jaas.config"]))
    assert props["ssl.truststore.type"] == "PEM"
    return {"bootstrap.servers": stack.internal, "security.protocol": props["security.protocol"].lower(),
            "sasl.mechanism": props["sasl.mechanism"], "sasl.username": creds["username"],
            "sasl.password": creds["password"],
            "ssl.ca.location": stack.secret_path({"secrets": ["kafka_ca"]}, props["ssl.truststore.location"])}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComposeStack]:
    if shutil.which("java") is None:
        raise AssertionError("the compose file's Kafka runs from the Kafka jars: Java 17+ must be on PATH")
    tmp = tmp_path_factory.mktemp("compose")
    secrets = tmp / "secrets"
    made = subprocess.run([str(ROOT / "deploy/make-secrets"), "--dir", str(secrets), EXTERNAL_HOST],
                          capture_output=True, text=True, check=False)
    assert made.returncode == 0, made.stderr
    ports = {port: free_port() for port in _KAFKA_PORTS.values()}
    st = ComposeStack(tmp=tmp, secrets=secrets, ports=ports, home=tmp / "home")
    props = _broker_properties(st)
    config = tmp / "server.properties"
    config.write_text("".join(f"{k}={v}\n" for k, v in props.items()))
    libs = fetch_jars(Settings.load(env={}))
    java = [shutil.which("java") or "java", "-Xmx512m", "-cp", f"{libs}/*"]
    cluster_id = compose()["services"]["kafka"]["environment"]["CLUSTER_ID"]
    fmt = subprocess.run([*java, "kafka.tools.StorageTool", "format", "-t", cluster_id, "-c", str(config)],
                         capture_output=True, text=True, timeout=120, check=False)
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr
    broker_log = open(tmp / "kafka.log", "wb")  # noqa: SIM115 - closed below
    broker = subprocess.Popen([*java, "kafka.Kafka", str(config)], stdout=broker_log, stderr=subprocess.STDOUT)
    broker_log.close()
    try:
        from confluent_kafka.admin import AdminClient

        deadline = time.monotonic() + 120
        while True:  # healthy: the health check's own credentials list the topics over TLS
            try:
                AdminClient({**_admin_config(st), "log_level": 0}).list_topics(timeout=5)
                break
            except Exception as exc:
                if broker.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"compose's Kafka did not start: {exc}\n"
                                         + (tmp / "kafka.log").read_text(errors="replace")[-4000:]) from exc
                time.sleep(1)
        yield st
    finally:
        st.stop_all()
        broker.terminate()
        try:
            broker.wait(30)
        except subprocess.TimeoutExpired:
            broker.kill()
            broker.wait()


def _rank_settings(stack: ComposeStack, password: str | None = None) -> Settings:
    """A training rank's settings, as docs/deploy.md tells them: the external listener, user ``rank``."""
    return Settings.load(env={
        "ARGUS_BOOTSTRAP_SERVERS": stack.external, "ARGUS_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
        "ARGUS_KAFKA_SASL_MECHANISM": "PLAIN", "ARGUS_KAFKA_SASL_USERNAME": "rank",
        "ARGUS_KAFKA_SASL_PASSWORD": password or (stack.secrets / "kafka_rank_password").read_text().strip(),
        "ARGUS_KAFKA_SSL_CA_FILE": str(stack.secrets / "kafka_ca"), "ARGUS_PARTITIONS": "4",
        "ARGUS_HOME": str(stack.tmp / "rank-home")})


def _rank_produce(stack: ComposeStack, topic: Topic) -> str | None:
    """One message to ``topic`` as user rank through the external listener: its delivery error's name, or None."""
    from confluent_kafka import Producer

    from argus.core.kafka_security import producer_config

    settings = _rank_settings(stack)
    errors: list[str | None] = []
    producer = Producer(producer_config(settings.kafka, {"message.timeout.ms": 20000}))
    producer.produce(topic.full(settings), b"forged", b"job",
                     on_delivery=lambda err, _msg: errors.append(None if err is None else err.name()))
    assert producer.flush(40) == 0
    return errors[0]


def test_kafka_listeners_take_sasl_ssl_only(stack: ComposeStack) -> None:
    from confluent_kafka.admin import AdminClient

    from argus.core.errors import ArgusError
    from argus.core.kafka_security import client_config
    from argus.topics import ensure_topics

    # The external listener, by the name the certificate carries, as user rank; a wrong password is refused.
    metadata = AdminClient(client_config(_rank_settings(stack).kafka)).list_topics(timeout=30)
    assert [b.host for b in metadata.brokers.values()] == [EXTERNAL_HOST]  # what it advertises to ranks
    with pytest.raises(ArgusError, match="refused SASL user 'rank' \\(PLAIN\\)"):
        ensure_topics(_rank_settings(stack, password="not-the-password"), timeout_s=10)
    # No plaintext and no anonymous TLS client gets metadata from either listener.
    for bootstrap in (stack.internal, stack.external):
        for extra in ({"security.protocol": "plaintext"},
                      {"security.protocol": "ssl", "ssl.ca.location": str(stack.secrets / "kafka_ca")}):
            with pytest.raises(Exception):  # noqa: B017 - confluent's KafkaException, whatever the failure
                AdminClient({"bootstrap.servers": bootstrap, "log_level": 0, **extra}).list_topics(timeout=4)


def test_every_argus_command_runs_with_its_compose_environment(stack: ComposeStack) -> None:
    from argus.kafka_acls import acl_table

    topics = stack.run("topics")  # topics, then the ACLs, as the admin
    assert topics.returncode == 0, topics.stderr[-3000:]
    table = acl_table(Settings.load(env={}))
    assert f"created {len(table)} ACL binding(s)" in topics.stdout, topics.stdout
    again = stack.run("topics")  # idempotent, as a restarted one-shot runs it
    assert again.returncode == 0 and "created 0 ACL binding(s)" in again.stdout, again.stdout + again.stderr

    worker, sink = stack.start("worker"), stack.start("sink")
    stack.healthy("worker", worker)
    stack.healthy("sink", sink)

    # A job published as the ranks publish: the external listener, user rank.
    spec = JobSpec("compose-job", dp=2, steps=8, layers=1, microbatches=1)
    records = list(JobSimulator(spec, batch_events=1024).records())
    with Publisher(_rank_settings(stack), lossless=True) as pub:
        for rec in records:
            assert pub.publish(rec.topic, rec.key, rec.record)
        assert pub.flush(60) == 0
    # ... and the rank may write the inputs only: a forged finding is refused by the broker.
    assert _rank_produce(stack, Topic.FINDINGS) == "TOPIC_AUTHORIZATION_FAILED"
    assert _rank_produce(stack, Topic.SUMMARIES) == "TOPIC_AUTHORIZATION_FAILED"

    # The cli service: its own command, then a query as `docker compose run --rm cli sql ... --json` runs it.
    deadline, rows = time.monotonic() + 180, 0
    while rows != spec.world_size * spec.steps:
        assert time.monotonic() < deadline, f"steps stored: {rows}"
        out = stack.run("cli", "sql", "SELECT count() AS n FROM argus.steps FINAL", "--json", timeout_s=60)
        assert out.returncode == 0, out.stderr[-2000:]
        rows = json.loads(out.stdout)[0]["n"]
        time.sleep(1)
    shown = stack.run("cli")
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert {"steps", "findings", "kernel_summaries"} <= set(shown.stdout.split())

    # Every argus_* metric an alert rule reads is served by the real worker's or sink's /metrics.
    worker_env, sink_env = stack.service_env("worker"), stack.service_env("sink")
    exported: set[str] = set()
    for url in (f"http://127.0.0.1:{worker_env['ARGUS_WORKER_WEB_PORT']}/metrics",
                f"http://127.0.0.1:{sink_env['ARGUS_SINK_METRICS_PORT']}/metrics"):
        with urllib.request.urlopen(url, timeout=10) as resp:
            text = resp.read().decode()
        assert list(text_string_to_metric_families(text))
        exported |= exported_names(text)
    rules = [r for g in yaml.safe_load(_RULES.read_text())["groups"] for r in g["rules"]]
    used = set().union(*(metric_names(r["expr"]) for r in rules))
    assert used and used <= exported, sorted(used - exported)
    assert worker.poll() is None and sink.poll() is None

    # The checks fail once their service is gone (so that compose restarts or reports it).
    stack.stop_all()
    assert stack.check("worker").returncode != 0 and stack.check("sink").returncode != 0


def test_query_service_command(stack: ComposeStack) -> None:
    """The ``query`` service's ``argus query-service`` answers its health check (``GET /ping`` -> ``Ok.``)."""
    assert stack.check("query").returncode != 0  # nothing answers before it starts
    query = stack.start("query")
    stack.healthy("query", query, timeout_s=90)
