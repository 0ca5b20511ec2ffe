"""Prometheus metrics of the stream worker, served at ``/metrics`` on its Faust web server.

:class:`WorkerCollector` reads the agents' own counters (:class:`~argus.streams.app.CompressionStats`,
:class:`~argus.streams.diagnosis_agents.DiagnosisStats`) and the Faust consumer's offsets when Prometheus scrapes:
the hot path pays nothing for them. The page is on ``metrics_host:worker_web_port`` (default
``127.0.0.1:16066``) next to ``/health`` and ``/stats`` (the same counters as JSON).

Exported (all ``argus_worker_``; counters are per worker process, since its start): see docs/internals/streams.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric

from argus.core.kinds import FindingKind
from argus.metrics import IMPACT_BUCKETS_S, Histogram, counter, gauge, histogram
from argus.streams.diagnosis_stats import DiagnosisStats

__all__ = ["WorkerCollector", "consumer_lag", "worker_registry"]

log = logging.getLogger(__name__)

#: CompressionStats field -> (metric name without ``argus_worker_``, help).
_COMPRESSION_COUNTERS = {
    "batches": ("kernel_batches", "Kernel batches (Kafka messages) taken by the compressor."),
    "events_in": ("kernel_events", "Kernel events taken by the compressor (events in)."),
    "events_summarized": ("kernel_events_summarized", "Kernel events whose windows' summaries were delivered."),
    "late_events": ("late_events", "Events summarized as further pieces of windows already summarized."),
    "skewed_events": ("skewed_events", "Events beyond max_event_skew_ns of their rank's watermark (dead-lettered)."),
    "folded_events": ("folded_events", "Events summarized under '[other kernels]' (max_kernel_names reached)."),
    "duplicate_batches": ("duplicate_batches", "Kernel batches that were copies of batches already taken."),
    "windows_closed": ("windows_closed", "Event-time windows closed and summarized."),
    "summaries_out": ("summaries", "Kernel summaries sent (summaries out)."),
    "summary_bytes_out": ("summary_bytes", "Bytes of kernel summaries sent (Avro, before Kafka compression)."),
    "failed_messages": ("failed_messages", "Kernel messages dead-lettered whole because their processing raised."),
    "failed_windows": ("failed_windows", "Windows that could not be summarized (dead-lettered)."),
    "busy_s": ("compress_busy_seconds", "Seconds the compression agent spent on messages."),
}
#: DiagnosisStats field -> (metric name without ``argus_worker_``, help).
_DIAGNOSIS_COUNTERS = {
    "records": ("diagnosis_records", "Job records (steps, phases, topology, lifecycle, heartbeats) decoded."),
    "heartbeats": ("heartbeats", "Heartbeats taken (liveness)."),
    "undecodable": ("undecodable_records", "Records the diagnosis agents could not decode (the sink dead-letters)."),
    "duplicates": ("duplicate_records", "Copies ignored: records or summary pieces already taken."),
    "replayed": ("replayed_records", "Records of jobs already diagnosed, re-read and not diagnosed again."),
    "jobs_diagnosed": ("jobs_diagnosed", "Jobs whose L1/L2 diagnosis finished here (DIAGNOSED l1l2 written)."),
    "l3_parts_diagnosed": ("l3_parts_diagnosed", "L3 parts (job, summaries partition) diagnosed here."),
    "jobs_closed_abandoned": ("jobs_closed_abandoned", "Jobs closed here on an ABANDONED record read back."),
    "states_repaired": ("states_repaired", "Job or L3 states rebuilt after a record made them fail."),
    "states_discarded": ("states_discarded", "Job or L3 states given up after a failed repair."),
    "l3_rows_ignored": ("l3_rows_ignored", "Summary rows ignored: their window had left the bounded L3 state."),
    "finals_deferred": ("finals_deferred", "Final L3 parts that waited for their job's final steps."),
    "finals_without_steps": ("finals_without_steps", "Final L3 parts judged without their job's final steps."),
    "context_generations_dropped": ("context_generations_dropped", "Job-context writes dropped before all their "
                                    "pieces were read (superseded, or pieces that did not join)."),
}
_DIAGNOSIS_GAUGES = {
    "open_jobs": ("open_jobs", "Jobs open in the L1/L2 agent (refreshed on the idle-jobs timer)."),
    "held_messages": ("held_messages", "Job and summary messages held un-acked (refreshed on the idle-jobs timer)."),
    "context_jobs": ("context_jobs", "Jobs with diagnosis context kept here (refreshed on the idle-jobs timer)."),
    "stalled_jobs": ("stalled_jobs", "Open jobs stalled: job_stalled raised and no step completed since (refreshed "
                     "on the idle-jobs timer)."),
    "context_parts_incomplete": ("context_parts_incomplete", "Job-context parts whose newest write is not all "
                                 "read yet (their readers use the previous write, or wait)."),
}
_PREFIX = "argus_worker_"


def consumer_lag(consumer: Any, topics: Collection[str] | None = None) -> dict[tuple[str, str], float]:
    """``{(topic, partition): high-water offset - committed offset}`` of the Faust ``consumer``'s assigned
    partitions that were fetched at least once (see the module doc), of ``topics`` only when given (Faust's
    own leader topic left out). Reads cached offsets only: no broker round trip. Never raises (a consumer in
    a rebalance gives what it can)."""
    out: dict[tuple[str, str], float] = {}
    try:
        assigned = sorted(consumer.assignment(), key=lambda tp: (tp.topic, tp.partition))
    except Exception as exc:  # not started yet, or closing
        log.debug("no consumer assignment for the lag metric: %s", exc)
        return out
    committed_of = getattr(consumer, "_committed_offset", None) or {}  # faust's committed offsets (next to read)
    for tp in assigned:
        if topics is not None and tp.topic not in topics:
            continue
        try:
            high = consumer.highwater(tp)
        except Exception:  # revoked between assignment() and here
            continue
        if high is None or high < 0:
            continue  # not fetched yet
        committed = committed_of.get(tp)
        out[(tp.topic, str(tp.partition))] = float(max(0, high - (committed or 0)))
    return out


class WorkerCollector:
    """Reads the worker's counters at scrape time (register it in a registry of its own).

    Args:
        compression: the compressor's :class:`~argus.streams.app.CompressionStats` (any object with its fields).
        diagnosis: the diagnosis agents' :class:`DiagnosisStats`.
        open_windows, pending_messages: callables giving the compressor's open windows and held messages.
        consumer: a callable giving the Faust consumer (``lambda: app.consumer``), or ``None`` for no lag.
        topics: the topics whose lag is exported (default: every assigned one).
    """

    def __init__(self, compression: Any, diagnosis: DiagnosisStats, open_windows: Callable[[], int] = lambda: 0,
                 pending_messages: Callable[[], int] = lambda: 0, consumer: Callable[[], Any] | None = None,
                 topics: Collection[str] | None = None) -> None:
        self.compression, self.diagnosis = compression, diagnosis
        self._open_windows, self._pending, self._consumer = open_windows, pending_messages, consumer
        self._topics = frozenset(topics) if topics is not None else None

    def collect(self) -> Iterator[Metric]:
        c, d = self.compression, self.diagnosis
        for attr, (name, doc) in _COMPRESSION_COUNTERS.items():
            yield counter(_PREFIX + name, doc, float(getattr(c, attr)))
        yield gauge(_PREFIX + "open_windows", "Event-time windows open in the compressor.", float(self._open_windows()))
        yield gauge(_PREFIX + "pending_messages", "Kernel messages held until their summaries are delivered.",
                    float(self._pending()))
        yield counter(_PREFIX + "dead_letters", "Records dead-lettered by the worker, by stage.",
                      labels=("stage",), samples={("compress",): float(c.dead_letters),
                                                  ("diagnose",): float(d.dead_letters)})
        yield counter(_PREFIX + "jobs_abandoned", "ABANDONED records written by this worker, by who wrote them.",
                      labels=("by",), samples={("compressor",): float(c.jobs_abandoned),
                                               ("diagnosis",): float(d.jobs_abandoned)})
        for attr, (name, doc) in _DIAGNOSIS_COUNTERS.items():
            yield counter(_PREFIX + name, doc, float(getattr(d, attr)))
        for attr, (name, doc) in _DIAGNOSIS_GAUGES.items():
            yield gauge(_PREFIX + name, doc, float(getattr(d, attr)))
        by_kind = {(level, kind): float(n) for level, kinds in list(d.findings_by_kind.items())
                   for kind, n in list(kinds.items())}
        yield counter(_PREFIX + "findings", "Findings published, by level (L1, L2, L3) and kind.",
                      labels=("level", "kind"), samples=by_kind)
        yield gauge(_PREFIX + "last_finding_timestamp_seconds", "Wall-clock time of the last finding published "
                    "(0: none yet).", d.last_finding_ns / 1e9)
        yield histogram(_PREFIX + "diagnosis_latency_seconds", "Seconds from a job's END read here to its DIAGNOSED "
                        "l1l2 written (scope l1l2) and to every part DIAGNOSED (scope job).",
                        {(scope,): h for scope, h in d.diagnosis_latency_s.items()}, labels=("scope",))
        # Every kind from the start (zero counts): an alert's increase() sees a kind's first finding too.
        impact = {(kind.level.value, kind.value): d.finding_impact_s.get(kind.value) or Histogram(IMPACT_BUCKETS_S)
                  for kind in FindingKind}
        yield histogram(_PREFIX + "finding_impact_seconds_per_step", "Findings published, by the GPU-seconds their "
                        "job loses per affected step (impact_ns_per_step / 1e9), per level and kind.", impact,
                        labels=("level", "kind"))
        yield histogram(_PREFIX + "finding_delay_seconds", "Seconds from a finding's event time (ranks' clocks) to "
                        "its publication (worker clock).", {(): d.finding_delay_s})
        if self._consumer is not None:
            lag: dict[tuple[str, str], float] = {}
            assigned = 0
            try:
                consumer = self._consumer()
                lag = consumer_lag(consumer, self._topics)
                assigned = len(consumer.assignment())
            except Exception as exc:  # a scrape never fails on the consumer
                log.debug("consumer offsets unavailable: %s", exc)
            yield gauge(_PREFIX + "consumer_lag_messages", "High-water offset minus committed offset per assigned "
                        "partition (unread, in process, or held for open jobs).", labels=("topic", "partition"),
                        samples=lag)
            yield gauge(_PREFIX + "assigned_partitions", "Partitions assigned to this worker.", float(assigned))


def worker_registry(collector: WorkerCollector) -> CollectorRegistry:
    """A registry of its own (not prometheus_client's global one) holding ``collector``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry
