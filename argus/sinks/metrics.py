"""Prometheus metrics of the ClickHouse sink, on their own loopback port.

:func:`start_sink_metrics` (called by :func:`argus.sinks.writer.serve`, the ``argus sink`` process) serves
``/metrics`` on ``metrics_host:sink_metrics_port`` (default ``127.0.0.1:16067``; port 0: off) from a daemon
thread. :class:`SinkCollector` reads the writer's :class:`~argus.sinks.writer.SinkStats` when Prometheus scrapes:
the insert path only keeps the counters it kept before, plus one histogram observation per insert; the lag
comes from librdkafka's statistics, every 5 s, on the sink's own thread (a scrape never calls into the
consumer). The SQL endpoint (:mod:`argus.sinks.query_server`) is separate and unchanged.

Exported (all ``argus_sink_``, counted since the process started): see docs/internals/sinks.md.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric

from argus.core.settings import Settings
from argus.metrics import MetricsServer, counter, gauge, histogram, start_metrics_server
from argus.sinks.writer import SinkWriter

__all__ = ["SinkCollector", "sink_registry", "start_sink_metrics"]

_PREFIX = "argus_sink_"


class SinkCollector:
    """Reads a :class:`SinkWriter`'s counters at scrape time (from any thread)."""

    def __init__(self, writer: SinkWriter) -> None:
        self.writer = writer

    def collect(self) -> Iterator[Metric]:
        s = self.writer.stats
        yield counter(_PREFIX + "messages", "Kafka messages stored (their batch committed).", float(s.messages))
        yield counter(_PREFIX + "batches", "Batches consumed (stored or rewound).", float(s.batches))
        yield counter(_PREFIX + "commits", "Offset commits after a stored batch.", float(s.commits))
        yield counter(_PREFIX + "batch_failures", "Batches rewound to be retried (ClickHouse or broker trouble).",
                      float(s.insert_failures))
        yield counter(_PREFIX + "rows", "Rows inserted, per table.", labels=("table",),
                      samples={(t,): float(n) for t, n in list(s.rows.items())})
        yield histogram(_PREFIX + "insert_seconds", "Duration of each successful ClickHouse insert, per table.",
                        {(t,): h for t, h in list(s.insert_latency_s.items())}, labels=("table",))
        yield counter(_PREFIX + "dead_letters", "Messages dead-lettered by the sink.", float(s.dead_lettered))
        yield counter(_PREFIX + "findings", "Findings stored, by level (L1, L2, L3) and kind.",
                      labels=("level", "kind"),
                      samples={(level, kind): float(n) for level, kinds in list(s.findings.items())
                               for kind, n in list(kinds.items())})
        yield gauge(_PREFIX + "consumer_lag_messages", "High-water offset minus committed offset, per partition "
                    "assigned (librdkafka statistics, every 5 s).", labels=("topic", "partition"),
                    samples=self.writer.consumer_lag())
        yield gauge(_PREFIX + "last_commit_timestamp_seconds", "Wall-clock time of the last offset commit "
                    "(0: none yet).", s.last_commit_ns / 1e9)


def sink_registry(writer: SinkWriter) -> CollectorRegistry:
    """A registry of its own (not prometheus_client's global one) with a :class:`SinkCollector`."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SinkCollector(writer))
    return registry


def start_sink_metrics(settings: Settings, writer: SinkWriter) -> MetricsServer | None:
    """Serve ``writer``'s metrics on ``metrics_host:sink_metrics_port``; ``None`` when the port is 0 or cannot
    be bound (logged: the sink runs on without metrics). Stop the server before closing the writer."""
    return start_metrics_server(sink_registry(writer), settings.metrics_host, settings.sink_metrics_port, "sink")
