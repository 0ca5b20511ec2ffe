"""The job agent's logic, without Kafka: decoded job records in; what to publish, share, mark, dead-letter and ack out.

:class:`JobRouter` keeps the state of the L1/L2 agent (``argus.diagnose-jobs``): each running job's
:class:`~argus.streams.diagnosis.JobDiagnosis` and the messages held un-acked for it, the (kind, rank, step) pairs
taken, the jobs finished here, the DIAGNOSED parts known, the jobs' last activity and liveness, and the context
the L3 agent judges with (topology, collective groups, stragglers, step clocks, the ids of the findings
published). It answers every record, and every timer tick, with a :class:`JobStep`: an ordered tuple of
effects that the Faust agent in :mod:`argus.streams.diagnosis_agents` carries out in that order (see
:data:`Effect`). The rules, unit-tested without a broker: see docs/internals/streams.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

from argus.core.errors import RejectedRecordError, failure_reason
from argus.core.settings import WorkerSettings
from argus.detectors.findings import to_finding
from argus.detectors.hangs import HangParams, HangResult
from argus.detectors.impact import Impact
from argus.schemas.job_context import JobContext
from argus.schemas.records import Finding, Heartbeat, JobLifecycle, JobTopology, LifecycleEvent, PhaseBatch, Step
from argus.streams.diagnosis import DiagnosisParams, JobDiagnosis
from argus.streams.diagnosis_stats import DiagnosisStats
from argus.streams.idle import IdleJobs, QuietClock, abandon_reason
from argus.streams.job_effects import (
    Abandon,
    Ack,
    Effect,
    FinishParts,
    Forget,
    JobRecord,
    JobStep,
    Mark,
    Publish,
    Reject,
    Release,
    Share,
)
from argus.streams.job_ledger import JobLedger, Recent
from argus.streams.liveness import JobLiveness
from argus.streams.summary_pieces import foreign_ranks

__all__ = ["JobRouter"]

log = logging.getLogger(__name__)
H = TypeVar("H")

#: Most jobs listed in :attr:`DiagnosisStats.jobs` (the counts cover all of them).
_LISTED_JOBS = 100
#: Heartbeat intervals without a heartbeat after which a job is no longer judged for hangs (see
#: :meth:`argus.streams.liveness.JobLiveness.alive`).
_ALIVE_HEARTBEATS = 3.0


class JobRouter(Generic[H]):
    """The job agent's state and rules (see the module's docstring). One per worker, not thread-safe.

    ``worker``: ``max_ranks_per_job``, ``job_idle_timeout_s``, ``max_open_jobs``, ``heartbeat_interval_s``
    (``settings.worker``). ``partitions``: of the summaries topic (the job's L3 parts). ``version``: stamped on
    every finding (:func:`~argus.streams.diagnosis.detector_version`). ``decode``: a held handle's record.
    ``remote``: what the job's holder shared of a job (its part ``job`` of the job context), for jobs held by
    another worker. ``max_pending``: messages held per job before the oldest half is acked; ``max_jobs``: jobs
    whose context is kept (the most recent). ``final_wait_s``: a finished job's records are acked at the latest
    ``job_idle_timeout_s + 4 * final_wait_s`` after its end. ``where``: a handle's place in the log, for logs.
    ``now``: the worker's monotonic clock at creation.
    """

    def __init__(self, worker: WorkerSettings, partitions: int, params: DiagnosisParams, stats: DiagnosisStats,
                 decode: Callable[[H], JobRecord], version: str,
                 remote: Callable[[str], JobContext | None] = lambda job_id: None, max_pending: int = 200_000,
                 max_jobs: int = 10_000, final_wait_s: float = 30.0, where: Callable[[H], str] = repr,
                 now: float = 0.0) -> None:
        self.worker, self.partitions, self.params, self.stats = worker, partitions, params, stats
        self.decode, self.where = decode, where
        self.max_pending, self.final_wait_s = max_pending, final_wait_s
        #: The timers' intervals: the idle jobs' (a job is abandoned within about a quarter of the timeout after
        #: it passes) and the hangs' (a quarter of the heartbeat interval, within 0.1 and 1 s).
        self.idle_tick_s = min(max(worker.job_idle_timeout_s / 4, 0.05), 10.0)
        self.hang_tick_s = min(max(worker.heartbeat_interval_s / 4, 0.1), 1.0)
        self._jobs: dict[str, JobDiagnosis] = {}
        self._held: dict[str, list[H]] = {}
        #: The jobs' context (what L3 judges with), findings published and DIAGNOSED parts: the L3 agent's view.
        self.ledger = JobLedger(version, remote, max_jobs, params.incidents, params.l3.links)
        # (kind, rank, step) of the Step/PhaseBatch records taken per running job, and the jobs finished here
        # (-> their world size, 0: unknown), whose later records are acked too.
        self._taken: dict[str, set[tuple[str, int, int]]] = {}
        self._finished: Recent[int] = Recent(max_jobs)
        # Finished jobs whose records are held until all their L3 parts are diagnosed (worker-clock finish time),
        # and the worker-clock time of each held job's first record here.
        self._finished_at: dict[str, float] = {}
        self._opened_at: dict[str, float] = {}
        # Jobs that never end: last activity per open job, the jobs whose ABANDONED was written and not read
        # back yet, the last step seen per open job (the record's ``last_step``).
        self._activity = IdleJobs()
        self._abandoning: set[str] = set()
        self._last_steps: dict[str, int] = {}
        # A blocked event loop counts as at most one tick of silence, and a stall needs at least two ticks: a
        # worker busy with another job's diagnosis never makes a job look stalled.
        self._quiet = QuietClock(self.hang_tick_s, now)
        self._hang_params = HangParams(heartbeat_interval_ns=int(worker.heartbeat_interval_s * 1e9),
                                       stall_floor_ns=max(HangParams.stall_floor_ns, int(2e9 * self.hang_tick_s)))
        self._liveness: Recent[JobLiveness] = Recent(worker.max_open_jobs)

    # -- what the L3 agent asks besides the ledger ------------------------------------------------------------

    def ready_for_final(self, job_id: str, partition: int) -> bool:
        """Whether an ended L3 part may have its final judgement now (else it waits for the job's steps)."""
        known = self.ledger
        return (job_id in self._finished or known.is_diagnosed(job_id, f"l3/{partition}")
                or known.steps_final(job_id))

    def is_open(self, job_id: str) -> bool:
        """Whether the job is running here (its records are being taken)."""
        return job_id in self._jobs

    # -- routing ---------------------------------------------------------------------------------------------

    def take(self, rec: JobRecord, handle: H, now: float) -> JobStep[H]:
        """Route one decoded record. Never raises for the record's content: a record that fails is
        dead-lettered or repaired (:meth:`failed`)."""
        if isinstance(rec, Heartbeat):
            self._heartbeat(rec, now)
            return JobStep((Ack((handle,)),))  # liveness only: a restart re-learns it from newer heartbeats
        out: list[Effect[H]] = []
        try:
            self._take(rec, handle, now, out)
        except Exception as exc:
            self._failed(rec, handle, exc, now, out)
        return JobStep(tuple(out))

    def failed(self, rec: JobRecord, handle: H, exc: Exception, now: float) -> JobStep[H]:
        """The effects of ``rec`` raised ``exc`` while they were carried out (a send failed): repaired as a
        record that fails (the job rebuilt from its held records)."""
        out: list[Effect[H]] = []
        self._failed(rec, handle, exc, now, out)
        return JobStep(tuple(out))

    def marked(self, rec: JobLifecycle, now: float, release: bool = True) -> JobStep[H]:
        """``rec`` (a DIAGNOSED written here) was delivered: its part counts as diagnosed, and (``release``)
        what that frees."""
        self.ledger.add_diagnosed(rec.job_id, [rec.part])
        if rec.part == "l1l2" and rec.job_id in self.ledger.end_read:
            self.stats.diagnosis_latency_s["l1l2"].observe(now - self.ledger.end_read[rec.job_id])
        out: list[Effect[H]] = []
        if release:
            self._maybe_release(rec.job_id, now, out)
        return JobStep(tuple(out))

    def release(self, job_id: str, now: float) -> JobStep[H]:
        """What the job's end frees once its waiting L3 parts ran (:class:`Release`)."""
        out: list[Effect[H]] = []
        self._maybe_release(job_id, now, out)
        return JobStep(tuple(out))

    def judge_hangs(self, now: float) -> JobStep[H]:
        """The hang findings of the running jobs whose heartbeats arrive, at worker time ``now`` (one
        :class:`Publish` per job; one job's failure is logged and costs only its own judgement)."""
        now = self._quiet.read(now)
        out: list[Effect[H]] = []
        alive_s = _ALIVE_HEARTBEATS * self.worker.heartbeat_interval_s
        for job_id, job in list(self._jobs.items()):
            live, topo = self._liveness.get(job_id), job.topology or self.ledger.topologies.get(job_id)
            if (live is None or topo is None or job_id in self._abandoning or self.ledger.is_diagnosed(job_id, "l1l2")
                    or not live.alive(now, alive_s)):
                continue
            try:
                median = job.clock().median_step_ns
                found = live.judge(topo, median, now)
                self._publish_hangs(job_id, found, live.now_ns(now, live.pace(median)), topo.world_size, out)
            except Exception as exc:  # liveness of one job must not stop the others' (nor the agent)
                log.error("hang judgement of job %s failed: %s", job_id, failure_reason(exc))
        return JobStep(tuple(out))

    def idle_jobs(self, now: float, now_ns: int) -> JobStep[H]:
        """The ABANDONED records of jobs idle past ``job_idle_timeout_s`` (or the longest idle beyond
        ``max_open_jobs``), and the records of finished jobs whose L3 parts never came, acked past their cap."""
        quiet = self._quiet.read(now)  # a busy worker has not seen what may have arrived
        out: list[Effect[H]] = []
        timeout_s = self.worker.job_idle_timeout_s
        over = set(self._activity.beyond(self.worker.max_open_jobs))
        for job_id in [*over, *self._activity.idle(quiet, timeout_s)]:
            if job_id in self._jobs and job_id not in self._abandoning:
                self._abandon(job_id, abandon_reason(self._activity.age(job_id, quiet), timeout_s, job_id in over),
                              now_ns, out)
        for job_id, at in list(self._finished_at.items()):
            if now - at > timeout_s + 4 * self.final_wait_s:
                done = {p for p in range(self.partitions) if self.ledger.is_diagnosed(job_id, f"l3/{p}")}
                log.warning("job %s: L3 parts %s not diagnosed %.0f s after its end; its records are acked", job_id,
                            sorted(set(range(self.partitions)) - done), now - at)
                self._release(job_id, out)
        return JobStep(tuple(out))

    def refresh_stats(self, now: float, l3_held: dict[str, int], l3_jobs: Iterable[str]) -> None:
        """The gauges of :class:`DiagnosisStats`: open jobs, held messages (with ``l3_held``, the L3 router's per
        job), the listed jobs, the jobs with context here (with ``l3_jobs``, those with L3 rank totals)."""
        st = self.stats
        st.open_jobs = len(self._jobs)
        st.stalled_jobs = sum(1 for job_id, live in self._liveness.items()
                              if job_id in self._jobs and live.stalled_since_ns is not None)
        st.held_messages = sum(len(v) for v in self._held.values()) + sum(l3_held.values())
        listed = []
        quiet = self._quiet.read(now)
        for job_id in sorted({*self._jobs, *self._finished_at},
                             key=lambda j: self._opened_at.get(j, now))[:_LISTED_JOBS]:
            state = "awaiting L3" if job_id in self._finished_at else \
                "abandoning" if job_id in self._abandoning else "open"
            idle = self._activity.age(job_id, quiet)
            listed.append({"job": job_id, "state": state, "age_s": round(now - self._opened_at.get(job_id, now), 1),
                           "idle_s": round(idle, 1) if idle is not None else None,
                           "last_step": self._last_steps.get(job_id, -1),
                           "held_messages": len(self._held.get(job_id, ())) + l3_held.get(job_id, 0)})
        st.jobs = listed
        st.context_jobs = len(self.ledger.jobs() | set(l3_jobs))

    def revoked(self) -> None:
        """Partitions were revoked: forget every running job, ack nothing (the held messages are re-delivered
        from the committed offsets and taken again). What was published and diagnosed is kept: the re-delivered
        records find the same findings, which are not published again."""
        for d in (self._jobs, self._held, self._taken, self._finished, self._last_steps, self._finished_at,
                  self._opened_at, self._liveness):
            d.clear()
        self.ledger.revoked()
        self._abandoning.clear()
        self._activity.clear()

    # -- the steps -------------------------------------------------------------------------------------------

    def _take(self, rec: JobRecord, handle: H, now: float, out: list[Effect[H]]) -> None:
        job_id = rec.job_id
        if isinstance(rec, JobTopology) and self._held_already(rec, handle, out):
            return
        if isinstance(rec, JobLifecycle) and rec.event is LifecycleEvent.DIAGNOSED:
            self.ledger.add_diagnosed(job_id, [rec.part])
            out.append(Ack((handle,)))
            self._maybe_release(job_id, now, out)
            return
        job = self._jobs.get(job_id)
        if job is None and job_id in self._finished:
            # A record of a job already finished here: a copy (replay), or one read after the job's counts were
            # complete without it -- either way not diagnosed, but an inadmissible one is still dead-lettered
            # (against the world size kept for the job once its topology is dropped).
            self._admit(rec, self._finished[job_id] or None)
            self.stats.replayed += 1
            out.append(Ack((handle,)))
            return
        if isinstance(rec, JobLifecycle) and rec.event is LifecycleEvent.ABANDONED:
            self._abandoned(rec, handle, job, now, out)
            return
        self._admit(rec, job.world_size if job is not None else None)
        if isinstance(rec, JobLifecycle):
            self._check_lifecycle(rec, job)
        if (isinstance(rec, JobLifecycle) and rec.event is LifecycleEvent.END and job_id not in self.ledger.end_read
                and not self.ledger.is_diagnosed(job_id, "l1l2")):
            self.ledger.end_read[job_id] = now
        self._activity.touch(job_id, self._quiet.read(now))
        if isinstance(rec, Step | PhaseBatch):
            self._observe(rec, job, now, out)
        copy = (type(rec).__name__, rec.rank, rec.step) if isinstance(rec, Step | PhaseBatch) else None
        if copy is not None and copy in self._taken.get(job_id, ()):
            self.stats.duplicates += 1  # delivered twice (a re-send or a replay): counted once
            out.append(Ack((handle,)))
            return
        if job is None:
            job = self._jobs[job_id] = JobDiagnosis(job_id, self.params)
            self.ledger.groups[job_id] = job.collective_groups
            self._opened_at.setdefault(job_id, now)
        self._hold(job_id, handle, out)
        job.add(rec)  # type: ignore[arg-type]  # heartbeats were routed before
        if copy is not None:
            self._taken.setdefault(job_id, set()).add(copy)
        if isinstance(rec, JobTopology) and foreign_ranks({r for _, r, _ in self._taken.get(job_id, ())}, rec, None):
            self._drop_foreign(rec, handle, out)
        self._advance(job_id, now, out)

    def _held_already(self, rec: JobTopology, handle: H, out: list[Effect[H]]) -> bool:
        """Keep a job's topology, fixed once set: another one is refused (:class:`RejectedRecordError`), a copy
        the running job holds already is acked (True)."""
        known = self.ledger.topologies.get(rec.job_id)
        if known is not None and known != rec:
            raise RejectedRecordError(f"job {rec.job_id} has a topology already (world size {known.world_size}, "
                                      f"dp {known.dp_size} x tp {known.tp_size} x pp {known.pp_size}); a "
                                      f"job's topology is fixed once set, this different one (world size "
                                      f"{rec.world_size}) is refused")
        running = self._jobs.get(rec.job_id)
        if running is not None and running.topology == rec:
            self.stats.duplicates += 1
            out.append(Ack((handle,)))
            return True
        self.ledger.topologies[rec.job_id] = rec
        return False

    def _observe(self, rec: Step | PhaseBatch, job: JobDiagnosis | None, now: float, out: list[Effect[H]]) -> None:
        """A step's progress as the hang watch sees it: a job still judged live publishes the hangs it resumes."""
        job_id = rec.job_id
        self._last_steps[job_id] = max(self._last_steps.get(job_id, -1), rec.step)
        if not self.ledger.is_diagnosed(job_id, "l1l2"):  # a replayed finished job is not judged live again
            live = self._live(job_id)
            resumed = live.observe(rec, self._quiet.read(now))
            if resumed:
                self._publish_hangs(job_id, resumed, live.newest_ns,
                                    (job.world_size if job else None) or len(live.ranks), out)

    def _drop_foreign(self, rec: JobTopology, handle: H, out: list[Effect[H]]) -> None:
        """Records of ranks outside the job read before its topology (the topics are read independently): the
        job's state rebuilt without them, each dead-lettered; ``RuntimeError`` where it still fails."""
        job_id = rec.job_id
        kept, ok = self._rebuild(job_id, self._held.pop(job_id, []), out)
        members = set(rec.rank)
        self._taken[job_id] = {t for t in self._taken.get(job_id, ()) if t[1] in members}
        if not ok:  # repaired as any failing record: without the topology, or given up
            self._held[job_id] = [h for h in kept if h is not handle]
            raise RuntimeError(f"job {job_id}'s state fails with its topology")

    def _abandoned(self, rec: JobLifecycle, handle: H, job: JobDiagnosis | None, now: float,
                   out: list[Effect[H]]) -> None:
        # Read back from the log (so a replay closes the job at the same point): the job ends here on what
        # arrived. The compressor turns the same record into job-end markers for the kernels.
        job_id = rec.job_id
        if job is None:  # never open here (or closed): nothing to drop
            if job_id in self._finished:
                out.append(Ack((handle,)))
                return
            self._finished[job_id] = rec.world_size  # e.g. a job of kernels only (abandoned by the compressor)
            if not self.ledger.is_diagnosed(job_id, "l1l2"):  # no steps to judge: findings --wait returns
                self._share(job_id, out, final=True)  # L3 parts elsewhere wait no longer
                out.append(Mark(self.ledger.diagnosed_record(job_id, "l1l2", rec.time_ns, rec.world_size)))
            out += [Ack((handle,)), FinishParts(job_id)]
            return
        self._hold(job_id, handle, out)
        job.add(rec)
        self.stats.jobs_closed_abandoned += 1
        log.warning("job %s abandoned (%s; last step %d): final diagnosis on %d steps", job_id, rec.reason,
                    rec.last_step, job.complete_steps)
        self._finish(job_id, rec.time_ns, now, out)

    def _admit(self, rec: JobRecord, world: int | None) -> None:
        if isinstance(rec, Step | PhaseBatch):
            if rec.rank >= self.worker.max_ranks_per_job:  # bounded state per rank, whatever the topology says
                raise RejectedRecordError(f"rank {rec.rank} of job {rec.job_id} is beyond max_ranks_per_job = "
                                          f"{self.worker.max_ranks_per_job}")
            if foreign_ranks([rec.rank], self.ledger.topologies.get(rec.job_id), world):
                raise RejectedRecordError(f"rank {rec.rank} is not in job {rec.job_id} (world size {world}, "
                                          f"topology {'known' if rec.job_id in self.ledger.topologies else 'unknown'})")

    def _check_lifecycle(self, rec: JobLifecycle, job: JobDiagnosis | None) -> None:
        """Refuse a START or END that contradicts what the job already is: another world size than its
        topology's, or (END) a time before the steps it would close, by more than the events' allowed skew.
        Either would close or reshape a running job on one forged or stray record."""
        if rec.event not in (LifecycleEvent.START, LifecycleEvent.END):
            return
        topo = self.ledger.topologies.get(rec.job_id)
        if topo is not None and rec.world_size != topo.world_size:
            raise RejectedRecordError(f"{rec.event.value} of job {rec.job_id} says world size {rec.world_size}, "
                                      f"its topology {topo.world_size}")
        if (rec.event is LifecycleEvent.END and job is not None and job.last_time_ns
                and rec.time_ns < job.last_time_ns - self.worker.max_event_skew_ns):
            raise RejectedRecordError(f"END of job {rec.job_id} at {rec.time_ns} ns precedes the job's steps "
                                      f"(the latest ends at {job.last_time_ns} ns) by more than "
                                      f"max_event_skew_ns")

    def _finish(self, job_id: str, end_ns: int, now: float, out: list[Effect[H]]) -> None:
        """The job's final diagnosis on what arrived, DIAGNOSED ``l1l2``, its state dropped; its waiting L3
        parts judged, then its records acked if every L3 part is DIAGNOSED too."""
        job = self._jobs[job_id]
        self._publish(job.diagnose(final=True), out)
        self.ledger.clocks[job_id] = self.ledger.final_clocks[job_id] = job.clock()
        self._share(job_id, out, final=True)
        # Released only after the waiting L3 parts ran: they still need the job's context.
        out.append(Mark(self.ledger.diagnosed_record(job_id, "l1l2", end_ns, job.world_size or 0), release=False))
        self.stats.jobs_diagnosed += 1
        del self._jobs[job_id]
        self._taken.pop(job_id, None)
        self._finished[job_id] = job.world_size or 0
        self._activity.forget(job_id)
        self._abandoning.discard(job_id)
        self._liveness.pop(job_id, None)
        self._last_steps.pop(job_id, None)
        self._finished_at[job_id] = now
        out += [FinishParts(job_id), Release(job_id)]

    def _advance(self, job_id: str, now: float, out: list[Effect[H]]) -> None:
        job = self._jobs[job_id]
        if job.finished():
            end = job.end
            self._finish(job_id, end.time_ns if end else job.last_time_ns, now, out)
        elif job.due() and not self.ledger.is_diagnosed(job_id, "l1l2"):
            # A job diagnosed before a restart is only re-read for its final diagnosis (same ids): live runs
            # on part of its records could raise what the final run did not.
            self._publish(job.diagnose(), out)
            self.ledger.clocks[job_id] = job.clock()
        if job_id in self._jobs:
            self._share(job_id, out)

    def _rebuild(self, job_id: str, handles: list[H], out: list[Effect[H]]) -> tuple[list[H], bool]:
        """A fresh state of ``job_id`` from ``handles`` (inadmissible ones dead-lettered and acked): the handles
        kept, and whether the rebuilt state works (only then is it installed)."""
        self._jobs.pop(job_id, None)
        fresh = JobDiagnosis(job_id, self.params)
        kept = []
        for h in handles:
            rec = self.decode(h)
            try:
                self._admit(rec, fresh.world_size)
            except RejectedRecordError as why:
                out += [Reject(h, failure_reason(why), job_id, getattr(rec, "rank", None)), Ack((h,))]
                continue
            fresh.add(rec)  # type: ignore[arg-type]  # heartbeats are never held
            kept.append(h)
        try:
            found = fresh.diagnose()  # the probe: does the repaired state work?
        except Exception as exc:
            log.warning("job %s: state rebuilt from %d records still fails: %s", job_id, len(kept),
                        failure_reason(exc))
            return kept, False
        self._jobs[job_id] = fresh
        self.ledger.groups[job_id] = fresh.collective_groups
        self._held[job_id] = kept
        self._publish(found, out)
        return kept, True

    def _failed(self, rec: JobRecord, handle: H, exc: Exception, now: float, out: list[Effect[H]]) -> None:
        job_id, rank = rec.job_id, getattr(rec, "rank", None)
        if isinstance(exc, RejectedRecordError):  # rejected before it touched the job's state
            out += [Reject(handle, failure_reason(exc), job_id, rank), Ack((handle,))]
            return
        log.error("job %s: record of rank %s at %s raised %s; repairing the job's state", job_id, rank,
                  self.where(handle), failure_reason(exc))
        held = [h for h in self._held.pop(job_id, []) if h is not handle]
        # First with the record (the fault may lie in an earlier record the topology now rejects), then without.
        kept, ok = self._rebuild(job_id, [*held, handle], out)
        if not ok and any(h is handle for h in kept):
            out += [Reject(handle, failure_reason(exc), job_id, rank), Ack((handle,))]
            kept, ok = self._rebuild(job_id, [h for h in kept if h is not handle], out)
        if ok:
            self.stats.states_repaired += 1
            self._advance(job_id, now, out)
            return
        # Still failing: give the job up here. Its records are stored by the sink; later ones start afresh.
        self.stats.states_discarded += 1
        log.error("job %s: state discarded; %d held records acked without diagnosis", job_id, len(kept))
        self._opened_at.pop(job_id, None)
        if kept:
            out.append(Ack(tuple(kept)))

    def _abandon(self, job_id: str, reason: str, now_ns: int, out: list[Effect[H]]) -> None:
        """The job's ABANDONED record (keyed by job: only the worker holding the job's partition of the job
        topics writes it); the job is closed when the record is read back."""
        job = self._jobs[job_id]
        world = job.world_size or max((r for _, r, _ in self._taken.get(job_id, ())), default=0) + 1
        rec = JobLifecycle(job_id, LifecycleEvent.ABANDONED, job.last_time_ns or now_ns, world, source="streams",
                           reason=reason, last_step=self._last_steps.get(job_id, -1))
        out.append(Abandon(rec))
        self._abandoning.add(job_id)
        self.stats.jobs_abandoned += 1
        log.warning("job %s: ABANDONED written (%s; last step %d, %d messages held)", job_id, reason,
                    rec.last_step, len(self._held.get(job_id, ())))

    def _heartbeat(self, hb: Heartbeat, now: float) -> None:
        self.stats.heartbeats += 1
        if hb.job_id in self._finished or self.ledger.is_diagnosed(hb.job_id, "l1l2"):
            return
        if hb.rank >= self.worker.max_ranks_per_job:
            return  # bounded state per rank
        live = self._live(hb.job_id)
        live.observe(hb, self._quiet.read(now))
        live.heartbeat_at = self._quiet.read(now)
        if hb.job_id in self._jobs:
            self._activity.touch(hb.job_id, self._quiet.read(now))  # a hung job still heartbeats: not abandoned

    def _live(self, job_id: str) -> JobLiveness:
        live = self._liveness.get(job_id)
        if live is None:
            live = self._liveness[job_id] = JobLiveness(job_id, self._hang_params)
        return live

    def _publish(self, findings: Iterable[Finding], out: list[Effect[H]], hangs: bool = False) -> None:
        found = self.ledger.publishable(findings)
        if found:
            out.append(Publish(found, hangs))

    def _publish_hangs(self, job_id: str, results: list[HangResult], time_ns: int, world_size: int,
                       out: list[Effect[H]]) -> None:
        # GPU time lost: every rank of the job idles while it is stalled (or waits for a silent rank).
        found = []
        for r in results:
            idle_ns = 1e9 * float(r.evidence.get("seconds_stalled", r.evidence.get("seconds_silent", 0.0)))
            impact = Impact(idle_ns, 1, idle_ns * world_size, idle_ns * world_size) if idle_ns > 0 else None
            found.append(to_finding(job_id, r, max(time_ns, 0), impact))
        self._publish(found, out, hangs=True)

    def _share(self, job_id: str, out: list[Effect[H]], final: bool = False) -> None:
        ctx = self.ledger.context(job_id, self._jobs.get(job_id), final)
        if ctx is not None:  # changed since the last one written
            out.append(Share(ctx))

    def _hold(self, job_id: str, handle: H, out: list[Effect[H]]) -> None:
        held = self._held.setdefault(job_id, [])
        held.append(handle)
        if len(held) > self.max_pending:  # bounded memory for endless jobs: older state is already in findings
            out.append(Ack(tuple(held[: len(held) // 2])))
            del held[: len(held) // 2]

    def _release(self, job_id: str, out: list[Effect[H]]) -> None:
        self._finished_at.pop(job_id, None)
        self._opened_at.pop(job_id, None)
        held = self._held.pop(job_id, [])
        if held:
            out.append(Ack(tuple(held)))

    def _maybe_release(self, job_id: str, now: float, out: list[Effect[H]]) -> None:
        """Ack a finished job's records once every L3 part of it is diagnosed too: a restart before then
        re-reads them, so the final L3 judged after it has the job's final steps, groups and stragglers. Once
        every part (L1/L2 and L3) is diagnosed and the job is not open here, its context is dropped."""
        if not all(self.ledger.is_diagnosed(job_id, f"l3/{p}") for p in range(self.partitions)):
            return
        if job_id in self._finished_at:
            self._release(job_id, out)
        if job_id not in self._jobs and self.ledger.is_diagnosed(job_id, "l1l2"):
            started = self.ledger.end_read.pop(job_id, None)
            if started is not None:
                self.stats.diagnosis_latency_s["job"].observe(now - started)
            # Every part is diagnosed: nothing judges the job again here (copies are acked by the jobs finished
            # here and the DIAGNOSED parts), so its context goes too -- a long-lived worker keeps no state per
            # past job.
            out.append(Forget(job_id, tombstones=self.ledger.drop(job_id)))
