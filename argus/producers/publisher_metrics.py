"""Opt-in Prometheus metrics of the rank-side publisher, for the training processes.

Off by default. With ``ARGUS_PUBLISHER_METRICS_PORT=<base>`` every :class:`~argus.producers.publisher.Publisher`
serves ``/metrics`` on ``metrics_host`` (default ``127.0.0.1``) at port ``base + LOCAL_RANK`` (``LOCAL_RANK``
as torchrun sets it, 0 when unset or not a number), so the ranks of one host get distinct ports: scrape
``base .. base + nproc_per_node - 1``. A second publisher in the same process (or a port in use) cannot bind:
that is logged as a warning and the publisher runs on without metrics; the server is a daemon thread that
never touches the publish path (:class:`PublisherCollector` reads the publisher's counters when scraped).

Exported (all ``argus_publisher_``, counted since the publisher was created): see docs/internals/producers.md.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric

from argus.core.settings import Settings
from argus.metrics import MetricsServer, counter, gauge, start_metrics_server

if TYPE_CHECKING:
    from argus.producers.publisher import Publisher

__all__ = ["PublisherCollector", "local_rank", "metrics_port", "publisher_registry", "start_publisher_metrics"]

log = logging.getLogger(__name__)

_PREFIX = "argus_publisher_"


def local_rank() -> int:
    """This process's ``LOCAL_RANK`` (0 when unset, negative or not a number)."""
    try:
        return max(0, int(os.environ.get("LOCAL_RANK", "0")))
    except ValueError:
        return 0


def metrics_port(settings: Settings) -> int:
    """The port this process's publisher metrics use: ``publisher_metrics_port + LOCAL_RANK`` (0: off)."""
    base = settings.publisher_metrics_port
    return base + local_rank() if base > 0 else 0


class PublisherCollector:
    """Reads a :class:`Publisher`'s counters at scrape time (from the metrics server's thread)."""

    def __init__(self, publisher: Publisher) -> None:
        self.publisher = publisher

    def collect(self) -> Iterator[Metric]:
        s = self.publisher.stats()
        yield counter(_PREFIX + "records_accepted", "Records queued by publish().", float(s.accepted))
        yield counter(_PREFIX + "records_dropped", "Records dropped: the queue was full or the publisher closed.",
                      float(s.dropped))
        yield counter(_PREFIX + "encode_errors", "Records that could not be encoded (dropped).", float(s.encode_errors))
        yield counter(_PREFIX + "records_delivered", "Kafka messages delivered.", float(s.delivered))
        yield counter(_PREFIX + "delivery_errors", "Records not delivered (refused, timed out, not handed to Kafka).",
                      float(s.failed))
        yield counter(_PREFIX + "delivered_bytes", "Delivered value bytes (before Kafka compression), per topic.",
                      labels=("topic",), samples={(t,): float(n) for t, n in s.bytes_by_topic.items()})
        yield gauge(_PREFIX + "queue_depth", "Records waiting in the publisher's queue.", float(s.queued))
        yield gauge(_PREFIX + "queue_capacity", "Bound of the publisher's queue (publisher_queue_max).",
                    float(self.publisher.queue_capacity))
        yield gauge(_PREFIX + "kafka_queue_messages", "Messages handed to Kafka, not delivered yet.",
                    float(self.publisher.kafka_queued()))


def publisher_registry(publisher: Publisher) -> CollectorRegistry:
    """A registry of its own (not prometheus_client's global one) with a :class:`PublisherCollector`."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(PublisherCollector(publisher))
    return registry


def start_publisher_metrics(settings: Settings, publisher: Publisher) -> MetricsServer | None:
    """Serve ``publisher``'s metrics on ``metrics_host:`` :func:`metrics_port`; ``None`` when off or when the
    port cannot be bound (logged as a warning: training goes on)."""
    port = metrics_port(settings)
    if port > 65535:
        log.warning("publisher metrics not served: port %d (publisher_metrics_port + LOCAL_RANK) is beyond 65535",
                    port)
        return None
    return start_metrics_server(publisher_registry(publisher), settings.metrics_host, port, "publisher")
