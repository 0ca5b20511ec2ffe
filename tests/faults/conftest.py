"""Fault-injection fixtures: one private local stack (``argus up`` with its own home, ports, topics, groups and
chDB, via ``ARGUS_*``) shared by the suite, a simulated 32-rank job published through it, and what the store
holds of a job, to compare a faulted run with a clean one.

The suite needs what ``scripts/test`` needs (Java, the Kafka jars); it is never skipped.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from argus.core.errors import SinkError
from argus.core.settings import Settings
from argus.demo import build_spec
from argus.detectors.findings import finding_id
from argus.local_kafka import LocalKafka
from argus.producers.publisher import Publisher
from argus.producers.simulator import JobSimulator
from argus.sinks.findings_query import fetch_findings, pending_reasons
from argus.sinks.query_server import run_query
from argus.supervisor import Service, service_pid
from load_tests.detection_eval import PrivateStack

#: The job of the issue: ``argus simulate --dp 8 --tp 2 --pp 2 --steps 40 --fault case1``.
DP, TP, PP, STEPS, FAULT = 8, 2, 2, 40, "case1"
#: Host seconds between two published steps: 40 steps take ~16 s, so a kill lands while the job publishes.
PACE_S = 0.4
#: Generous deadlines: the suite must pass on a busy 2-core machine.
RECOVER_S = 240.0
DIAGNOSE_S = 300.0
#: A job whose pending reasons (see ``argus.sinks.findings_query.pending_reasons``) did not change for this long
#: will not complete: stop waiting and report.
STALLED_S = 60.0


class FaultStack(PrivateStack):
    """A private ``argus up`` stack (as the detection benchmark's) and the handles a fault test needs: status,
    SQL, pids, waits for the supervisor's restarts."""

    def __init__(self, home: Path) -> None:
        super().__init__(home, partitions=4)
        # A killed worker's partitions go to its successor once the dead member's session expires.
        self.env["ARGUS_SESSION_TIMEOUT_S"] = "6"
        self.settings = Settings.load(env=self.env)
        self.kafka = LocalKafka(self.settings)
        self.run_dir = (home / "run").resolve()

    def status(self) -> dict[str, Any]:
        res = self.argus("status", "--json", timeout=120)
        doc: dict[str, Any] = json.loads(res.stdout)
        return doc

    def sql(self, query: str, wait_s: float = 120.0) -> list[tuple[Any, ...]]:
        """Rows of ``query``; while the sink is down (killed, not back yet) the query service cannot reach the
        store it owns, so the query is tried again until the sink is back."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return [tuple(r) for r in run_query(self.settings, query).rows]
            except SinkError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def pid(self, name: str) -> int | None:
        """The running pid of ``worker``, ``sink`` or ``kafka`` (this home's broker)."""
        if name == "kafka":
            return self.kafka.pid()
        return service_pid(self.run_dir, Service(name))

    def healthy(self, name: str) -> bool:
        return bool(self.status()[name].get("healthy"))

    def wait_back(self, name: str, old_pid: int, timeout_s: float = RECOVER_S) -> int:
        """Wait until the supervisor has replaced ``old_pid`` by a healthy ``name``; returns the new pid."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            pid = self.pid(name)
            if pid is not None and pid != old_pid and self.healthy(name):
                return pid
            time.sleep(0.5)
        raise AssertionError(f"{name} not restarted and healthy within {timeout_s:.0f} s after kill -9 of "
                             f"{old_pid}:\n{self.logs()}")

    def wait_all_healthy(self, timeout_s: float = RECOVER_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            doc = self.status()
            if all(doc[n].get("healthy") for n in ("kafka", "worker", "sink")):
                return
            time.sleep(0.5)
        raise AssertionError(f"stack not healthy within {timeout_s:.0f} s:\n{self.logs()}")

    def logs(self) -> str:
        sup = self.run_dir / "supervisor.log"
        tail = "\n".join(sup.read_text(errors="replace").splitlines()[-25:]) if sup.exists() else ""
        return f"{super().logs()}\n--- {sup}\n{tail}"


@dataclass
class JobRun:
    """One published job: what was published and when each kill -9 happened."""

    job: str
    kernel_events: int = 0
    steps: int = 0
    phase_batches: int = 0
    kills: list[dict[str, Any]] = field(default_factory=list)


def publish_job(stack: FaultStack, job: str, on_step: dict[int, Callable[[], None]] | None = None,
                pace_s: float = PACE_S) -> JobRun:
    """Publish the suite's job as ``job`` through the simulator API, ``pace_s`` host seconds per step; after
    step ``n`` is queued, ``on_step[n]()`` runs (a kill). Lossless: waits for the broker rather than drop."""
    actions = on_step or {}
    spec = build_spec(job, DP, TP, PP, STEPS, FAULT)
    sim = JobSimulator(spec, batch_events=stack.settings.publisher_batch_events)

    def progress(done: int, _total: int) -> None:
        if done in actions:
            actions[done]()
        time.sleep(pace_s)

    with Publisher(stack.settings, lossless=True) as pub:
        # A broker outage is waited out (the supervisor restarts it), within the producer's message timeout.
        stats = sim.run(pub, progress=progress, flush_timeout_s=RECOVER_S)
        pstats = pub.close(timeout_s=RECOVER_S)
    assert not pstats.failed and not pstats.dropped, f"publishing {job}: {pstats}"
    return JobRun(job, stats.kernel_events, stats.steps, stats.phase_batches)


def _q(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def job_facts(stack: FaultStack, job: str) -> dict[str, Any]:
    """What the store holds of ``job``, deduplicated (``FINAL``), and the duplicates that survive it."""
    db, j = stack.settings.clickhouse_database, _q(job)
    (steps, steps_raw, step_keys, phases, phase_keys, events, summary_rows, windows, dead, dead_events) = stack.sql(f"""
        SELECT
          (SELECT count() FROM `{db}`.steps FINAL WHERE job_id = {j}),
          (SELECT count() FROM `{db}`.steps WHERE job_id = {j}),
          (SELECT uniqExact(rank, step) FROM `{db}`.steps FINAL WHERE job_id = {j}),
          (SELECT count() FROM `{db}`.phases FINAL WHERE job_id = {j}),
          (SELECT uniqExact(rank, step, kind, name, grp, stream, start_ns, duration_ns)
             FROM `{db}`.phases FINAL WHERE job_id = {j}),
          (SELECT sum(n_events) FROM `{db}`.kernel_summaries FINAL WHERE job_id = {j}),
          (SELECT count() FROM `{db}`.kernel_summaries FINAL WHERE job_id = {j}),
          (SELECT uniqExact(kernel, stream, rank, window_start_ns) FROM `{db}`.kernel_summaries FINAL
             WHERE job_id = {j}),
          (SELECT count() FROM `{db}`.dead_letters FINAL WHERE job_id = {j}),
          (SELECT sum(kernel_events) FROM `{db}`.dead_letters FINAL WHERE job_id = {j})""")[0]
    findings = fetch_findings(stack.settings, job)
    # Finding ids hash the job id: the same diagnosis of another job has the same id under one job name.
    ids = sorted(finding_id("job", f["level"], f["kind"], f["ranks"], f["phase"], f["kernel"], f["stream"],
                            f["steps"]) for f in findings)
    return {"steps": int(steps), "steps_raw": int(steps_raw), "step_duplicates": int(steps) - int(step_keys),
            "phases": int(phases), "phase_duplicates": int(phases) - int(phase_keys),
            "kernel_events": int(events or 0), "summary_rows": int(summary_rows), "windows": int(windows),
            "dead_letters": int(dead), "dead_letter_events": int(dead_events or 0),
            "findings": len(findings), "finding_duplicates": len(ids) - len(set(ids)), "finding_ids": ids,
            "findings_brief": sorted(f"{f['level']} {f['kind']} ranks={f['ranks']} {f['phase'] or f['kernel'] or ''}"
                                     f" steps={f['steps'][:3]}{'...' if len(f['steps']) > 3 else ''}"
                                     for f in findings)}


def window_mismatches(stack: FaultStack, job: str, clean_job: str) -> tuple[int, int]:
    """(windows whose summarized event count differs from the clean job's, total events of difference)."""
    db = stack.settings.clickhouse_database

    def per_window(j: str) -> str:
        return (f"SELECT kernel, stream, rank, window_start_ns, sum(n_events) AS n FROM `{db}`.kernel_summaries "
                f"FINAL WHERE job_id = {_q(j)} GROUP BY kernel, stream, rank, window_start_ns")

    row = stack.sql(f"""
        SELECT countIf(a.n != b.n), sum(abs(a.n - b.n))
        FROM ({per_window(job)}) AS a FULL OUTER JOIN ({per_window(clean_job)}) AS b
        USING (kernel, stream, rank, window_start_ns)""")[0]
    return int(row[0] or 0), int(row[1] or 0)


def wait_complete(stack: FaultStack, job: str, expect: dict[str, Any] | None = None,
                  timeout_s: float = DIAGNOSE_S) -> tuple[bool, dict[str, Any]]:
    """Wait until ``job`` is diagnosed through to the store (``findings --wait``'s condition), then until its
    facts equal ``expect`` or stay unchanged for 15 s (late rows still landing are waited for, a lasting
    difference is not). Returns (diagnosed in time, the facts)."""
    deadline = time.monotonic() + timeout_s
    diagnosed, last, changed = False, None, time.monotonic()
    while time.monotonic() < deadline:
        try:
            reasons: list[str] | None = pending_reasons(stack.settings, job)
        except Exception:  # the sink restarting: its endpoint is briefly away
            reasons = None
        if reasons == []:
            diagnosed = True
            break
        if reasons != last:
            last, changed = reasons, time.monotonic()
        elif time.monotonic() - changed > STALLED_S:
            break  # nothing moved for a minute: what is missing stays missing (the check reports it)
        time.sleep(1.0)
    facts = job_facts(stack, job)
    if expect is None:
        return diagnosed, facts
    keys = ("steps", "phases", "kernel_events", "finding_ids")
    stable_since, settle_deadline = time.monotonic(), time.monotonic() + 90
    while time.monotonic() < settle_deadline and any(facts[k] != expect[k] for k in keys):
        time.sleep(2.0)
        now = job_facts(stack, job)
        if now != facts:
            facts, stable_since = now, time.monotonic()
        elif time.monotonic() - stable_since >= 15:
            break
    return diagnosed, facts


#: Checked facts: equal to the clean run's, and the duplicates that survive FINAL (must be 0).
EQUAL_FACTS = ("steps", "phases", "kernel_events", "windows", "dead_letters", "dead_letter_events", "finding_ids")
DUPLICATE_FACTS = ("step_duplicates", "phase_duplicates", "finding_duplicates")


def compare_runs(stack: FaultStack, run: JobRun, clean: JobRun, expect: dict[str, Any], what: str,
                 extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Wait for ``run`` to be diagnosed, then assert it stored exactly what the clean run stored: every check
    is reported (a JSON line on stdout and in the message), then all must hold."""
    diagnosed, facts = wait_complete(stack, run.job, expect)
    mismatched_windows, events_off = window_mismatches(stack, run.job, clean.job)
    report: dict[str, Any] = {"test": what, "job": run.job, "clean_job": clean.job, **(extra or {}),
                              "diagnosed": diagnosed, "windows_differing": mismatched_windows,
                              "window_events_off": events_off}
    for key in (*EQUAL_FACTS, *DUPLICATE_FACTS, "steps_raw", "summary_rows", "findings"):
        if key != "finding_ids":
            report[key] = [expect[key], facts[key]]  # [clean, this run]
    report["findings_only_clean"] = sorted(set(expect["findings_brief"]) - set(facts["findings_brief"]))
    report["findings_only_here"] = sorted(set(facts["findings_brief"]) - set(expect["findings_brief"]))
    print(json.dumps(report))
    failed = [k for k in EQUAL_FACTS if facts[k] != expect[k]] + [k for k in DUPLICATE_FACTS if facts[k] != 0]
    if mismatched_windows:
        failed.append("per-window kernel events")
    if not diagnosed:
        failed.append("diagnosed (the findings --wait condition)")
    assert not failed, f"{what}: {', '.join(failed)} differ from the clean run:\n{json.dumps(report, indent=1)}"
    return facts


@pytest.fixture(scope="session")
def fault_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultStack]:
    stack = FaultStack(tmp_path_factory.mktemp("faults") / "home")
    try:
        stack.up()
        yield stack
    finally:
        stack.down()


@pytest.fixture(scope="session")
def clean_run(fault_stack: FaultStack) -> tuple[JobRun, dict[str, Any]]:
    """The suite's job without faults, published the same way (paced), and what the store holds of it."""
    run = publish_job(fault_stack, f"clean-{uuid.uuid4().hex[:6]}")
    diagnosed, facts = wait_complete(fault_stack, run.job)
    assert diagnosed, f"clean job {run.job} not diagnosed in {DIAGNOSE_S:.0f} s: {facts}\n{fault_stack.logs()}"
    return run, facts
