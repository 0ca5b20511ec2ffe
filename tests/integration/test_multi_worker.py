"""Several workers, one answer: the same job through one worker process and through two (4 partitions, so
each holds half of every topic: the job's steps on one, its L3 parts spread over both) gives the same
findings, because what one worker knows of a job and the others need travels on the context topic."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest

from argus.core.settings import Settings
from argus.producers.faults import Fault
from argus.producers.seed_cases import paper_case
from argus.producers.simulator import JobSimulator
from argus.schemas.records import JobLifecycle
from argus.sinks.findings_query import fetch_findings, wait_diagnosed
from tests.integration.conftest import SinkThread, WorkerProcess, _free_port, fresh_settings
from tests.integration.test_diagnosis_cases import run_job
from tests.integration.test_poison import _publish

pytestmark = pytest.mark.integration


def _judged(findings: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return sorted((f["level"], f["kind"], tuple(f["ranks"]), f["phase"], f["kernel"], f["stream"], tuple(f["steps"]))
                  for f in findings)


def _scores(findings: list[dict[str, Any]]) -> list[float]:
    return [f["score"] for f in sorted(findings, key=lambda f: (f["level"], f["kind"], f["ranks"], f["kernel"] or ""))]


def _wait_split(workers: list[WorkerProcess], timeout_s: float = 90) -> None:
    """Until every worker holds partitions, the same ones for 3 s (the group settled)."""
    deadline, last, since = time.monotonic() + timeout_s, None, time.monotonic()
    while time.monotonic() < deadline:
        now = [(w.stats() or {}).get("assigned_partitions", 0) for w in workers]
        if now != last:
            last, since = now, time.monotonic()
        elif all(now) and time.monotonic() - since > 3:
            return
        time.sleep(0.3)
    raise AssertionError(f"the workers did not share the partitions: {last}")


def test_one_and_two_workers_give_the_same_findings(settings: Settings, sink: SinkThread, kafka: str,
                                                    chdb_store: Any, tmp_path: Path) -> None:
    """Two jobs (a compute straggler, a degraded link) through one worker, then through two."""
    specs = [paper_case(fault, job_id=f"multi-{fault.value.lower()}", steps=30)
             for fault in (Fault.COMPUTE_STRAGGLER, Fault.LINK_DEGRADATION)]
    alone = WorkerProcess(settings, tmp_path / "alone.log")
    try:
        alone.wait_healthy()
        one = [run_job(settings, spec, sink) for spec in specs]
    finally:
        alone.stop()

    two_settings = fresh_settings(kafka, tmp_path / "two")
    two_sink = SinkThread(two_settings, chdb_store)
    second = dataclasses.replace(two_settings, worker_web_port=_free_port(), home=tmp_path / "two" / "second")
    workers = [WorkerProcess(two_settings, tmp_path / "a.log"), WorkerProcess(second, tmp_path / "b.log")]
    try:
        for w in workers:
            w.wait_healthy()
        _wait_split(workers)
        two = [run_job(two_settings, spec, two_sink) for spec in specs]
        stats = [w.stats() or {} for w in workers]
    finally:
        for w in workers:
            w.stop()
        two_sink.stop()
    # Both took part: each compressed kernels and judged L3 parts; each job's steps were on one worker only
    # (both jobs are diagnosed, and two DIAGNOSED jobs between the workers: none was judged twice).
    assert all(s["batches"] > 0 and s["diagnosis"]["l3_parts_diagnosed"] > 0 for s in stats), stats
    assert sum(s["diagnosis"]["jobs_diagnosed"] for s in stats) == 2, stats
    for spec, a, b in zip(specs, one, two, strict=True):
        assert a and _judged(b) == _judged(a), spec.job_id
        # The same scores too, within 1 %: L1's score was seen to differ in its third digit between two runs
        # of the same job (as it can on one worker), which is not what this test is about.
        assert _scores(b) == pytest.approx(_scores(a), rel=0.01), spec.job_id


def test_a_worker_joining_mid_job_loses_no_window_and_doubles_no_summary(settings: Settings, sink: SinkThread,
                                                                         tmp_path: Path) -> None:
    """Half of a job through one worker, then a second joins (the partitions are rebalanced while windows
    are open and records held): every kernel event summarized once, every step once, and the findings of
    the whole job as one worker alone gives them (paper case 1: ranks 5, L1 from step 15)."""
    spec = paper_case(Fault.COMPUTE_STRAGGLER, job_id="join", steps=30)
    records = list(JobSimulator(spec, batch_events=settings.publisher_batch_events).records())
    end = next(r.record for r in reversed(records) if isinstance(r.record, JobLifecycle))
    half = len(records) // 2
    first = WorkerProcess(settings, tmp_path / "first.log")
    joiner: WorkerProcess | None = None
    try:
        first.wait_healthy()
        _publish(settings, records[:half])
        deadline = time.monotonic() + 90
        while (first.stats() or {}).get("events_in", 0) == 0 or (first.stats() or {}).get("open_windows", 0) == 0:
            assert time.monotonic() < deadline, f"the first worker read nothing: {first.stats()}"
            time.sleep(0.3)
        joiner = WorkerProcess(dataclasses.replace(settings, worker_web_port=_free_port(), home=tmp_path / "joiner"),
                               tmp_path / "joiner.log")
        joiner.wait_healthy()
        _wait_split([first, joiner])
        _publish(settings, records[half:])
        assert wait_diagnosed(settings, "join", 180, query=sink.store.query), "diagnosis did not complete"
        time.sleep(1.0)
        findings = fetch_findings(settings, "join", query=sink.store.query)
    finally:
        for w in (first, joiner):
            if w is not None:
                w.stop()
    events = sink.scalar("SELECT sum(n_events) FROM {db}.kernel_summaries FINAL WHERE job_id = 'join'")
    assert events == end.kernel_events
    assert sink.scalar("SELECT count() FROM {db}.steps FINAL WHERE job_id = 'join'") == spec.world_size * spec.steps
    assert [(f["kind"], f["steps"]) for f in findings if f["level"] == "L1"] == [("step_regression", [15])]
    assert {r for f in findings if f["level"] in ("L2", "L3") for r in f["ranks"]} == {5}, findings
