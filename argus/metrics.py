"""What the argus exporters share: a cheap histogram accumulator, metric families and a loopback ``/metrics``
server that never fails its host process.

Every argus process keeps plain counters (``CompressionStats``, ``DiagnosisStats``, ``SinkStats``, the
publisher's counters) and exports them through a :class:`prometheus_client` *collector* that reads them at
scrape time, into a :class:`~prometheus_client.CollectorRegistry` of its own (never the global default one):
nothing is added to the per-event path but the counters that were already there, and a :class:`Histogram`
observation (a bisect and two additions) per job, finding or insert.

Metric names follow Prometheus conventions: ``argus_<process>_...``, ``_total`` for counters, ``_seconds``
for durations, ``_bytes`` for sizes, and low-cardinality labels only (level, kind, stage, topic, partition,
table): never a job id or a rank.
"""

from __future__ import annotations

import bisect
import logging
import socket
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, MetricsHandler, generate_latest

__all__ = ["CONTENT_TYPE", "DELAY_BUCKETS_S", "IMPACT_BUCKETS_S", "LATENCY_BUCKETS_S", "Histogram", "MetricsServer",
           "counter", "exposition", "gauge", "histogram", "start_metrics_server"]

log = logging.getLogger(__name__)

#: Content type of the text exposition format argus serves (Prometheus text format 0.0.4).
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
#: Bucket upper bounds, in seconds, for short latencies (an insert, a job's diagnosis after its END).
LATENCY_BUCKETS_S: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                                         60.0, 120.0, 300.0)
#: Bucket upper bounds, in seconds, for how far behind the ranks' clocks a finding is published.
DELAY_BUCKETS_S: tuple[float, ...] = (0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0,
                                       3600.0)
#: Bucket upper bounds, in GPU-seconds lost per step, for a finding's impact (``impact_ns_per_step / 1e9``). An
#: alert on findings above an impact compares against one of these bounds (deploy/prometheus/rules/).
IMPACT_BUCKETS_S: tuple[float, ...] = (0.001, 0.01, 0.1, 1.0, 10.0, 100.0, 1000.0)


@dataclass
class Histogram:
    """Observations counted in fixed buckets, and their sum: a plain accumulator the exporters read.

    ``bounds`` are the buckets' upper bounds (inclusive, increasing); ``counts`` has one more entry, for the
    observations above the last bound. Not locked: one writer (the event loop, or the sink's thread); a
    scrape from another thread may see the newest observation in the count and not yet in the sum.
    """

    bounds: tuple[float, ...] = LATENCY_BUCKETS_S
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        """Count one observation (same unit as ``bounds``)."""
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative ``(le, count)`` pairs, ending with ``+Inf``, as Prometheus wants them."""
        counts, out, running = list(self.counts), [], 0
        for bound, n in zip(self.bounds, counts, strict=False):
            running += n
            out.append((_le(bound), float(running)))
        out.append(("+Inf", float(running + counts[-1])))
        return out


def _le(bound: float) -> str:
    return repr(float(bound))


def counter(name: str, doc: str, value: float | None = None, labels: Iterable[str] = (),
            samples: Mapping[Any, float] | None = None) -> CounterMetricFamily:
    """A counter family ``name`` (with its ``_total`` suffix): one unlabelled ``value``, or one sample per
    label values in ``samples``."""
    family = CounterMetricFamily(name, doc, value=value, labels=list(labels) if value is None else None)
    for key, v in (samples or {}).items():
        family.add_metric(list(key), v)
    return family


def gauge(name: str, doc: str, value: float | None = None, labels: Iterable[str] = (),
          samples: Mapping[Any, float] | None = None) -> GaugeMetricFamily:
    """A gauge family, as :func:`counter`."""
    family = GaugeMetricFamily(name, doc, value=value, labels=list(labels) if value is None else None)
    for key, v in (samples or {}).items():
        family.add_metric(list(key), v)
    return family


def histogram(name: str, doc: str, hists: Mapping[Any, Histogram],
              labels: Iterable[str] = ()) -> HistogramMetricFamily:
    """A histogram family from :class:`Histogram` accumulators, one per label values."""
    family = HistogramMetricFamily(name, doc, labels=list(labels))
    for key, h in hists.items():
        buckets = h.buckets()
        family.add_metric(list(key), buckets, sum_value=h.total)
    return family


def exposition(registry: CollectorRegistry) -> bytes:
    """The registry's metrics in the text format (:data:`CONTENT_TYPE`)."""
    return generate_latest(registry)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


class MetricsServer:
    """``registry`` served at ``/metrics`` (any path) by a daemon thread on ``host:port``.

    Built by :func:`start_metrics_server`; :meth:`stop` ends it (within about 0.1 s).
    """

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        server_class = type("_MetricsHTTPServer", (_Server,), {"address_family": family})
        self._httpd = server_class((host, port), MetricsHandler.factory(registry))
        self.host = host
        self.port = int(self._httpd.server_address[1])
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                        name=f"argus-metrics-{self.port}", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def stop(self) -> None:
        """Stop serving and close the socket; idempotent."""
        if self._thread.is_alive():
            self._httpd.shutdown()
            self._thread.join(timeout=2)
        self._httpd.server_close()


def start_metrics_server(registry: CollectorRegistry, host: str, port: int, what: str) -> MetricsServer | None:
    """Serve ``registry`` on ``host:port`` (``port`` 0: off, ``None`` returned); a port that cannot be bound
    (in use, no permission, unknown host) is logged as a warning and ``None`` returned: metrics never stop
    the process they describe. ``what`` names the process in the log."""
    if port <= 0:
        return None
    try:
        server = MetricsServer(registry, host, port)
    except Exception as exc:  # OSError (in use, permission), socket.gaierror, ...: carry on without metrics
        log.warning("%s metrics not served on %s:%d: %s", what, host, port, exc)
        return None
    log.info("%s metrics on %s", what, server.url)
    return server
