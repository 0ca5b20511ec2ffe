"""Reading findings back: the public findings contract of ``argus findings``.

Each finding is a JSON object with at least ``job``, ``level`` ("L1" | "L2" | "L3"), ``kind``, ``ranks`` (list
of int; empty for job-wide findings), ``phase``, ``kernel``, ``stream`` (or null), ``steps`` (list of int),
``score``, ``evidence`` (object), ``impact_ns_per_step`` and ``impact_ns`` (GPU time the job lost, ns; 0 for
findings written before schema v2). Keep these keys stable: other tools parse them. Findings come ordered by
``impact_ns``, largest first: what a user acts on.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from argus.errors import ArgusError
from argus.settings import Settings
from sinks.clickhouse import QueryResult
from sinks.query_server import run_query

#: Runs one SQL statement; defaults to :func:`sinks.query_server.run_query` on the settings.
Query = Callable[[str], QueryResult]

__all__ = ["diagnosis_complete", "fetch_findings", "wait_diagnosed"]


def _quote(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _runner(settings: Settings, query: Query | None) -> Query:
    return query if query is not None else (lambda sql: run_query(settings, sql))


def fetch_findings(settings: Settings, job_id: str, query: Query | None = None) -> list[dict[str, Any]]:
    """The job's findings, deduplicated, by impact (largest first), then level, kind, steps and ranks."""
    db = settings.clickhouse_database
    res = _runner(settings, query)(f"""
        SELECT job_id, level, kind, ranks, phase, kernel, stream, steps, score, evidence_json, time_ns,
               impact_ns_per_step, impact_ns
        FROM `{db}`.findings FINAL WHERE job_id = {_quote(job_id)}
        ORDER BY impact_ns DESC, level, kind, steps, ranks, phase, kernel""")
    out = []
    for job, level, kind, ranks, phase, kernel, stream, steps, score, evidence, time_ns, per_step, total in res.rows:
        out.append({"job": job, "level": level, "kind": kind, "ranks": [int(r) for r in ranks],
                    "phase": phase, "kernel": kernel, "stream": None if stream is None else int(stream),
                    "steps": [int(s) for s in steps], "score": float(score), "evidence": json.loads(evidence),
                    "time_ns": int(time_ns), "impact_ns_per_step": float(per_step), "impact_ns": float(total)})
    return out


def diagnosis_complete(settings: Settings, job_id: str, query: Query | None = None) -> bool:
    """True once the job's END was processed by every detector part and their output is in ClickHouse:
    the L1/L2 part and one L3 part per partition of the summaries topic."""
    db = settings.clickhouse_database
    row = _runner(settings, query)(f"""
        SELECT countIf(part = 'l1l2'), countIf(startsWith(part, 'l3/'))
        FROM `{db}`.jobs FINAL WHERE job_id = {_quote(job_id)} AND event = 'DIAGNOSED'""").rows[0]
    return int(row[0]) >= 1 and int(row[1]) >= settings.partitions


def wait_diagnosed(settings: Settings, job_id: str, timeout_s: float, query: Query | None = None) -> bool:
    """Block until :func:`diagnosis_complete` or ``timeout_s`` passes; returns whether it completed."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if diagnosis_complete(settings, job_id, query):
                return True
        except ArgusError:
            pass  # the sink may be starting; keep waiting until the deadline
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.5)
