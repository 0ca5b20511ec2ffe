"""Reading findings back: the public findings contract of ``argus findings``.

Each finding is a JSON object with at least ``job``, ``level`` ("L1" | "L2" | "L3"), ``kind``, ``ranks`` (list
of int; empty for job-wide findings), ``phase``, ``kernel``, ``stream`` (or null), ``steps`` (list of int),
``score``, ``evidence`` (object), ``impact_ns_per_step`` and ``impact_ns`` (GPU time the job lost, ns; 0 for
findings written before schema v2), ``time_ns`` and ``detector_version`` (the detectors that made it; '' before
schema v3), ``finding_id``, ``hosts`` (the hosts of its ranks; empty before schema v4 or where unknown),
``incident_id`` (the ``finding_id`` of the lead of the incident it belongs to, see docs/incidents.md; a finding
written before schema v4 is its own incident) and ``gpus`` (each rank's GPU id, '' unknown; empty where none is
known). Keep these keys stable: other tools parse them. Findings come by incident (:func:`fold_incidents`): the
incident of largest impact first, each as its lead, then its members by impact, largest first: what a user acts
on.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from argus.core.errors import ArgusError
from argus.core.settings import Settings
from argus.detectors.incidents import by_incident
from argus.sinks.clickhouse import QueryResult, sql_string
from argus.sinks.query_server import run_query

#: Runs one SQL statement; defaults to :func:`argus.sinks.query_server.run_query` on the settings.
Query = Callable[[str], QueryResult]

__all__ = ["diagnosis_complete", "fetch_findings", "fold_incidents", "job_known", "pending_reasons", "wait_diagnosed"]



def _runner(settings: Settings, query: Query | None) -> Query:
    return query if query is not None else (lambda sql: run_query(settings, sql))


def fetch_findings(settings: Settings, job_id: str, query: Query | None = None) -> list[dict[str, Any]]:
    """The job's findings, deduplicated, by incident (:func:`fold_incidents`, flattened); within that by impact
    (largest first), then level, kind, steps and ranks."""
    db = settings.clickhouse_database
    res = _runner(settings, query)(f"""
        SELECT job_id, level, kind, ranks, phase, kernel, stream, steps, score, evidence_json, time_ns,
               impact_ns_per_step, impact_ns, detector_version, finding_id, hosts, incident_id, gpus
        FROM `{db}`.findings FINAL WHERE job_id = {sql_string(job_id)}
        ORDER BY impact_ns DESC, level, kind, steps, ranks, phase, kernel""")
    out = []
    for (job, level, kind, ranks, phase, kernel, stream, steps, score, evidence, time_ns, per_step, total,
         version, fid, hosts, incident, gpus) in res.rows:
        out.append({"job": job, "level": level, "kind": kind, "ranks": [int(r) for r in ranks],
                    "phase": phase, "kernel": kernel, "stream": None if stream is None else int(stream),
                    "steps": [int(s) for s in steps], "score": float(score), "evidence": json.loads(evidence),
                    "time_ns": int(time_ns), "impact_ns_per_step": float(per_step), "impact_ns": float(total),
                    "detector_version": version, "finding_id": fid, "hosts": [str(h) for h in hosts or ()],
                    "incident_id": incident or fid, "gpus": [str(g) for g in gpus or ()]})
    return [f for group in fold_incidents(out) for f in group]


def fold_incidents(findings: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """``argus findings --json`` objects grouped by ``incident_id``: the incident of largest impact first, each
    its lead (the finding whose ``finding_id`` is the incident's) then its members by impact; a finding without
    an incident id (one from an older argus) is its own incident. Equal impacts keep their order."""
    return by_incident(findings, lambda f: str(f.get("finding_id") or id(f)),
                       lambda f: str(f.get("incident_id") or ""), lambda f: float(f.get("impact_ns") or 0.0))


def diagnosis_complete(settings: Settings, job_id: str, query: Query | None = None) -> bool:
    """True once the job is diagnosed through to ClickHouse: every detector part wrote DIAGNOSED (the L1/L2
    part and one L3 part per summaries partition), every finding those records list is stored, the job's END
    (or, for a job that never ended, the worker's ABANDONED record) is stored, and the job's stored records add
    up to its END's counts (an abandoned job has none; kernel events in summaries or dead letters, Step and
    PhaseBatch records stored or dead-lettered; a count the END does not know is not checked).

    The DIAGNOSED records travel on another topic than the findings and the records, so seeing them proves
    nothing about the rest: each is checked in the store itself.
    """
    return not pending_reasons(settings, job_id, query)


def pending_reasons(settings: Settings, job_id: str, query: Query | None = None) -> list[str]:
    """What the job still waits for before :func:`diagnosis_complete` (empty when complete)."""
    db, job = settings.clickhouse_database, sql_string(job_id)
    dead = f"`{db}`.dead_letters FINAL WHERE job_id = {job}"
    row = _runner(settings, query)(f"""
        SELECT
          (SELECT countIf(part = 'l1l2') FROM `{db}`.jobs FINAL WHERE job_id = {job} AND event = 'DIAGNOSED'),
          (SELECT countIf(startsWith(part, 'l3/')) FROM `{db}`.jobs FINAL
             WHERE job_id = {job} AND event = 'DIAGNOSED'),
          (SELECT uniqExact(id) FROM `{db}`.jobs FINAL ARRAY JOIN finding_ids AS id
             WHERE job_id = {job} AND event = 'DIAGNOSED'),
          (SELECT count() FROM `{db}`.findings FINAL WHERE job_id = {job} AND finding_id IN (
             SELECT id FROM `{db}`.jobs FINAL ARRAY JOIN finding_ids AS id
             WHERE job_id = {job} AND event = 'DIAGNOSED')),
          (SELECT count() FROM `{db}`.jobs FINAL WHERE job_id = {job} AND event IN ('END', 'ABANDONED')),
          (SELECT max(kernel_events) FROM `{db}`.jobs FINAL WHERE job_id = {job} AND event = 'END'),
          (SELECT max(steps) FROM `{db}`.jobs FINAL WHERE job_id = {job} AND event = 'END'),
          (SELECT max(phase_batches) FROM `{db}`.jobs FINAL WHERE job_id = {job} AND event = 'END'),
          (SELECT sum(n_events) FROM `{db}`.kernel_summaries FINAL WHERE job_id = {job}),
          (SELECT sum(kernel_events) FROM {dead} AND endsWith(topic, 'kernels')),
          (SELECT count() FROM `{db}`.steps FINAL WHERE job_id = {job}),
          (SELECT uniqExact(partition, offset) FROM {dead} AND endsWith(topic, 'steps')),
          (SELECT uniqExact(rank, step) FROM `{db}`.phases FINAL WHERE job_id = {job}),
          (SELECT uniqExact(partition, offset) FROM {dead} AND endsWith(topic, 'phases'))""").rows[0]
    (l1l2, l3, listed, stored, ended, want_events, want_steps, want_phases, events, dead_events, steps,
     dead_steps, phases, dead_phases) = (None if v is None else int(v) for v in row)
    why = []
    if not l1l2 or (l3 or 0) < settings.partitions:
        why.append(f"DIAGNOSED parts: l1l2 {l1l2 or 0}/1, l3 {l3 or 0}/{settings.partitions}")
    if (stored or 0) < (listed or 0):
        why.append(f"findings stored {stored or 0}/{listed}")
    if not ended:
        why.append("no END (or ABANDONED) stored")
    for what, want, have in (("kernel events", want_events, (events or 0) + (dead_events or 0)),
                             ("steps", want_steps, (steps or 0) + (dead_steps or 0)),
                             ("phase batches", want_phases, (phases or 0) + (dead_phases or 0))):
        if want is not None and have < want:
            why.append(f"{what} stored {have}/{want}")
    return why


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


def job_known(settings: Settings, job_id: str, query: Query | None = None) -> bool:
    """Whether anything is stored for the job: a lifecycle record, a step, a kernel summary or a finding
    (a job id that matches none is a typo, or lives in another database or namespace)."""
    db, job = settings.clickhouse_database, sql_string(job_id)
    # One statement that starts with SELECT, as the query service serves.
    probes = ", ".join(f"(SELECT count() FROM (SELECT 1 FROM `{db}`.{table} WHERE job_id = {job} LIMIT 1))"
                       for table in ("jobs", "steps", "kernel_summaries", "findings"))
    return any(int(v or 0) for v in _runner(settings, query)(f"SELECT {probes}").rows[0])
