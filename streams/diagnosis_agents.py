"""Faust agents of the progressive diagnosis: L1/L2 per job, L3 per (job, kernel, stream).

* ``argus.diagnose-jobs`` reads steps, phases, topology and lifecycle records, all keyed by job (so one
  job's records meet on one worker), feeds :class:`streams.diagnosis.JobDiagnosis`, publishes findings
  as they appear (live, every few complete steps) and, once the END's record counts have all arrived, the
  final ones followed by a ``DIAGNOSED`` lifecycle record with part ``l1l2``.
* ``argus.diagnose-kernels`` reads kernel summaries keyed by (job, kernel, stream), feeds
  :class:`streams.diagnosis.KernelDiagnosis` and judges each window once the next one begins. Every
  compressor partition ends a job with a marker on every summaries partition; when one partition has the
  markers of all kernel partitions, all of the job's summaries there have arrived: final L3 (once the job's
  steps are all in, so impacts are judged against the final step time; at most ``final_wait_s``), then
  ``DIAGNOSED`` with part ``l3/<partition>``. The summaries also feed the job's
  :class:`streams.diagnosis.RankDiagnosis`, judged before the DIAGNOSED of the last partition this worker
  finishes the job on, when this worker has held all partitions of the job.

``argus findings --wait`` waits for all those DIAGNOSED parts. Messages are acked once their job is
finished here (or, for very long jobs, once ``max_pending`` messages of the job are held), so a restarted
worker rebuilds live state from the log. Findings have deterministic ids, so re-runs never double them.
The topology used by L3 is the one this worker has read (the topology topic is keyed by job); with several
workers a job's topology may be read by another worker, and L3 then compares ranks job-wide.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, defaultdict
from dataclasses import dataclass
from typing import Any, TypeVar

import faust
from faust.types import EventT

from argus.errors import SchemaError
from argus.settings import Settings
from argus.topics import RECORD_OF, Topic, job_key
from detectors.impact import StepClock
from schemas.records import Finding, JobLifecycle, JobTopology, KernelSummary, LifecycleEvent, ParallelGroup
from streams.diagnosis import (
    DiagnosisParams,
    JobDiagnosis,
    KernelDiagnosis,
    LinkLedger,
    RankDiagnosis,
    drop_victims,
    straggler_ranks,
)

__all__ = ["DiagnosisStats", "install_diagnosis", "summary_end_marker"]

log = logging.getLogger(__name__)
_V = TypeVar("_V")


@dataclass
class DiagnosisStats:
    records: int = 0
    findings: int = 0
    jobs_diagnosed: int = 0
    l3_parts_diagnosed: int = 0
    undecodable: int = 0
    #: Wall-clock time of the last finding published, ns since the epoch (for latency measurements).
    last_finding_ns: int = 0


def summary_end_marker(job_id: str, source_partition: int) -> KernelSummary:
    """What a compressor partition sends to every summaries partition when it has finished a job."""
    return KernelSummary(job_id=job_id, kernel="", stream=source_partition, rank=(), window_start_ns=(),
                         window_end_ns=(), n_events=(), n_clusters=(), cluster_count=(), cluster_p50_ns=(),
                         cluster_p99_ns=(), cluster_min_ns=(), cluster_max_ns=(), cluster_sum_ns=())


def _is_end_marker(s: KernelSummary) -> bool:
    return s.kernel == "" and not s.rank


class _Recent(OrderedDict[str, _V]):
    """A dict of the ``limit`` most recently written jobs."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def __setitem__(self, key: str, value: _V) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.limit:
            self.popitem(last=False)


def install_diagnosis(app: faust.App, settings: Settings, params: DiagnosisParams | None = None,
                      max_pending: int = 200_000, max_jobs: int = 10_000, final_wait_s: float = 30.0
                      ) -> DiagnosisStats:
    """Add the diagnosis agents to ``app``; returns their live counters."""
    params = params or DiagnosisParams(min_impact_fraction=settings.min_impact_fraction)
    stats = DiagnosisStats()
    names = {t.full(settings): t for t in (Topic.STEPS, Topic.PHASES, Topic.TOPOLOGY, Topic.LIFECYCLE)}
    job_input = app.topic(*names, key_type=bytes, value_type=bytes)
    summaries = app.topic(Topic.SUMMARIES.full(settings), key_type=bytes, value_type=bytes)
    findings_topic = app.topic(Topic.FINDINGS.full(settings), key_type=bytes, value_type=bytes)
    lifecycle = app.topic(Topic.LIFECYCLE.full(settings), key_type=bytes, value_type=bytes)
    jobs: dict[str, JobDiagnosis] = {}
    job_events: defaultdict[str, list[EventT]] = defaultdict(list)
    # Per-job context shared with L3, kept for the most recent jobs only (bounded memory in a long-lived worker).
    topologies: _Recent[JobTopology] = _Recent(max_jobs)
    stream_groups: _Recent[dict[int, ParallelGroup]] = _Recent(max_jobs)
    # Ranks L2 named compute stragglers, per job: their blocking-group peers are victims for L3.
    stragglers: _Recent[set[int]] = _Recent(max_jobs)
    # The job's steps as L1/L2 know them (impacts are judged against the step time); final once finished.
    clocks: _Recent[StepClock] = _Recent(max_jobs)
    final_clocks: _Recent[StepClock] = _Recent(max_jobs)
    ranks_state: _Recent[RankDiagnosis] = _Recent(max_jobs)
    parts_done: _Recent[set[int]] = _Recent(max_jobs)
    links: _Recent[LinkLedger] = _Recent(max_jobs)

    async def publish(findings: list[Finding]) -> None:
        if findings:  # one job's findings per call
            job_id = findings[0].job_id
            if job_id not in links:
                links[job_id] = LinkLedger()
            findings = links[job_id].filter(findings)
            stragglers[job_id] = stragglers.get(job_id, set()) | straggler_ranks(findings)
        futs = [await findings_topic.send(key=job_key(f.job_id), value=f.encode(), force=True) for f in findings]
        for fut in futs:
            await fut
        if findings:
            stats.findings += len(findings)
            stats.last_finding_ns = time.time_ns()
            for f in findings:
                log.info("finding %s %s job=%s ranks=%s phase=%s kernel=%s steps=%s score=%.2f", f.level.value,
                         f.kind, f.job_id, list(f.ranks), f.phase, f.kernel, list(f.steps), f.score)

    async def diagnosed(job_id: str, part: str, time_ns: int, world_size: int) -> None:
        rec = JobLifecycle(job_id, LifecycleEvent.DIAGNOSED, time_ns, world_size, source="streams", part=part)
        fut = await lifecycle.send(key=job_key(job_id), value=rec.encode(), force=True)
        await fut

    def hold(job_id: str, event: EventT) -> None:
        held = job_events[job_id]
        held.append(event)
        if len(held) > max_pending:  # bounded memory for endless jobs: older state is already in findings
            for e in held[: len(held) // 2]:
                e.ack()
            del held[: len(held) // 2]

    def release(job_id: str) -> None:
        for e in job_events.pop(job_id, []):
            e.ack()

    @app.agent(job_input, name="argus.diagnose-jobs")
    async def diagnose_jobs(stream: Any) -> Any:
        async for event in stream.noack().events():
            topic = names[event.message.topic]
            try:
                rec: Any = RECORD_OF[topic].decode(event.value)
            except SchemaError:
                stats.undecodable += 1  # the sink dead-letters it with the reason
                event.ack()
                continue
            stats.records += 1
            if isinstance(rec, JobTopology):
                topologies[rec.job_id] = rec
            if isinstance(rec, JobLifecycle) and rec.event is LifecycleEvent.DIAGNOSED:
                event.ack()
                continue
            job = jobs.get(rec.job_id)
            if job is None:
                job = jobs[rec.job_id] = JobDiagnosis(rec.job_id, params)
                stream_groups[rec.job_id] = job.collective_groups
            job.add(rec)
            hold(rec.job_id, event)
            if job.finished():
                await publish(job.diagnose())
                clocks[rec.job_id] = final_clocks[rec.job_id] = job.clock()
                end = job.end
                await diagnosed(rec.job_id, "l1l2", end.time_ns if end else job.last_time_ns, job.world_size or 0)
                stats.jobs_diagnosed += 1
                del jobs[rec.job_id]
                release(rec.job_id)
            elif job.due():
                await publish(job.diagnose())
                clocks[rec.job_id] = job.clock()
            yield None

    # L3 state per (job, summaries partition): a job's keys spread over partitions, each finishes alone.
    kernels: defaultdict[tuple[str, int], dict[tuple[str, int], KernelDiagnosis]] = defaultdict(dict)
    markers: defaultdict[tuple[str, int], set[int]] = defaultdict(set)
    summary_events: defaultdict[tuple[str, int], list[EventT]] = defaultdict(list)
    last_window: dict[tuple[str, int], int] = {}

    @app.agent(summaries, name="argus.diagnose-kernels")
    async def diagnose_kernels(stream: Any) -> Any:
        async for event in stream.noack().events():
            try:
                s = KernelSummary.decode(event.value)
            except SchemaError:
                stats.undecodable += 1
                event.ack()
                continue
            part = (s.job_id, event.message.partition)
            summary_events[part].append(event)
            topo = topologies.get(s.job_id)
            if _is_end_marker(s):
                markers[part].add(s.stream)
                if len(markers[part]) >= settings.partitions:
                    deadline = time.monotonic() + final_wait_s
                    while s.job_id not in final_clocks and time.monotonic() < deadline:
                        await asyncio.sleep(0.1)  # the job agent finishes the job's steps concurrently
                    clock = final_clocks.get(s.job_id) or clocks.get(s.job_id)
                    topo = topologies.get(s.job_id)
                    groups = stream_groups.get(s.job_id, {})
                    for state in kernels.pop(part, {}).values():
                        found = state.diagnose(topo, final=True, group_kind=groups.get(state.stream), clock=clock)
                        await publish(drop_victims(found, stragglers.get(s.job_id, set())))
                    done = parts_done[s.job_id] = parts_done.get(s.job_id, set()) | {part[1]}
                    rank_state = ranks_state.get(s.job_id)
                    if len(done) >= settings.partitions and rank_state is not None:
                        await publish(rank_state.diagnose(topo, clock))
                        del ranks_state[s.job_id]
                    await diagnosed(s.job_id, f"l3/{part[1]}", last_window.pop(part, 0),
                                    topo.world_size if topo else 0)
                    stats.l3_parts_diagnosed += 1
                    del markers[part]
                    for e in summary_events.pop(part, []):
                        e.ack()
                yield None
                continue
            key = (s.kernel, s.stream)
            if key not in kernels[part]:
                kernels[part][key] = KernelDiagnosis(s.job_id, s.kernel, s.stream, params)
            state = kernels[part][key]
            state.add(s)
            if s.job_id not in ranks_state:
                ranks_state[s.job_id] = RankDiagnosis(s.job_id, params)
            ranks_state[s.job_id].add(s)
            last_window[part] = max(last_window.get(part, 0), *s.window_end_ns)
            found = state.diagnose(topo, group_kind=stream_groups.get(s.job_id, {}).get(s.stream),
                                   clock=clocks.get(s.job_id))
            await publish(drop_victims(found, stragglers.get(s.job_id, set())))
            yield None

    @app.on_partitions_revoked.connect  # type: ignore[arg-type]
    async def on_revoked(sender: Any, *args: Any, **kwargs: Any) -> None:
        # Un-acked messages come back from the committed offsets after the rebalance.
        for d in (jobs, job_events, kernels, markers, summary_events, last_window, stream_groups, stragglers,
                  ranks_state, parts_done, links):
            d.clear()

    return stats
