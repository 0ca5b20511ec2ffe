"""The stream pipeline in one process, without Kafka: records in, findings out.

:func:`diagnose_records` runs a job's records through what the Faust agents run -- event-time windows
(:class:`~argus.streams.windows.WindowBuffer`), compression (:func:`~argus.streams.compression.summarize_windows`), the
per-job L1/L2 state, the per-(kernel, stream) L3 state and the per-rank L3 state (:mod:`argus.streams.diagnosis`)
-- in record order, with live judgements as records arrive and the final ones at the job's end. It is how
the detectors are evaluated on many scenarios quickly (``load_tests/detection_eval.py --mode inproc``) and
what a test compares the live stack with. :func:`diagnose_traces` does it for a directory of
torch.profiler/Kineto traces, like ``argus import-kineto`` followed by ``argus findings --json``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from argus.core.settings import Settings
from argus.detectors.findings import finding_json
from argus.detectors.incidents import by_incident, form_incidents
from argus.detectors.victims import drop_victims, straggler_ranks
from argus.schemas.records import (
    Finding,
    JobLifecycle,
    JobTopology,
    KernelBatch,
    KernelSummary,
    LifecycleEvent,
    PhaseBatch,
    Record,
    Step,
)
from argus.streams.compression import summarize_windows
from argus.streams.diagnosis import (
    DiagnosisParams,
    JobDiagnosis,
    KernelDiagnosis,
    LinkLedger,
    RankDiagnosis,
    detector_version,
)
from argus.streams.windows import ClosedWindow, WindowBuffer
from argus.topics import Topic

__all__ = ["diagnose_records", "diagnose_traces", "finding_json", "ordered_json"]


class _Job:
    def __init__(self, job_id: str, params: DiagnosisParams) -> None:
        self.state = JobDiagnosis(job_id, params)
        self.kernels: dict[tuple[str, int], KernelDiagnosis] = {}
        self.ranks = RankDiagnosis(job_id, params)
        self.links = LinkLedger(params.l3.links)  # the link rule's own settings: one LinkParams serves both
        self.params = params
        self.stragglers: set[int] = set()
        self.findings: list[Finding] = []

    def keep(self, findings: list[Finding], final: bool = False) -> None:
        findings = self.links.filter(findings, final)
        self.stragglers |= straggler_ranks(findings)
        self.findings += findings

    def summaries(self, out: list[KernelSummary]) -> None:
        topo, clock = self.state.topology, self.state.clock()
        for s in out:
            key = (s.kernel, s.stream)
            if key not in self.kernels:
                self.kernels[key] = KernelDiagnosis(s.job_id, s.kernel, s.stream, self.params)
            self.kernels[key].add(s)
            self.ranks.add(s)
            found = self.kernels[key].diagnose(topo, group_kind=self.state.collective_groups.get(s.stream),
                                               clock=clock)
            self.keep(drop_victims(found, self.stragglers))

    def finish(self) -> list[Finding]:
        self.keep(self.state.diagnose(final=True), final=True)
        topo, clock = self.state.topology, self.state.clock()
        for state in self.kernels.values():
            found = state.diagnose(topo, final=True, group_kind=self.state.collective_groups.get(state.stream),
                                   clock=clock)
            self.keep(drop_victims(found, self.stragglers), final=True)
        self.keep(self.ranks.diagnose(topo, clock), final=True)
        # The final pipeline pairs, now that the rank aggregate may have named the straggler they wait for (the
        # live path releases them after it too: FinalRouter).
        self.findings += self.links.release()
        return form_incidents(_dedup(self.findings), topo, self.params.incidents)


def diagnose_records(records: Iterable[Record], settings: Settings | None = None,
                     params: DiagnosisParams | None = None) -> dict[str, list[Finding]]:
    """Every job's findings from its records (any mix of jobs; in the order a topic would hold them).

    A job is finished by its END record, or, without one, when the records run out. ``settings`` gives the
    window, lateness and compression parameters and the impact threshold (defaults: ``Settings()``). Findings
    carry their :func:`~argus.streams.diagnosis.detector_version`, as the stream agents stamp them.
    """
    cfg = settings if settings is not None else Settings()
    p = params if params is not None else DiagnosisParams(min_impact_fraction=cfg.min_impact_fraction)
    buffer = WindowBuffer(window_ns=cfg.window_ns, lateness_ns=cfg.allowed_lateness_ns,
                          max_skew_ns=cfg.max_event_skew_ns, max_names=cfg.max_kernel_names)
    jobs: dict[str, _Job] = {}
    done: dict[str, list[Finding]] = {}

    def job(job_id: str) -> _Job:
        if job_id not in jobs:
            jobs[job_id] = _Job(job_id, p)
        return jobs[job_id]

    def emit(job_id: str, closed: list[ClosedWindow]) -> None:
        for w in closed:
            buffer.release(w)
        if closed:
            job(job_id).summaries(summarize_windows(closed))

    for token, rec in enumerate(records):
        if isinstance(rec, KernelBatch):
            if rec.is_job_end:
                continue
            emit(rec.job_id, buffer.add(rec, token).closed)
        elif isinstance(rec, Step | PhaseBatch | JobTopology | JobLifecycle):
            if isinstance(rec, JobLifecycle) and rec.event is LifecycleEvent.DIAGNOSED:
                continue
            j = job(rec.job_id)
            j.state.add(rec)
            if isinstance(rec, JobLifecycle) and rec.event is LifecycleEvent.END:
                emit(rec.job_id, buffer.flush_job(rec.job_id))
                done[rec.job_id] = j.finish()
                del jobs[rec.job_id]
            elif j.state.due():
                j.keep(j.state.diagnose())
    for job_id in list(jobs):
        emit(job_id, buffer.flush_job(job_id))
        done[job_id] = jobs.pop(job_id).finish()
    version = detector_version(p, cfg)
    return {job_id: [dataclasses.replace(f, detector_version=version) for f in found] for job_id, found in done.items()}


def diagnose_traces(directory: Path, job_id: str, topology: str | None = None,
                    settings: Settings | None = None) -> list[dict[str, Any]]:
    """``argus import-kineto DIR --job J`` then ``argus findings --job J --json``, in one process: the
    findings of the Kineto traces under ``directory`` as JSON objects, by incident (:func:`ordered_json`). Raises
    :class:`~argus.core.errors.ProducerError` like the importer."""
    from argus.producers.kineto import import_kineto

    cfg = settings if settings is not None else Settings()
    sink = _Collect()
    import_kineto(cfg, Path(directory), job_id, topology=topology, publisher=sink)
    findings = diagnose_records(sink.records, cfg).get(job_id, [])
    return ordered_json(findings)


def ordered_json(findings: Iterable[Finding]) -> list[dict[str, Any]]:
    """``findings`` as ``argus findings --json`` gives them: incidents by impact (largest first), each its lead
    then its members (:func:`~argus.detectors.incidents.by_incident`)."""
    out = [finding_json(f) for f in findings]
    out.sort(key=lambda f: (-f["impact_ns"], f["level"], f["kind"], f["steps"], f["ranks"]))
    groups = by_incident(out, lambda f: f["finding_id"], lambda f: f["incident_id"], lambda f: f["impact_ns"])
    return [f for g in groups for f in g]


class _Collect:
    """A publisher that keeps what it is given, in order."""

    def __init__(self) -> None:
        self.records: list[Record] = []

    def publish(self, topic: Topic, key: bytes, record: Any) -> bool:
        self.records.append(record)
        return True

    def flush(self, timeout_s: float = 30.0) -> int:
        return 0


def _dedup(findings: list[Finding]) -> list[Finding]:
    """The last finding of each id (what ``FINAL`` keeps in the findings table)."""
    by_id = {f.finding_id: f for f in findings}
    return list(by_id.values())
