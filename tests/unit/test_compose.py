"""docker-compose.yml parses, and every argus service runs a command the CLI has."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from argus.cli import _parser

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
    for svc in argus_services:
        assert svc["command"][0] in _subcommands(), svc["command"]
        env = svc["environment"]
        assert env["ARGUS_CLICKHOUSE_DSN"].startswith("http://")
        assert all(k.startswith("ARGUS_") for k in env)
    assert services["kafka"]["image"].startswith("apache/kafka:4.")
    assert services["clickhouse"]["image"].startswith("clickhouse/clickhouse-server:")


def test_published_ports_bind_loopback_only() -> None:
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    published = [(name, p) for name, svc in services.items() for p in svc.get("ports", [])]
    assert published  # ClickHouse's HTTP port at least, for `argus sql` from the host
    for name, port in published:
        if isinstance(port, dict):  # long syntax
            assert port.get("host_ip") == "127.0.0.1", (name, port)
        else:
            assert str(port).startswith("127.0.0.1:"), (name, port)


def test_dockerfile_copies_every_package() -> None:
    text = (ROOT / "Dockerfile").read_text()
    for pkg in ("argus", "producers", "streams", "sinks", "detectors", "schemas"):
        assert f"COPY {pkg} ./{pkg}" in text


def _compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_prometheus_and_grafana_services() -> None:
    services = _compose()["services"]
    assert services["prometheus"]["image"].startswith("prom/prometheus:")
    assert services["grafana"]["image"].startswith("grafana/grafana:")
    assert "grafana-clickhouse-datasource" in services["grafana"]["environment"]["GF_INSTALL_PLUGINS"]
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
