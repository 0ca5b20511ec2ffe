"""Helpers to check the provisioned Grafana dashboard against the code: its ClickHouse SQL against
:data:`argus.sinks.tables.TABLES`, its PromQL against the metric names the exporters really serve."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "argus.json"
CLICKHOUSE_TYPE = "grafana-clickhouse-datasource"
PROMETHEUS_TYPE = "prometheus"


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels(dash: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel but rows (and the panels inside collapsed rows)."""
    for p in dash["panels"]:
        if p.get("type") == "row":
            yield from p.get("panels", [])
        else:
            yield p


def targets(dash: dict[str, Any], ds_type: str) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(panel, target) of every query of a data source type."""
    for p in panels(dash):
        for t in p.get("targets", []):
            if (t.get("datasource") or p.get("datasource") or {}).get("type") == ds_type:
                yield p, t


def clickhouse_sql(dash: dict[str, Any]) -> dict[str, str]:
    """``{title: SQL}`` of the ClickHouse panels and template variables."""
    out = {p["title"]: t["rawSql"] for p, t in targets(dash, CLICKHOUSE_TYPE)}
    for v in dash.get("templating", {}).get("list", []):
        if (v.get("datasource") or {}).get("type") == CLICKHOUSE_TYPE:
            out[f"variable {v['name']}"] = v["query"] if isinstance(v["query"], str) else v["query"]["rawSql"]
    return out


def runnable_sql(sql: str, database: str, job: str, from_s: int = 0, to_s: int = 4_102_444_800) -> str:
    """``sql`` with Grafana's macros and variables filled in, on ``database`` instead of ``argus``."""
    sql = sql.replace("$__fromTime", f"toDateTime({from_s})").replace("$__toTime", f"toDateTime({to_s})")
    sql = sql.replace("${job}", job).replace("$job", job)
    return re.sub(r"\bargus\.", f"{database}.", sql)


def prometheus_exprs(dash: dict[str, Any]) -> dict[str, str]:
    return {f"{p['title']} / {t['refId']}": t["expr"] for p, t in targets(dash, PROMETHEUS_TYPE)}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (argus_* identifiers not inside label matchers)."""
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors
    return {n for n in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr) if n.startswith("argus_")}


def exported_names(text: str) -> set[str]:
    """The sample names an exposition offers, whether or not a family has samples yet."""
    out: set[str] = set()
    for fam in text_string_to_metric_families(text):
        if fam.type == "counter":
            out.add(fam.name + "_total")
        elif fam.type == "histogram":
            out |= {fam.name + s for s in ("_bucket", "_sum", "_count")}
        else:
            out.add(fam.name)
        out |= {s.name for s in fam.samples}
    return out
