"""The diagnosis agents' live counters (served by the worker's ``/stats`` and ``/metrics``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from argus.metrics import DELAY_BUCKETS_S, IMPACT_BUCKETS_S, Histogram

__all__ = ["DiagnosisStats"]


@dataclass
class DiagnosisStats:
    records: int = 0
    findings: int = 0
    jobs_diagnosed: int = 0
    l3_parts_diagnosed: int = 0
    undecodable: int = 0
    #: Records dead-lettered by these agents (rejected or failed), and job / L3 states repaired or discarded.
    dead_letters: int = 0
    states_repaired: int = 0
    states_discarded: int = 0
    #: Summary rows ignored because their window was already dropped from the bounded L3 state.
    l3_rows_ignored: int = 0
    #: Copies ignored: Step/PhaseBatch records already taken, summary rows of pieces already taken.
    duplicates: int = 0
    #: Records of jobs (or L3 parts) already diagnosed, re-read after a restart and not diagnosed live again.
    replayed: int = 0
    #: Wall-clock time of the last finding published, ns since the epoch (for latency measurements).
    last_finding_ns: int = 0
    #: Jobs this worker abandoned (idle past ``job_idle_timeout_s`` or beyond ``max_open_jobs``: ABANDONED
    #: written), and jobs closed on an ABANDONED record read back (final diagnosis, state dropped, acked).
    jobs_abandoned: int = 0
    jobs_closed_abandoned: int = 0
    #: Jobs open in the L1/L2 agent, and messages held un-acked for them.
    open_jobs: int = 0
    held_messages: int = 0
    #: Heartbeats taken (acked at once: liveness only), and hang findings (stalled, silent, wavefront, resumed).
    heartbeats: int = 0
    hang_findings: int = 0
    #: Final L3 parts that waited for their job's final steps, and those judged without them (gave up).
    finals_deferred: int = 0
    finals_without_steps: int = 0
    #: The jobs holding state here, longest open first (at most ``_LISTED_JOBS``): job, state (``open``,
    #: ``abandoning``: ABANDONED written, not read back yet; ``awaiting L3``: finished, records held until its
    #: L3 parts are diagnosed), age_s (since its first record here), idle_s, last_step, held_messages.
    jobs: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    #: Jobs with diagnosis context here (topology, steps, stragglers, ...): running or not fully diagnosed.
    context_jobs: int = 0
    #: Job-context parts whose newest write is not all read yet (its pieces still coming: the part's readers
    #: go on with its previous write, or wait), and writes dropped before they were complete (superseded by a
    #: newer write, or pieces that did not join).
    context_parts_incomplete: int = 0
    context_generations_dropped: int = 0
    #: Open jobs whose hang episode is open (``job_stalled`` raised, no step completed since).
    stalled_jobs: int = 0
    #: Findings published, per level and kind: ``{level: {kind: count}}`` (for ``/metrics``).
    findings_by_kind: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    #: Seconds from a job's END record read here to its DIAGNOSED ``l1l2`` written (``l1l2``), and to every
    #: part of the job DIAGNOSED (``job``: when ``argus findings --wait`` returns).
    diagnosis_latency_s: dict[str, Histogram] = dataclasses.field(
        default_factory=lambda: {"l1l2": Histogram(), "job": Histogram()})
    #: Seconds from each finding's event time (``time_ns``, the ranks' clocks) to its publication here.
    finding_delay_s: Histogram = dataclasses.field(default_factory=lambda: Histogram(DELAY_BUCKETS_S))
    #: Each published finding's impact, GPU-seconds lost per affected step (``impact_ns_per_step / 1e9``), per kind.
    finding_impact_s: dict[str, Histogram] = dataclasses.field(default_factory=dict)

    def observe_impact(self, kind: str, impact_ns_per_step: float) -> None:
        """Count one published finding of ``kind`` with its impact (ns of GPU time lost per step)."""
        hist = self.finding_impact_s.get(kind)
        if hist is None:
            hist = self.finding_impact_s[kind] = Histogram(IMPACT_BUCKETS_S)
        hist.observe(max(0.0, impact_ns_per_step) / 1e9)
