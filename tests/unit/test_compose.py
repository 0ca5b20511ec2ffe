"""docker-compose.yml parses, and every argus service runs a command the CLI has."""

from __future__ import annotations

import os
import re
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from argus.cli import _parser
from tests.compose_config import ComposeError, argus_services, interpolate, kafka_properties, secret_files

ROOT = Path(__file__).resolve().parents[2]


def _subcommands() -> set[str]:
    sub = next(a for a in _parser()._actions if a.dest == "command")
    return set(sub.choices)  # type: ignore[arg-type]


def test_compose_parses_and_names_existing_commands() -> None:
    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = doc["services"]
    assert {"kafka", "clickhouse", "worker", "sink"} <= set(services)
    argus_services = [s for s in services.values() if "build" in s]
    assert argus_services
    for svc in argus_services:  # their commands: test_every_argus_service_runs_an_argus_subcommand
        env = svc["environment"]
        assert env["ARGUS_CLICKHOUSE_DSN"].startswith("http://")
        assert all(k.startswith("ARGUS_") for k in env)
    assert services["kafka"]["image"].startswith("apache/kafka:4.")
    assert services["clickhouse"]["image"].startswith("clickhouse/clickhouse-server:")


def test_published_ports_bind_loopback_only_but_kafkas_external_listener() -> None:
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    published = [(name, p) for name, svc in services.items() for p in svc.get("ports", [])]
    assert published  # ClickHouse's HTTP port at least, for `argus sql` from the host
    # The one port for other hosts: the ranks' SASL_SSL listener (test_kafka_listeners_are_sasl_ssl).
    assert ("kafka", "9094:9094") in published
    for name, port in published:
        if (name, port) == ("kafka", "9094:9094"):
            continue
        if isinstance(port, dict):  # long syntax
            assert port.get("host_ip") == "127.0.0.1", (name, port)
        else:
            assert str(port).startswith("127.0.0.1:"), (name, port)


def test_dockerfile_copies_every_package() -> None:
    # One package: the stages live inside argus/ (docs/internals/layout.md).
    text = (ROOT / "Dockerfile").read_text()
    assert "COPY argus ./argus" in text
    for stage in ("producers", "streams", "sinks", "detectors", "schemas"):
        assert (ROOT / "argus" / stage / "__init__.py").is_file() and not (ROOT / stage).exists()


def _compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_prometheus_and_grafana_services() -> None:
    services = _compose()["services"]
    assert services["prometheus"]["image"].startswith("prom/prometheus:")
    assert services["grafana"]["image"].startswith("grafana/grafana:")
    # The ClickHouse plugin at an exact version ("<id> <version>", as Grafana's image installs it).
    assert re.fullmatch(r"grafana-clickhouse-datasource \d+\.\d+\.\d+",
                        services["grafana"]["environment"]["GF_INSTALL_PLUGINS"])
    # The worker's and the sink's metrics listen on the compose network (not published on the host).
    for name in ("worker", "sink"):
        assert services[name]["environment"]["ARGUS_METRICS_HOST"] == "0.0.0.0"
        assert not services[name].get("ports")


def test_every_bind_mounted_file_exists() -> None:
    mounts = [(name, v.split(":")[0]) for name, svc in _compose()["services"].items()
              for v in svc.get("volumes", []) if isinstance(v, str) and v.startswith("./")]
    assert {name for name, _ in mounts} >= {"prometheus", "grafana"}
    for name, host_path in mounts:
        assert (ROOT / host_path).exists(), (name, host_path)
    assert (ROOT / "deploy/grafana/dashboards/argus.json").is_file()


def _container_path(service: str, host_path: str) -> str:
    for v in _compose()["services"][service]["volumes"]:
        parts = v.split(":")
        if parts[0] == host_path:
            return parts[1]
    raise AssertionError(f"{host_path} not mounted in {service}")


def test_prometheus_scrapes_the_worker_and_sink_on_their_metrics_ports() -> None:
    from argus.core.settings import Settings

    defaults = Settings.load(env={})
    config_path = _container_path("prometheus", "./deploy/prometheus/prometheus.yml")
    assert f"--config.file={config_path}" in _compose()["services"]["prometheus"]["command"]
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    services = _compose()["services"]
    for job, service, port in (("argus-worker", "worker", defaults.worker_web_port),
                               ("argus-sink", "sink", defaults.sink_metrics_port)):
        sd = jobs[job]["dns_sd_configs"][0]
        assert sd["names"] == [service] and sd["port"] == port and service in services
        assert jobs[job].get("metrics_path", "/metrics") == "/metrics"
    publishers = jobs["argus-publisher"]["file_sd_configs"][0]["files"][0]
    assert publishers.startswith(_container_path("prometheus", "./deploy/prometheus/publishers") + "/")


def test_grafana_provisioning_is_mounted_where_grafana_reads_it() -> None:
    assert _container_path("grafana", "./deploy/grafana/provisioning") == "/etc/grafana/provisioning"
    dashboards = _container_path("grafana", "./deploy/grafana/dashboards")
    providers = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/argus.yml").read_text())
    assert [p["options"]["path"] for p in providers["providers"]] == [dashboards]
    datasources = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/argus.yml").read_text())
    assert {d["type"] for d in datasources["datasources"]} == {"prometheus", "grafana-clickhouse-datasource"}
    home = _compose()["services"]["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{dashboards}/argus.json"


#: Services that run once (their dependents wait for them to complete; `docker compose run` for the cli).
ONE_SHOTS = {"topics", "cli"}
EXTERNAL = {"ARGUS_KAFKA_EXTERNAL_HOST": "ranks.example.org"}


def test_every_image_is_pinned_to_an_exact_version() -> None:
    images = {name: svc["image"] for name, svc in _compose()["services"].items() if "image" in svc}
    assert {"kafka", "clickhouse", "prometheus", "alertmanager", "blackbox", "grafana"} <= set(images)
    for name, image in images.items():
        repo, _, tag = image.rpartition(":")
        # vX.Y.Z or X.Y.Z[.W]: a patch release, never latest nor a floating minor tag such as 26.9.
        assert repo and re.fullmatch(r"v?\d+\.\d+\.\d+(\.\d+)?", tag), (name, image)


def _dependencies(condition: str) -> set[str]:
    """Services some service waits for under ``condition`` (long ``depends_on`` syntax)."""
    out = set()
    for svc in _compose()["services"].values():
        deps = svc.get("depends_on") or {}
        if isinstance(deps, dict):
            out |= {dep for dep, cond in deps.items() if cond.get("condition") == condition}
    return out


def test_every_service_has_a_health_check() -> None:
    services = _compose()["services"]
    for name, svc in services.items():
        check = svc.get("healthcheck")
        assert check, f"{name} has no healthcheck"
        if name in ONE_SHOTS:
            assert check == {"disable": True}, name
            continue
        assert check["test"][0] == "CMD" and len(check["test"]) > 1, (name, check)
    # One-shots are what their dependents wait to complete, or tools run by hand.
    waited = _dependencies("service_completed_successfully")
    assert waited | {n for n, s in services.items() if "tools" in s.get("profiles", [])} == ONE_SHOTS
    # Services others wait on as healthy have a check to pass.
    healthy = _dependencies("service_healthy")
    assert healthy and not healthy & ONE_SHOTS


def test_argus_health_checks_probe_each_service_on_its_own_port_setting() -> None:
    from argus.core.settings import Settings

    defaults = Settings.load(env={})
    expected = {"worker": ("ARGUS_WORKER_WEB_PORT", defaults.worker_web_port, "/health"),
                "sink": ("ARGUS_QUERY_PORT", defaults.query_port, "/health"),
                "query": ("ARGUS_QUERY_SERVICE_PORT", 18123, "/ping")}
    services = _compose()["services"]
    for name, (setting, port, path) in expected.items():
        test = services[name]["healthcheck"]["test"]
        assert test[:3] == ["CMD", "python", "-c"], test
        compile(test[3], f"{name} healthcheck", "exec")  # tests/integration/test_compose_commands.py runs it
        assert f"os.environ.get('{setting}', '{port}')" in test[3] and f"{path}'" in test[3], test[3]
    assert services["query"]["environment"]["ARGUS_QUERY_SERVICE_PORT"] == "18123"
    assert services["query"]["ports"] == ["127.0.0.1:18123:18123"]


def test_every_argus_service_runs_an_argus_subcommand() -> None:
    commands = argus_services(_compose())
    assert set(commands) == {"topics", "worker", "sink", "query", "cli"}
    # The query service's `query-service` comes with issue 33's query service: this fails until it is merged.
    for name, command in commands.items():
        assert command[0] in _subcommands(), (name, command)


def test_kafka_listeners_are_sasl_ssl() -> None:
    props = kafka_properties(_compose()["services"]["kafka"], EXTERNAL)
    protocols = dict(p.split(":") for p in props["listener.security.protocol.map"].split(","))
    listeners = dict(entry.split("://") for entry in props["listeners"].split(","))
    advertised = dict(entry.split("://") for entry in props["advertised.listeners"].split(","))
    assert protocols == {"INTERNAL": "SASL_SSL", "EXTERNAL": "SASL_SSL", "CONTROLLER": "PLAINTEXT"}
    assert listeners["CONTROLLER"].startswith("127.0.0.1:")  # the plaintext controller: loopback only
    assert advertised == {"INTERNAL": "kafka:9092", "EXTERNAL": "ranks.example.org:9094"}
    assert props["inter.broker.listener.name"] == "INTERNAL"
    assert props["ssl.keystore.type"] == "PEM" and props["sasl.enabled.mechanisms"] == "PLAIN"
    # Secrets by reference only: the broker reads them from the secret files (FileConfigProvider).
    for key in ("ssl.key.password", "listener.name.internal.plain.sasl.jaas.config",
                "listener.name.external.plain.sasl.jaas.config"):
        assert re.fullmatch(r"\$\{file:/run/secrets/kafka_broker_config:\w+\}", props[key]), (key, props[key])
    # ACLs: nothing is allowed that no binding grants; the admin and the loopback controller's ANONYMOUS are
    # the super users.
    assert props["authorizer.class.name"] == "org.apache.kafka.metadata.authorizer.StandardAuthorizer"
    assert props["allow.everyone.if.no.acl.found"] == "false"
    assert props["super.users"] == "User:admin;User:ANONYMOUS"
    # The argus services connect the same way, each with a user of its own and its own password file.
    users = {"topics": "admin", "worker": "worker", "sink": "sink", "query": "reader", "cli": "reader"}
    for name, user in users.items():
        svc = _compose()["services"][name]
        env = svc["environment"]
        assert env["ARGUS_BOOTSTRAP_SERVERS"] == "kafka:9092"
        assert (env["ARGUS_KAFKA_SECURITY_PROTOCOL"], env["ARGUS_KAFKA_SASL_MECHANISM"]) == ("SASL_SSL", "PLAIN")
        assert env["ARGUS_KAFKA_SASL_USERNAME"] == user, name
        assert env["ARGUS_KAFKA_SASL_PASSWORD_FILE"] == f"/run/secrets/kafka_{user}_password", name
        assert env["ARGUS_KAFKA_SSL_CA_FILE"].startswith("/run/secrets/")
        assert "ARGUS_KAFKA_SASL_PASSWORD" not in env
        # A service mounts its own Kafka password only.
        assert [x for x in svc["secrets"] if x.startswith("kafka_") and x.endswith("_password")] == [
            f"kafka_{user}_password"], name
    assert _compose()["services"]["topics"]["command"] == ["topics", "--acls"]


def test_one_variable_names_the_external_listener() -> None:
    text = yaml.safe_dump(_compose())  # what compose interpolates: the values, not the comments
    variables = set(re.findall(r"(?<!\$)\$\{([A-Za-z_][A-Za-z0-9_]*)", text))
    assert variables == {"ARGUS_KAFKA_EXTERNAL_HOST"}
    kafka = _compose()["services"]["kafka"]
    with pytest.raises(ComposeError, match=r"ARGUS_KAFKA_EXTERNAL_HOST .*docs/deploy\.md"):
        kafka_properties(kafka, {})
    with pytest.raises(ComposeError, match="ARGUS_KAFKA_EXTERNAL_HOST"):
        kafka_properties(kafka, {"ARGUS_KAFKA_EXTERNAL_HOST": ""})
    assert "EXTERNAL://10.1.2.3:9094" in kafka_properties(kafka, {"ARGUS_KAFKA_EXTERNAL_HOST": "10.1.2.3"})[
        "advertised.listeners"]
    assert interpolate("$${file:/x:k}", {}) == "${file:/x:k}"


def test_secrets_come_from_files_generated_outside_git() -> None:
    doc = _compose()
    files = secret_files(doc)
    assert all(f.startswith("./deploy/secrets/") for f in files.values()), files
    ignored = subprocess.run(["git", "check-ignore", "-q", "deploy/secrets/kafka_rank_password"], cwd=ROOT,
                             check=False)
    assert ignored.returncode == 0, "deploy/secrets/ must be listed in .gitignore"
    # Every /run/secrets/<name> a service reads is a secret it lists, defined at the top level.
    for name, svc in doc["services"].items():
        text = yaml.safe_dump({k: svc.get(k) for k in ("environment", "healthcheck")})
        for secret in re.findall(r"/run/secrets/([A-Za-z0-9_.-]+)", text):
            assert secret in svc.get("secrets", []) and secret in files, (name, secret)
    # No password in the file itself: a password setting names a file, or Kafka reads it from one.
    for name, svc in doc["services"].items():
        for key, value in (svc.get("environment") or {}).items():
            if "PASSWORD" in key and not key.endswith("_FILE"):
                assert re.fullmatch(r"\$\$\{file:/run/secrets/\w+:\w+\}", value), (name, key)


def test_grafana_admin_password_is_a_secret() -> None:
    grafana = _compose()["services"]["grafana"]
    env = grafana["environment"]
    assert "GF_SECURITY_ADMIN_PASSWORD" not in env
    assert env["GF_SECURITY_ADMIN_PASSWORD__FILE"] == "/run/secrets/grafana_admin_password"
    assert "grafana_admin_password" in grafana["secrets"]
    assert "admin/admin" not in (ROOT / "docker-compose.yml").read_text()


@pytest.mark.slow
def test_make_secrets_writes_every_compose_secret(tmp_path: Path) -> None:
    out = tmp_path / "secrets"
    made = subprocess.run([str(ROOT / "deploy/make-secrets"), "--dir", str(out), "ranks.example.org"],
                          capture_output=True, text=True, check=False)
    assert made.returncode == 0, made.stderr
    names = {Path(f).name for f in secret_files(_compose()).values()}
    assert names <= {p.name for p in out.iterdir()}
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    assert stat.S_IMODE((out / "kafka_ca_key").stat().st_mode) == 0o600  # mounted nowhere
    kafka_users = ("admin", "worker", "sink", "reader", "rank")
    passwords = [(out / n).read_text().strip() for n in (*(f"kafka_{u}_password" for u in kafka_users),
                                                         "clickhouse_password", "query_password",
                                                         "grafana_admin_password")]
    assert len(set(passwords)) == len(passwords) and all(re.fullmatch(r"[0-9a-f]{48}", p) for p in passwords)
    # The broker's PLAIN users are exactly those, each with the password of its file.
    jaas = next(line for line in (out / "kafka_broker_config").read_text().splitlines() if line.startswith("jaas="))
    assert dict(re.findall(r'user_(\w+)="([0-9a-f]+)"', jaas)) == dict(zip(kafka_users, passwords, strict=False))
    text = subprocess.run(["openssl", "x509", "-noout", "-ext", "subjectAltName", "-in", str(out / "kafka_keystore")],
                          capture_output=True, text=True, check=True).stdout
    assert {"DNS:kafka", "DNS:localhost", "DNS:ranks.example.org"} <= set(re.findall(r"DNS:[\w.-]+", text))
    # A second run keeps the set (every password would change); no host is refused with a clear message.
    again = subprocess.run([str(ROOT / "deploy/make-secrets"), "--dir", str(out), "x"], capture_output=True,
                           text=True, check=False)
    assert again.returncode == 1 and "--force" in again.stderr
    env = {k: v for k, v in os.environ.items() if k != "ARGUS_KAFKA_EXTERNAL_HOST"}
    nohost = subprocess.run([str(ROOT / "deploy/make-secrets"), "--dir", str(tmp_path / "x")], capture_output=True,
                            text=True, check=False, env=env)
    assert nohost.returncode == 2 and "ARGUS_KAFKA_EXTERNAL_HOST" in nohost.stderr


def test_prometheus_loads_the_rules_and_sends_alerts_to_alertmanager() -> None:
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    rules_dir = _container_path("prometheus", "./deploy/prometheus/rules")
    assert config["rule_files"] == [f"{rules_dir}/*.yml"]
    targets = config["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"]
    services = _compose()["services"]
    assert targets == ["alertmanager:9093"] and "alertmanager" in services
    am_config = _container_path("alertmanager", "./deploy/alertmanager/alertmanager.yml")
    assert f"--config.file={am_config}" in services["alertmanager"]["command"]
    # The query service is probed through the blackbox exporter, with the module its config defines.
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "argus-query")
    assert job["static_configs"][0]["targets"] == ["http://query:18123/ping"]
    assert job["relabel_configs"][-1]["replacement"] == "blackbox:9115"
    blackbox = yaml.safe_load((ROOT / "deploy/blackbox/blackbox.yml").read_text())
    assert job["params"]["module"] == ["argus_ping"] and "argus_ping" in blackbox["modules"]
    bb_config = _container_path("blackbox", "./deploy/blackbox/blackbox.yml")
    assert f"--config.file={bb_config}" in services["blackbox"]["command"]
