"""What a diagnosis worker knows of each job beyond its running state: the context L3 judges with, the findings
published, the DIAGNOSED parts.

:class:`JobLedger` is kept by the :class:`~argus.streams.job_router.JobRouter` and read by the L3 agent (it is
its :class:`~argus.streams.summary_router.JobView`): the job's topology, collective groups, stragglers and
step clocks as this worker knows them, else as the job's holder shared them (``remote``); the ids of every
finding published per job (so a rebuilt or re-read job publishes each once) and the DIAGNOSED parts per job
(what a restart must not diagnose live again). Everything is kept for the ``max_jobs`` most recent jobs only
(bounded memory in a long-lived worker) and dropped once every part of a job is diagnosed (:meth:`drop`).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from argus.detectors.impact import StepClock
from argus.detectors.incidents import IncidentParams, form_incidents
from argus.detectors.links import LinkParams
from argus.detectors.victims import straggler_ranks
from argus.schemas.job_context import JobContext
from argus.schemas.records import Finding, JobLifecycle, JobTopology, LifecycleEvent, ParallelGroup
from argus.streams.diagnosis import JobDiagnosis, LinkLedger
from argus.streams.job_context import context_clock, context_groups, context_topology, job_context

__all__ = ["JobLedger", "Recent"]

_V = TypeVar("_V")


class Recent(OrderedDict[str, _V]):
    """A dict of the ``limit`` most recently written jobs."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def __setitem__(self, key: str, value: _V) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.limit:
            self.popitem(last=False)


class JobLedger:
    """Per-job context and publication record (see the module's docstring). Not thread-safe.

    ``version``: stamped on every finding published. ``remote``: what the job's holder shared of a job (its
    part ``job`` of the job context), for jobs another worker holds. ``max_jobs``: jobs kept. ``links``: the
    link rule's settings the diagnosis runs with (``L3Params.links``), which each job's link ledger judges by.
    """

    def __init__(self, version: str, remote: Callable[[str], JobContext | None] = lambda job_id: None,
                 max_jobs: int = 10_000, incidents: IncidentParams | None = None,
                 links: LinkParams | None = None) -> None:
        self.version, self.remote = version, remote
        self.incidents = incidents if incidents is not None else IncidentParams()
        self.link_params = links if links is not None else LinkParams()
        self.topologies: Recent[JobTopology] = Recent(max_jobs)
        self.groups: Recent[dict[int, ParallelGroup]] = Recent(max_jobs)
        #: Ranks L2 named stragglers per job: their blocking-group peers are victims for L3.
        self.stragglers: Recent[set[int]] = Recent(max_jobs)
        #: The job's steps as L1/L2 know them (impacts are judged against the step time); final once finished.
        self.clocks: Recent[StepClock] = Recent(max_jobs)
        self.final_clocks: Recent[StepClock] = Recent(max_jobs)
        #: Worker-clock time each job's END was read, until every part of it is DIAGNOSED (diagnosis latency).
        self.end_read: Recent[float] = Recent(max_jobs)
        self._links: Recent[LinkLedger] = Recent(max_jobs)
        self._published: Recent[set[str]] = Recent(max_jobs)
        #: The findings published per job, as published (with their hosts and incidents), by id.
        self._found: Recent[dict[str, Finding]] = Recent(max_jobs)
        self._parts_done: Recent[set[int]] = Recent(max_jobs)
        self._diagnosed: Recent[set[str]] = Recent(max_jobs)
        self._shared: Recent[tuple[Any, ...]] = Recent(max_jobs)  # what the job context last written here held

    # -- the L3 agent's view (JobView) -------------------------------------------------------------------------

    def is_diagnosed(self, job_id: str, part: str) -> bool:
        return part in self._diagnosed.get(job_id, set())

    def topology_of(self, job_id: str) -> JobTopology | None:
        """The job's topology: from its records here, else as its holder shared it."""
        return self.topologies.get(job_id) or context_topology(self.remote(job_id))

    def groups_of(self, job_id: str) -> dict[int, ParallelGroup]:
        return self.groups.get(job_id) or context_groups(self.remote(job_id))

    def stragglers_of(self, job_id: str) -> set[int]:
        ctx = self.remote(job_id)
        return self.stragglers.get(job_id, set()) | set(ctx.stragglers if ctx is not None else ())

    def clock_of(self, job_id: str) -> StepClock | None:
        return self.final_clocks.get(job_id) or self.clocks.get(job_id) or context_clock(self.remote(job_id))

    def steps_final(self, job_id: str) -> bool:
        """Whether the job's final steps are known (finished here, or so shared by its holder)."""
        ctx = self.remote(job_id)
        return job_id in self.final_clocks or (ctx is not None and ctx.final)

    # -- publication -----------------------------------------------------------------------------------------

    def publishable(self, findings: Iterable[Finding], final: bool = False) -> tuple[Finding, ...]:
        """``findings`` of one job (L1/L2, L3 or hangs) as published: filtered by the job's link ledger, those
        published before left out, stamped with the detector version, with their hosts and incidents
        (:func:`~argus.detectors.incidents.form_incidents` over every finding of the job published here); their
        stragglers noted for L3. A finding published before whose incident changed (a host incident formed
        since) is published again: the same ``finding_id``, so the sink keeps the newer row. ``final``: findings
        of the job's final judgement (its pipeline links wait for :meth:`release_links`)."""
        found = list(findings)
        if not found:
            return ()
        job_id = found[0].job_id
        return self._stamped(job_id, self._link_ledger(job_id).filter(found, final))

    def release_links(self, job_id: str) -> tuple[Finding, ...]:
        """The job's pipeline links its final judgement held, as published, once its rank aggregate is judged
        here or elsewhere (:meth:`~argus.detectors.link_ledger.LinkLedger.release`)."""
        return self._stamped(job_id, self._link_ledger(job_id).release())

    def _link_ledger(self, job_id: str) -> LinkLedger:
        if job_id not in self._links:
            self._links[job_id] = LinkLedger(self.link_params)
        return self._links[job_id]

    def _stamped(self, job_id: str, found: list[Finding]) -> tuple[Finding, ...]:
        self.stragglers[job_id] = self.stragglers.get(job_id, set()) | straggler_ranks(found)
        seen = self._published.get(job_id) or set()
        before = self._found.get(job_id) or {}
        fresh = {f.finding_id: dataclasses.replace(f, detector_version=self.version) for f in found
                 if f.finding_id not in seen}
        if not fresh:
            return ()
        grouped = form_incidents([*before.values(), *fresh.values()], self.topology_of(job_id), self.incidents)
        out = tuple(g for g in grouped if g.finding_id not in seen or before.get(g.finding_id) != g)
        self._published[job_id] = seen | {f.finding_id for f in out}
        self._found[job_id] = {g.finding_id: g for g in grouped}
        return out

    def diagnosed_record(self, job_id: str, part: str, time_ns: int, world_size: int) -> JobLifecycle:
        """The DIAGNOSED record of ``part``: it lists the ids of every finding of the job published so far."""
        ids = tuple(sorted(self._published.get(job_id) or set()))
        return JobLifecycle(job_id, LifecycleEvent.DIAGNOSED, time_ns, world_size, source="streams", part=part,
                            finding_ids=ids)

    def add_diagnosed(self, job_id: str, parts: Iterable[str]) -> None:
        """DIAGNOSED parts of the job: found on the lifecycle topic, read live, or written here."""
        self._diagnosed[job_id] = self._diagnosed.get(job_id, set()) | set(parts)

    def part_done(self, job_id: str, partition: int) -> None:
        """The job's L3 part had its final judgement here."""
        self._parts_done[job_id] = self._parts_done.get(job_id, set()) | {partition}

    def context(self, job_id: str, job: JobDiagnosis | None, final: bool = False) -> JobContext | None:
        """What this worker (the job's holder) knows of the job, for the L3 parts on other workers; ``None``
        when that has not changed since the last one (taken as written)."""
        topo = self.topologies.get(job_id) or (job.topology if job is not None else None)
        groups, straggling = self.groups.get(job_id, {}), self.stragglers.get(job_id, set())
        clock = self.final_clocks.get(job_id) or self.clocks.get(job_id)
        # Cheap to compare on every record; the record itself (a 10k-rank topology) only when it changed.
        sig = (topo is not None, tuple(sorted(groups.items(), key=lambda kv: kv[0])), frozenset(straggling),
               (len(clock.starts_ns), clock.median_step_ns) if clock is not None else None, final)
        if self._shared.get(job_id) == sig:
            return None
        self._shared[job_id] = sig
        return job_context(job_id, job.last_time_ns if job is not None else 0, topo, groups, straggling, clock,
                           final)

    # -- bookkeeping -------------------------------------------------------------------------------------------

    def drop(self, job_id: str) -> bool:
        """Every part of the job is diagnosed: its context goes (not its DIAGNOSED parts, which tell later
        copies apart). Whether this worker had written the job's context (then it leaves tombstones)."""
        for d in (self.topologies, self.groups, self.stragglers, self.clocks, self.final_clocks, self._links,
                  self._published, self._found, self._parts_done):
            d.pop(job_id, None)
        return self._shared.pop(job_id, None) is not None

    def revoked(self) -> None:
        """Partitions were revoked: the running jobs' groups, stragglers, links and shared context go; the
        topologies, clocks, published ids and DIAGNOSED parts stay (re-delivered records find them again)."""
        for d in (self.groups, self.stragglers, self._parts_done, self._links, self._shared):
            d.clear()

    def jobs(self) -> set[str]:
        """The jobs with context here."""
        return {*self.topologies, *self.groups, *self.stragglers, *self.clocks, *self.final_clocks, *self._links,
                *self._published, *self._found, *self._parts_done}
