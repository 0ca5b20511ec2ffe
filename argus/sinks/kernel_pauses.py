"""When each rank's kernel records were paused (``argus control pause-kernels``, sampling, a profiler), read back
from the ranks' heartbeats (schema v2) for the context of a job's findings (``argus findings``).

A window without a rank's kernels during such a pause is missing data, never a fault: this says which gaps those
are. A span starts at the first heartbeat that says paused and ends at the first later one that does not; a span
with no such heartbeat yet is open (``end_ns`` is then the last paused heartbeat's time).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from argus.core.settings import Settings
from argus.sinks.clickhouse import QueryResult, sql_string
from argus.sinks.query_server import run_query

__all__ = ["PauseSpan", "format_pauses", "kernel_pauses"]

Query = Callable[[str], QueryResult]


@dataclass(frozen=True)
class PauseSpan:
    """Kernel records of ``rank`` paused from ``start_ns`` to ``end_ns`` (ns since the epoch) for ``reasons``
    (comma-separated :class:`~argus.schemas.records.PauseReason` values at its start); ``open``: not resumed by
    the last heartbeat stored."""

    rank: int
    start_ns: int
    end_ns: int
    reasons: str
    open: bool


def kernel_pauses(settings: Settings, job_id: str, query: Query | None = None) -> list[PauseSpan]:
    """The job's kernel pause spans, by rank then time (one query; only the heartbeats where a rank's pause
    state changes, and each rank's last paused heartbeat, leave the store)."""
    db = settings.clickhouse_database
    run = query if query is not None else (lambda sql: run_query(settings, sql))
    res = run(f"""
        SELECT rank, time_ns, kernels_paused, pause_reasons, last_paused FROM (
            SELECT rank, time_ns, kernels_paused, pause_reasons,
                   lagInFrame(kernels_paused, 1, 0) OVER w AS prev,
                   max(if(kernels_paused = 1, time_ns, 0)) OVER (PARTITION BY rank) AS last_paused
            FROM `{db}`.heartbeats FINAL WHERE job_id = {sql_string(job_id)}
            WINDOW w AS (PARTITION BY rank ORDER BY time_ns ROWS BETWEEN 1 PRECEDING AND CURRENT ROW))
        WHERE kernels_paused != prev ORDER BY rank, time_ns""")
    spans: list[PauseSpan] = []
    start: tuple[int, int, str, int] | None = None  # rank, start, reasons, last paused heartbeat
    for rank, t, paused, reasons, last in res.rows:
        rank, t = int(rank), int(t)
        if start is not None and start[0] != rank:
            spans.append(PauseSpan(start[0], start[1], start[3], start[2], True))
            start = None
        if int(paused):
            start = (rank, t, str(reasons), int(last))
        elif start is not None:
            spans.append(PauseSpan(rank, start[1], t, start[2], False))
            start = None
    if start is not None:
        spans.append(PauseSpan(start[0], start[1], start[3], start[2], True))
    return spans


def _clock(ns: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ns / 1e9)) + f".{ns % 1_000_000_000 // 1_000_000:03d}"


def format_pauses(spans: list[PauseSpan]) -> list[str]:
    """One line per span, for people: ``rank 3: kernel records paused 2026-12-06 13:40:01.250 -> ... UTC (CONTROL)``."""
    return [f"rank {s.rank}: kernel records paused {_clock(s.start_ns)} -> "
            f"{_clock(s.end_ns) + (' (still paused at the last heartbeat)' if s.open else '')} UTC "
            f"({s.reasons or '?'}); its kernels there are missing data, not judged" for s in spans]
