"""docker-compose.yml parses, and every argus service runs a command the CLI has."""

from __future__ import annotations

from pathlib import Path

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
