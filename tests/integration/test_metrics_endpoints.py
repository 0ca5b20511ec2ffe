"""The real exporters after a real job: the worker's ``/metrics`` (over HTTP, from the ``argus worker``
process), the sink's metrics server as ``argus sink`` starts it, the publisher's opt-in endpoint; and the
dashboard's queries against what they serve and what the sink stored."""

from __future__ import annotations

import socket
import time
import urllib.request
from collections.abc import Callable

import pytest
from prometheus_client.parser import text_string_to_metric_families

from argus.core.settings import Settings
from argus.metrics import CONTENT_TYPE
from argus.producers.faults import Fault
from argus.producers.publisher import Publisher
from argus.producers.seed_cases import paper_case
from argus.producers.simulator import JobSimulator
from argus.sinks.metrics import start_sink_metrics
from argus.topics import Topic
from tests.dashboards import clickhouse_sql, dashboard, exported_names, metric_names, prometheus_exprs, runnable_sql
from tests.integration.conftest import SinkThread, WorkerProcess

pytestmark = pytest.mark.integration

JOB = "metrics-job"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(url: str) -> tuple[str, str]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.headers["Content-Type"], resp.read().decode()


def _total(text: str, name: str, **labels: str) -> float:
    """Sum of the samples ``name`` whose labels include ``labels``."""
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name and labels.items() <= s.labels.items())


def _wait(url: str, done: Callable[[str], bool], timeout_s: float = 90) -> str:
    deadline, text = time.monotonic() + timeout_s, ""
    while time.monotonic() < deadline:
        text = _scrape(url)[1]
        if done(text):
            return text
        time.sleep(0.5)
    raise AssertionError(f"{url} never got there:\n{text[-4000:]}")


def test_worker_sink_and_publisher_metrics_after_a_job(settings: Settings, worker: WorkerProcess,
                                                       sink: SinkThread) -> None:
    spec = paper_case(Fault.COMPUTE_STRAGGLER, job_id=JOB, steps=20)
    records = list(JobSimulator(spec, batch_events=settings.publisher_batch_events).records())
    kernel_events = sum(len(r.record) for r in records if r.topic is Topic.KERNELS)

    # The publisher's opt-in endpoint, as a training process with ARGUS_PUBLISHER_METRICS_PORT set has it.
    with Publisher(settings.replace(publisher_metrics_port=_free_port()), lossless=True) as pub:
        for rec in records:
            assert pub.publish(rec.topic, rec.key, rec.record)
        assert pub.flush(30) == 0
        assert pub.metrics_url is not None
        publisher_text = _scrape(pub.metrics_url)[1]
    assert _total(publisher_text, "argus_publisher_records_delivered_total") == len(records)
    assert _total(publisher_text, "argus_publisher_records_dropped_total") == 0
    assert _total(publisher_text, "argus_publisher_delivered_bytes_total", topic=Topic.KERNELS.full(settings)) > 0

    # The sink's metrics server, started as argus.sinks.writer.serve starts it, over the fixture's writer.
    server = start_sink_metrics(settings.replace(sink_metrics_port=_free_port()), sink.writer)
    assert server is not None
    try:
        worker_url = f"http://127.0.0.1:{settings.worker_web_port}/metrics"
        worker_text = _wait(worker_url, lambda t: (
            _total(t, "argus_worker_kernel_events_total") == kernel_events
            and _total(t, "argus_worker_findings_total") > 0
            and _total(t, "argus_worker_diagnosis_latency_seconds_count", scope="l1l2") >= 1
            and _total(t, "argus_worker_diagnosis_latency_seconds_count", scope="job") >= 1))
        ctype, _ = _scrape(worker_url)
        assert ctype == CONTENT_TYPE
        assert _total(worker_text, "argus_worker_summaries_total") > 0
        levels = {s.labels["level"] for fam in text_string_to_metric_families(worker_text) for s in fam.samples
                  if s.name == "argus_worker_findings_total"}
        assert levels and levels <= {"L1", "L2", "L3"}
        assert _total(worker_text, "argus_worker_dead_letters_total") == 0
        assert _total(worker_text, "argus_worker_jobs_diagnosed_total") == 1
        assert _total(worker_text, "argus_worker_finding_delay_seconds_count") == \
            _total(worker_text, "argus_worker_findings_total")
        lag = [s for fam in text_string_to_metric_families(worker_text) for s in fam.samples
               if s.name == "argus_worker_consumer_lag_messages"]
        assert lag and {s.labels["topic"] for s in lag} >= {Topic.KERNELS.full(settings)}
        assert worker.stats() is not None  # /stats still there next to /metrics

        found = _total(worker_text, "argus_worker_findings_total")
        sink_text = _wait(server.url, lambda t: (_total(t, "argus_sink_findings_total") >= found
                                                 and _total(t, "argus_sink_rows_total", table="steps") >= 160
                                                 and "argus_sink_consumer_lag_messages{" in t))  # every 5 s
        assert _total(sink_text, "argus_sink_insert_seconds_count", table="steps") >= 1
        assert _total(sink_text, "argus_sink_dead_letters_total") == 0
        assert _total(sink_text, "argus_sink_batches_total") >= 1
        sink_lag = {s.labels["topic"] for fam in text_string_to_metric_families(sink_text) for s in fam.samples
                    if s.name == "argus_sink_consumer_lag_messages"}
        assert sink_lag <= {t.full(settings) for t in Topic}
    finally:
        server.stop()

    # The dashboard: its PromQL reads only what the real exporters serve, its SQL runs on what the sink stored.
    exported = exported_names(worker_text) | exported_names(sink_text) | exported_names(publisher_text)
    for where, expr in prometheus_exprs(dashboard()).items():
        assert metric_names(expr) <= exported, where
    for title, sql in clickhouse_sql(dashboard()).items():
        rows = sink.store.query(runnable_sql(sql, sink.store.database, JOB)).rows
        if title.startswith(("Iteration time", "Straggler heat map", "Findings", "variable job")):
            assert rows, title
