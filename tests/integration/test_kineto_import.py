"""A real third-party trace (PARAM DLRM, 8 ranks) imported through Kafka: every kernel summarized, diagnosed."""

from __future__ import annotations

from pathlib import Path

import pytest

from argus.core.settings import Settings
from argus.producers.kineto import import_kineto
from argus.sinks.findings_query import fetch_findings, wait_diagnosed
from tests.integration.conftest import SinkThread, WorkerProcess

pytestmark = pytest.mark.integration

DLRM = Path(__file__).resolve().parents[2].parent / "shared" / "realtraces" / "param_dlrm_8rank_v100"


@pytest.mark.skipif(not DLRM.is_dir(), reason=f"{DLRM} is absent")
def test_import_real_dlrm_trace(settings: Settings, worker: WorkerProcess, sink: SinkThread) -> None:
    report = import_kineto(settings, DLRM, "dlrm")
    assert report.ranks == tuple(range(8)) and report.records_dropped == 0
    sink.wait_for("SELECT sum(n_events) FROM {db}.kernel_summaries FINAL WHERE job_id = 'dlrm'", report.kernel_events)
    assert sink.scalar("SELECT count() FROM {db}.dead_letters FINAL") == 0
    assert sink.scalar("SELECT uniqExact(rank) FROM {db}.kernel_summaries FINAL") == 8
    assert sink.scalar("SELECT count() FROM {db}.steps FINAL WHERE job_id = 'dlrm'") == 8
    assert wait_diagnosed(settings, "dlrm", 120, query=sink.store.query)
    findings = fetch_findings(settings, "dlrm", query=sink.store.query)
    assert all(f["level"] in ("L1", "L2", "L3") for f in findings)
