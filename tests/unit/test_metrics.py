"""The Prometheus exporters: collectors read the processes' own counters at scrape time; the publisher's
endpoint is opt-in, per LOCAL_RANK, and never fails the publisher."""

from __future__ import annotations

import json
import logging
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from argus.core.errors import ConfigError
from argus.core.settings import Settings
from argus.metrics import CONTENT_TYPE, Histogram, exposition, start_metrics_server
from argus.producers.publisher import Publisher
from argus.producers.publisher_metrics import metrics_port
from argus.sinks.metrics import sink_registry, start_sink_metrics
from argus.sinks.tables import TABLES
from argus.sinks.writer import SinkWriter, _Pending
from argus.streams.app import CompressionStats
from argus.streams.diagnosis_stats import DiagnosisStats
from argus.streams.metrics import WorkerCollector, consumer_lag, worker_registry
from argus.topics import Topic
from tests.samples import kernel_batch

NO_BROKER = "127.0.0.1:1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def samples_of(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``{(sample name, sorted labels): value}`` of an exposition."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(text: str, name: str, **labels: str) -> float:
    return samples_of(text)[(name, tuple(sorted(labels.items())))]


def test_histogram_buckets_are_cumulative_and_inclusive() -> None:
    h = Histogram(bounds=(0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 7.0):
        h.observe(v)
    assert h.buckets() == [("0.1", 2.0), ("1.0", 3.0), ("+Inf", 4.0)]
    assert h.count == 4 and h.total == pytest.approx(7.65)


@dataclass(frozen=True)
class _TP:
    topic: str
    partition: int


class _Consumer:
    """The parts of Faust's consumer the lag metric reads."""

    def __init__(self) -> None:
        self.tps = [_TP("t.kernels", 0), _TP("t.kernels", 1), _TP("t.steps", 3), _TP("t.steps", 4)]
        self._committed_offset = {self.tps[0]: 40, self.tps[2]: 7}
        self.high = {self.tps[0]: 100, self.tps[1]: 12, self.tps[2]: 7, self.tps[3]: None}

    def assignment(self) -> set[_TP]:
        return set(self.tps)

    def highwater(self, tp: _TP) -> int | None:
        return self.high[tp]


def test_consumer_lag_per_partition_from_cached_offsets() -> None:
    lag = consumer_lag(_Consumer())
    # Nothing committed on t.kernels[1]: all its messages count; t.steps[4] not fetched yet: left out.
    assert lag == {("t.kernels", "0"): 60.0, ("t.kernels", "1"): 12.0, ("t.steps", "3"): 0.0}
    assert consumer_lag(_Consumer(), topics={"t.steps"}) == {("t.steps", "3"): 0.0}

    class Broken:
        def assignment(self) -> Any:
            raise RuntimeError("not started")

    assert consumer_lag(Broken()) == {}


def test_worker_collector_reads_the_agents_counters_at_scrape_time() -> None:
    comp, diag = CompressionStats(), DiagnosisStats()
    registry = worker_registry(WorkerCollector(comp, diag, open_windows=lambda: 5, pending_messages=lambda: 2,
                                               consumer=_Consumer))
    before = exposition(registry).decode()
    assert value(before, "argus_worker_kernel_events_total") == 0
    assert value(before, "argus_worker_diagnosis_latency_seconds_count", scope="l1l2") == 0
    # The agents increment their plain counters; the next scrape sees them (nothing registered per event).
    comp.events_in, comp.summaries_out, comp.dead_letters, diag.dead_letters = 4096, 12, 1, 2
    diag.findings_by_kind = {"L2": {"compute_straggler": 3}, "L3": {"kernel_degraded": 1}}
    diag.diagnosis_latency_s["l1l2"].observe(0.3)
    diag.diagnosis_latency_s["job"].observe(2.0)
    diag.finding_delay_s.observe(4.0)
    diag.last_finding_ns = 1_700_000_000_000_000_000
    text = exposition(registry).decode()
    assert value(text, "argus_worker_kernel_events_total") == 4096
    assert value(text, "argus_worker_summaries_total") == 12
    assert value(text, "argus_worker_open_windows") == 5 and value(text, "argus_worker_pending_messages") == 2
    assert value(text, "argus_worker_dead_letters_total", stage="compress") == 1
    assert value(text, "argus_worker_dead_letters_total", stage="diagnose") == 2
    assert value(text, "argus_worker_findings_total", level="L2", kind="compute_straggler") == 3
    assert value(text, "argus_worker_findings_total", level="L3", kind="kernel_degraded") == 1
    assert value(text, "argus_worker_diagnosis_latency_seconds_bucket", scope="l1l2", le="0.5") == 1
    assert value(text, "argus_worker_diagnosis_latency_seconds_bucket", scope="l1l2", le="0.25") == 0
    assert value(text, "argus_worker_diagnosis_latency_seconds_sum", scope="job") == 2.0
    assert value(text, "argus_worker_finding_delay_seconds_count") == 1
    assert value(text, "argus_worker_last_finding_timestamp_seconds") == pytest.approx(1.7e9)
    assert value(text, "argus_worker_consumer_lag_messages", topic="t.kernels", partition="0") == 60
    assert value(text, "argus_worker_assigned_partitions") == 4
    labels = {k for (_, ls) in samples_of(text) for k, _ in ls}
    assert labels <= {"stage", "by", "level", "kind", "scope", "le", "topic", "partition"}  # never job or rank


class _Store:
    """A ClickHouse store that takes every insert."""

    def __init__(self) -> None:
        self.inserted: list[tuple[str, int]] = []

    def insert(self, table: Any, rows: list[Any]) -> None:
        self.inserted.append((table.name, len(rows)))

    def ensure_schema(self) -> None:
        pass


def _finding_row(level: str, kind: str) -> tuple[Any, ...]:
    return tuple({"level": level, "kind": kind}.get(name, 0) for name, _, _ in TABLES["findings"].columns)


@pytest.fixture
def writer() -> Any:
    w = SinkWriter(Settings.load(env={}, bootstrap_servers=NO_BROKER), _Store())  # type: ignore[arg-type]
    yield w
    w.close()


def test_sink_collector_counts_rows_findings_and_insert_latency(writer: SinkWriter) -> None:
    writer._insert(TABLES["findings"], [_Pending(None, [_finding_row("L2", "compute_straggler")] * 2),  # type: ignore[arg-type]
                                        _Pending(None, [_finding_row("L1", "iteration_slow")])])  # type: ignore[arg-type]
    writer._insert(TABLES["steps"], [_Pending(None, [("j", 0, 1, 0, 5, None)] * 3)])  # type: ignore[arg-type]
    text = exposition(sink_registry(writer)).decode()
    assert value(text, "argus_sink_rows_total", table="findings") == 3
    assert value(text, "argus_sink_rows_total", table="steps") == 3
    assert value(text, "argus_sink_findings_total", level="L2", kind="compute_straggler") == 2
    assert value(text, "argus_sink_findings_total", level="L1", kind="iteration_slow") == 1
    assert value(text, "argus_sink_insert_seconds_count", table="steps") == 1
    assert value(text, "argus_sink_insert_seconds_bucket", table="steps", le="+Inf") == 1
    assert value(text, "argus_sink_dead_letters_total") == 0
    assert "# TYPE argus_sink_consumer_lag_messages gauge" in text  # no partition assigned without a broker


def _get(url: str) -> tuple[str, str]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.headers["Content-Type"], resp.read().decode()


def test_sink_process_metrics_server_on_loopback(writer: SinkWriter) -> None:
    assert start_sink_metrics(Settings.load(env={}, sink_metrics_port=0), writer) is None  # 0: off
    settings = Settings.load(env={}, bootstrap_servers=NO_BROKER, sink_metrics_port=_free_port())
    server = start_sink_metrics(settings, writer)
    assert server is not None and server.url == f"http://127.0.0.1:{settings.sink_metrics_port}/metrics"
    try:
        ctype, text = _get(server.url)
        assert ctype == CONTENT_TYPE
        assert value(text, "argus_sink_messages_total") == 0
    finally:
        server.stop()
    with pytest.raises(urllib.error.URLError):
        _get(server.url)


def test_a_port_in_use_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with caplog.at_level(logging.WARNING):
            assert start_metrics_server(CollectorRegistry(), "127.0.0.1", port, "test") is None
    assert "test metrics not served" in caplog.text


def test_publisher_metrics_are_off_by_default() -> None:
    pub = Publisher(Settings.load(env={}, bootstrap_servers=NO_BROKER), sender=False)
    assert pub.metrics_url is None
    pub.close(timeout_s=0.2)


def test_publisher_metrics_port_is_offset_by_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings.load(env={}, publisher_metrics_port=16100)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert metrics_port(settings) == 16100
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert metrics_port(settings) == 16103
    monkeypatch.setenv("LOCAL_RANK", "not a number")
    assert metrics_port(settings) == 16100
    assert metrics_port(Settings.load(env={})) == 0


def test_publisher_opt_in_endpoint_shows_drops_and_queue_depth(monkeypatch: pytest.MonkeyPatch) -> None:
    base = _free_port() - 2
    monkeypatch.setenv("LOCAL_RANK", "2")
    settings = Settings.load(env={}, bootstrap_servers=NO_BROKER, publisher_queue_max=3, publisher_metrics_port=base)
    pub = Publisher(settings, sender=False)  # nothing drains the queue: it fills, then drops
    try:
        assert pub.metrics_url == f"http://127.0.0.1:{base + 2}/metrics"
        for _ in range(5):
            pub.publish(Topic.KERNELS, b"j/0", kernel_batch())
        ctype, text = _get(pub.metrics_url)
        assert ctype == CONTENT_TYPE
        assert value(text, "argus_publisher_records_accepted_total") == 3
        assert value(text, "argus_publisher_records_dropped_total") == 2
        assert value(text, "argus_publisher_queue_depth") == 3
        assert value(text, "argus_publisher_queue_capacity") == 3
        assert value(text, "argus_publisher_delivery_errors_total") == 0
        assert value(text, "argus_publisher_kafka_queue_messages") >= 0  # librdkafka counts its requests too
    finally:
        t0 = time.monotonic()
        pub.close(timeout_s=0.3)
        assert time.monotonic() - t0 < 2
    assert pub.metrics_url is None
    with pytest.raises(urllib.error.URLError):
        _get(f"http://127.0.0.1:{base + 2}/metrics")


def test_publisher_bind_failure_warns_and_publishing_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        settings = Settings.load(env={}, bootstrap_servers=NO_BROKER, publisher_metrics_port=busy.getsockname()[1])
        with caplog.at_level(logging.WARNING):
            pub = Publisher(settings, sender=False)
        assert pub.metrics_url is None
        assert pub.publish(Topic.KERNELS, b"j/0", kernel_batch())
        pub.close(timeout_s=0.2)
    assert "publisher metrics not served" in caplog.text


@pytest.mark.parametrize("overrides", [{"sink_metrics_port": 70000}, {"publisher_metrics_port": -1},
                                       {"worker_web_port": 65536}, {"metrics_host": ""},
                                       {"metrics_host": "http://0.0.0.0"}, {"metrics_host": "a b"}])
def test_metrics_settings_are_validated(overrides: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        Settings.load(env={}, **overrides)


def test_metrics_settings_from_the_environment() -> None:
    s = Settings.load(env={"ARGUS_SINK_METRICS_PORT": "0", "ARGUS_PUBLISHER_METRICS_PORT": "16100",
                           "ARGUS_METRICS_HOST": "0.0.0.0"})
    assert (s.sink_metrics_port, s.publisher_metrics_port, s.metrics_host) == (0, 16100, "0.0.0.0")
    assert Settings.load(env={}).sink_metrics_port == 16067 and Settings.load(env={}).metrics_host == "127.0.0.1"


def test_sink_lag_comes_from_librdkafka_statistics(writer: SinkWriter) -> None:
    assert writer.consumer_lag() == {}
    writer._on_stats(json.dumps({"topics": {"t.steps": {"partitions": {
        "0": {"consumer_lag": 12, "fetch_state": "active"},
        "1": {"consumer_lag": -1, "fetch_state": "active"},  # nothing committed yet
        "2": {"consumer_lag": 5, "fetch_state": "none"},  # not assigned here
        "-1": {"consumer_lag": 0, "fetch_state": "none"}}}}}))
    assert writer.consumer_lag() == {("t.steps", "0"): 12.0}
    writer._on_stats("not json")  # never raises; the last report stays
    text = exposition(sink_registry(writer)).decode()
    assert value(text, "argus_sink_consumer_lag_messages", topic="t.steps", partition="0") == 12
