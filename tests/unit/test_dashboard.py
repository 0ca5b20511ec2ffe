"""The provisioned Grafana dashboard: it parses, every query uses a provisioned data source, its ClickHouse
SQL names only argus tables and their columns, and its PromQL only metrics the exporters really serve."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml

from argus.core.settings import Settings
from argus.metrics import exposition
from argus.producers.publisher import Publisher
from argus.producers.publisher_metrics import publisher_registry
from argus.sinks.metrics import sink_registry
from argus.sinks.tables import TABLES
from argus.sinks.writer import SinkWriter, _Pending
from argus.streams.app import CompressionStats
from argus.streams.diagnosis_stats import DiagnosisStats
from argus.streams.metrics import WorkerCollector, worker_registry
from argus.topics import Topic
from tests.dashboards import (
    CLICKHOUSE_TYPE,
    ROOT,
    clickhouse_sql,
    dashboard,
    exported_names,
    metric_names,
    panels,
    prometheus_exprs,
)
from tests.samples import kernel_batch

PROVISIONING = ROOT / "deploy" / "grafana" / "provisioning"

#: SQL words and names that are neither tables nor columns (the dashboard's SQL is argus's own, so this is
#: a closed list: a new panel with a new keyword adds it here).
_SQL_WORDS = {
    "select", "from", "where", "and", "or", "not", "in", "as", "group", "by", "order", "limit", "desc", "asc",
    "final", "array", "join", "over", "partition", "interval", "minute", "second", "hour", "e9", "null",
}


def _datasource_uids() -> dict[str, str]:
    doc = yaml.safe_load((PROVISIONING / "datasources" / "argus.yml").read_text())
    return {d["uid"]: d["type"] for d in doc["datasources"]}


def test_dashboard_parses_and_every_query_uses_a_provisioned_datasource() -> None:
    dash, uids = dashboard(), _datasource_uids()
    assert dash["uid"] and dash["title"]
    found = list(panels(dash))
    assert len(found) >= 10
    for p in found:
        assert p["datasource"]["uid"] in uids, p["title"]
        assert uids[p["datasource"]["uid"]] == p["datasource"]["type"], p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"], p["title"]
    for v in dash["templating"]["list"]:
        assert v["datasource"]["uid"] in uids
    titles = " ".join(p["title"].lower() for p in found)
    for wanted in ("iteration time per job", "straggler heat map", "findings timeline", "consumer lag",
                   "dead letters", "diagnosis latency", "events in"):
        assert wanted in titles


def _sql_names(sql: str) -> tuple[set[str], set[str]]:
    """(tables, other identifiers) of ``sql``: functions, string literals and Grafana macros left out."""
    sql = re.sub(r"'[^']*'", "''", sql)
    sql = re.sub(r"\$__\w+", "", sql)
    tables = set(re.findall(r"\bargus\.(\w+)", sql))
    sql = re.sub(r"\bargus\.\w+", "", sql)
    names = {m.group(1) for m in re.finditer(r"\b([A-Za-z_][A-Za-z0-9_]*)\b(?!\s*\()", sql)}
    return tables, {n for n in names if n.lower() not in _SQL_WORDS}


def test_clickhouse_panels_use_only_argus_tables_and_their_columns() -> None:
    queries = clickhouse_sql(dashboard())
    assert len(queries) >= 5
    for title, sql in queries.items():
        tables, names = _sql_names(sql)
        assert tables and tables <= set(TABLES), (title, tables)
        columns = {c[0] for t in tables for c in TABLES[t].columns}
        columns |= {re.match(r"`(\w+)`", a).group(1) for t in tables for a in TABLES[t].aliases}  # type: ignore[union-attr]
        aliases = set(re.findall(r"\bAS\s+(\w+)", sql, flags=re.IGNORECASE))
        unknown = names - columns - aliases
        assert not unknown, f"{title}: {sorted(unknown)} are no columns of {sorted(tables)}"


def test_clickhouse_datasource_matches_the_compose_stack() -> None:
    doc = yaml.safe_load((PROVISIONING / "datasources" / "argus.yml").read_text())
    ch = next(d for d in doc["datasources"] if d["type"] == CLICKHOUSE_TYPE)
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert ch["jsonData"]["host"] in services and ch["jsonData"]["protocol"] == "http"
    assert ch["jsonData"]["username"] == services["clickhouse"]["environment"]["CLICKHOUSE_USER"]
    assert ch["jsonData"]["defaultDatabase"] == Settings.load(env={}).clickhouse_database
    secret = re.fullmatch(r"\$__file\{/run/secrets/(\w+)\}", ch["secureJsonData"]["password"])
    assert secret and secret.group(1) in services["grafana"]["secrets"]
    plugins = services["grafana"]["environment"]["GF_INSTALL_PLUGINS"].split(",")  # "<id> <version>" each
    assert CLICKHOUSE_TYPE in [p.split()[0] for p in plugins]
    prom = next(d for d in doc["datasources"] if d["type"] == "prometheus")
    assert prom["url"].startswith("http://prometheus:")


def _exported() -> set[str]:
    """Every sample name the worker, sink and publisher exporters serve (their real collectors, populated as
    after a job: a diagnosis, inserts into every table, a published record)."""
    comp, diag = CompressionStats(), DiagnosisStats()
    diag.findings_by_kind = {"L2": {"compute_straggler": 1}}
    worker = exposition(worker_registry(WorkerCollector(comp, diag, consumer=lambda: None))).decode()

    class Store:
        def insert(self, table: Any, rows: list[Any]) -> None:
            pass

        def ensure_schema(self) -> None:
            pass

    settings = Settings.load(env={}, bootstrap_servers="127.0.0.1:1")
    writer = SinkWriter(settings, Store())  # type: ignore[arg-type]
    try:
        for table in TABLES.values():
            writer._insert(table, [_Pending(None, [])])  # type: ignore[arg-type]
        sink = exposition(sink_registry(writer)).decode()
    finally:
        writer.close()
    pub = Publisher(settings, sender=False)
    pub.publish(Topic.KERNELS, b"j/0", kernel_batch())
    publisher = exposition(publisher_registry(pub)).decode()
    pub.close(timeout_s=0.2)
    return exported_names(worker) | exported_names(sink) | exported_names(publisher)


@pytest.fixture(scope="module")
def exported() -> set[str]:
    return _exported()


def test_prometheus_panels_query_only_exported_metrics(exported: set[str]) -> None:
    exprs = prometheus_exprs(dashboard())
    assert len(exprs) >= 10
    used: set[str] = set()
    for where, expr in exprs.items():
        names = metric_names(expr)
        assert names, where
        assert names <= exported, f"{where}: {sorted(names - exported)} not exported"
        used |= names
    assert {p for n in used for p in ("worker", "sink", "publisher") if n.startswith(f"argus_{p}_")} == \
        {"worker", "sink", "publisher"}


def test_metric_names_follow_prometheus_conventions(exported: set[str]) -> None:
    for name in exported:
        assert re.fullmatch(r"argus_(worker|sink|publisher)_[a-z0-9_]+", name), name
        assert not name.endswith("_total_total"), name
    assert "argus_worker_kernel_events_total" in exported
    assert "argus_worker_diagnosis_latency_seconds_bucket" in exported
    assert "argus_sink_insert_seconds_bucket" in exported
    assert "argus_publisher_records_dropped_total" in exported


def test_the_sql_check_sees_unknown_columns_and_tables() -> None:
    tables, names = _sql_names("SELECT max(wall_ns) AS w, bogus FROM argus.steps FINAL WHERE job_id = 'x' "
                               "AND start_ns >= toUnixTimestamp($__fromTime) * 1e9")
    assert tables == {"steps"} and names == {"wall_ns", "w", "bogus", "job_id", "start_ns"}
    assert _sql_names("SELECT 1 FROM argus.nope")[0] == {"nope"}
