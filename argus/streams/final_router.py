"""The end of each L3 part, without Kafka: when its final judgement runs, its rank aggregate, its DIAGNOSED record.

A part (a job's summaries on one summaries partition) has ended once :class:`SummaryRouter` holds every
compressor partition's end marker. :class:`FinalRouter` judges it at once, or, while the job agent here has not
finished the job's steps, lets it wait (never blocking an agent) until :meth:`FinalRouter.finish_waiting` or a
:meth:`FinalRouter.tick` finds the steps shared by the job's holder or gives up. Part 0 judges the job's rank
aggregate once every part's per-rank totals are in the shared context table (other parts may run on other
workers), or past the cap; its DIAGNOSED record waits for that. Each answer is a tuple of effects
(:data:`FinalEffect`) that the agent carries out in order; time is passed in (the worker's monotonic clock, s).
Why the parts wait: docs/stream-agents.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from argus.core.errors import failure_reason
from argus.schemas.job_context import CONTEXT_JOB_PART, JobContext
from argus.streams.diagnosis import DiagnosisParams, RankDiagnosis
from argus.streams.diagnosis_stats import DiagnosisStats
from argus.streams.job_context import context_totals, totals_context
from argus.streams.job_effects import Ack, Mark, Publish
from argus.streams.job_ledger import JobLedger
from argus.streams.summary_router import Part, SummaryRouter

__all__ = ["Discard", "FinalEffect", "FinalRouter", "JobAgent", "ShareTotals", "SharedContext", "Tombstone"]

log = logging.getLogger(__name__)
H = TypeVar("H")


class JobAgent(Protocol):
    """What the final router asks of the job agent here (:class:`~argus.streams.job_router.JobRouter`)."""

    def ready_for_final(self, job_id: str, partition: int) -> bool: ...

    def is_open(self, job_id: str) -> bool: ...


class SharedContext(Protocol):
    """The job context every worker shares (:class:`~argus.streams.job_context.ContextTable`)."""

    def get(self, job_id: str) -> dict[str, JobContext]: ...

    def put(self, ctx: JobContext) -> None: ...

    def forget(self, job_id: str, part: str) -> None: ...

    def incomplete(self, job_id: str) -> dict[str, tuple[int, int]]: ...


@dataclass(frozen=True)
class ShareTotals:
    """A part's per-rank totals to write to the context topic (the table here has them already)."""

    context: JobContext


@dataclass(frozen=True)
class Discard(Generic[H]):
    """A dead letter (stage ``diagnose-kernels``) for the part's last message: what its final judgement lost."""

    handle: H
    reason: str
    job: str


@dataclass(frozen=True)
class Tombstone:
    """A tombstone to write, without waiting, for the job's context ``part`` (the table here forgot it)."""

    job_id: str
    part: str


#: One thing for the agent to do, in order, each delivered before the next (:class:`Mark`: then tell the job
#: router, :meth:`~argus.streams.job_router.JobRouter.marked`).
FinalEffect = Publish | ShareTotals | Discard[H] | Mark | Ack[H] | Tombstone


@dataclass
class _Judged(Generic[H]):
    """A part judged, not closed yet: its last message, what its judgement lost, when it was judged."""

    part: Part
    handle: H
    failures: list[str]
    since: float


class FinalRouter(Generic[H]):
    """The L3 parts' ends (see the module's docstring). One per worker, not thread-safe.

    ``summaries``: the L3 router whose parts end here. ``jobs``: the job agent's router; ``known``: its ledger
    (the jobs' context, published ids). ``shared``: the context table. ``holds_job``: whether this worker's job
    agent reads the job's records (its partition of the job topics). A waiting part gives up on the job's steps
    when the job is held here, not open, and the job agent read nothing for ``final_wait_s``; waiting parts
    (and a part 0 waiting for totals) give up past ``idle_timeout_s + 4 * final_wait_s``.
    ``now``: the worker's monotonic clock at creation.
    """

    def __init__(self, summaries: SummaryRouter[H], jobs: JobAgent, known: JobLedger, shared: SharedContext,
                 params: DiagnosisParams, stats: DiagnosisStats, partitions: int, holds_job: Callable[[str], bool],
                 idle_timeout_s: float, final_wait_s: float = 30.0, now: float = 0.0) -> None:
        self.summaries, self.jobs, self.known, self.shared = summaries, jobs, known, shared
        self.params, self.stats, self.partitions, self.holds_job = params, stats, partitions, holds_job
        self.final_wait_s = final_wait_s
        self.cap_s = idle_timeout_s + 4 * final_wait_s
        # Ended parts waiting for their job's final steps, and when the first of each job began to.
        self._finals: dict[str, list[tuple[Part, H]]] = {}
        self._since: dict[str, float] = {}
        # Part 0s judged, waiting for the other parts' totals before the job's rank aggregate.
        self._ranks: dict[str, _Judged[H]] = {}
        # When the job agent last took a record: while it reads, a job it holds may still finish.
        self._job_read = now

    # -- what the agent reads ----------------------------------------------------------------------------------

    def waiting_finals(self, job_id: str) -> list[Part]:
        """The job's ended parts waiting for its final steps."""
        return [part for part, _ in self._finals.get(job_id, [])]

    def waiting_ranks(self) -> set[str]:
        """Jobs whose part 0 waits for the other parts' totals."""
        return set(self._ranks)

    # -- routing ---------------------------------------------------------------------------------------------

    def job_read(self, now: float) -> None:
        """The job agent took a record at ``now``."""
        self._job_read = now

    def ended(self, part: Part, handle: H, now: float) -> tuple[FinalEffect[H], ...]:
        """``part`` has all its summaries (``handle``: its last message): judged now, or once the job agent here
        has the job's final steps (after a restart it re-reads them)."""
        job_id = part[0]
        if self.jobs.ready_for_final(job_id, part[1]):
            return tuple(self._finish(part, handle, now))
        self.stats.finals_deferred += 1
        self._finals.setdefault(job_id, []).append((part, handle))
        self._since.setdefault(job_id, now)
        return ()

    def finish_waiting(self, job_id: str, now: float) -> tuple[FinalEffect[H], ...]:
        """The job's steps are final here (:class:`~argus.streams.job_effects.FinishParts`): its waiting parts."""
        self._since.pop(job_id, None)
        out: list[FinalEffect[H]] = []
        for part, handle in self._finals.pop(job_id, []):
            out += self._finish(part, handle, now)
        return tuple(out)

    def tick(self, now: float) -> tuple[FinalEffect[H], ...]:
        """The timer: the waiting parts whose job's steps are shared now or will not come, then the part 0s whose
        job's totals are all in now, or that waited past the cap."""
        return (*self._give_up(now), *self._judge_waiting_ranks(now))

    def forget(self, job_id: str, tombstones: bool) -> tuple[FinalEffect[H], ...]:
        """Every part of the job is DIAGNOSED (:class:`~argus.streams.job_effects.Forget`): its rank totals go,
        and, when ``tombstones`` (this worker wrote the job's context), its context parts, here and on the topic:
        a diagnosed job leaves nothing on the compacted topic."""
        self.summaries.forget_job(job_id)
        if not tombstones:
            return ()
        parts = (CONTEXT_JOB_PART, *(f"l3/{p}" for p in range(self.partitions)))
        for part in parts:
            self.shared.forget(job_id, part)
        return tuple(Tombstone(job_id, part) for part in parts)

    def revoked(self) -> None:
        """Partitions were revoked: nothing waits any more (the parts' messages are re-delivered)."""
        for d in (self._finals, self._since, self._ranks):
            d.clear()

    # -- the steps -------------------------------------------------------------------------------------------

    def _give_up(self, now: float) -> list[FinalEffect[H]]:
        out: list[FinalEffect[H]] = []
        for job_id, since in list(self._since.items()):
            idle = (not self.jobs.is_open(job_id) and self.holds_job(job_id)
                    and now - max(since, self._job_read) > self.final_wait_s)
            if not self.known.steps_final(job_id) and not idle and now - since <= self.cap_s:
                continue
            del self._since[job_id]
            waiting = self._finals.pop(job_id, [])
            log.warning("job %s: final L3 of %d parts without the job's final steps (waited %.0f s)", job_id,
                        len(waiting), now - since)
            self.stats.finals_without_steps += len(waiting)
            for part, handle in waiting:
                out += self._finish(part, handle, now)
        return out

    def _finish(self, part: Part, handle: H, now: float) -> list[FinalEffect[H]]:
        """The part's final L3 and totals; then its DIAGNOSED, except a part 0 whose job's totals are not all in."""
        job_id, partition = part
        found, failures = self.summaries.final(part, self.known)
        out: list[FinalEffect[H]] = []
        for findings in found:
            try:
                published = self.known.publishable(findings, final=True)
            except Exception as exc:  # a kernel's findings must not cost the part's DIAGNOSED
                failures.append(f"final L3 findings of job {job_id}: {failure_reason(exc)}")
            else:
                out += [Publish(published)] if published else []
        self.known.part_done(job_id, partition)
        totals = totals_context(job_id, partition, *self.summaries.rank_totals(job_id, partition))
        self.shared.put(totals)
        out.append(ShareTotals(totals))
        judged = _Judged(part, handle, failures, now)
        if partition == 0 and not self._judge_ranks(judged, False, out):
            # Part 0's DIAGNOSED waits for the job's rank aggregate, so `findings --wait` includes its findings.
            self._ranks[job_id] = judged
            return out
        self._close(judged, out)
        if job_id in self._ranks:  # part 0 waits for this part's totals
            out += self._judge_waiting_ranks(now)
        return out

    def _judge_ranks(self, judged: _Judged[H], final: bool, out: list[FinalEffect[H]]) -> bool:
        """The job's rank aggregate from every part's totals; ``False`` while a part's are missing, unless
        ``final`` (then judged on those that came)."""
        job_id = judged.part[0]
        parts = self.shared.get(job_id)
        missing = [p for p in range(self.partitions) if f"l3/{p}" not in parts]
        if missing and not final:
            return False
        if missing:
            log.warning("job %s: rank aggregate without the totals of L3 parts %s (pieces read, of: %s)", job_id,
                        missing, self.shared.incomplete(job_id))
        merged = RankDiagnosis(job_id, self.params)
        try:
            for p in range(self.partitions):
                ctx = parts.get(f"l3/{p}")
                if ctx is not None:
                    merged.add_totals(context_totals(ctx), ctx.time_ns)
            found = self.known.publishable(merged.diagnose(self.known.topology_of(job_id),
                                                           self.known.clock_of(job_id)), final=True)
        except Exception as exc:  # the aggregate must not cost the part's DIAGNOSED
            judged.failures.append(f"rank aggregate of job {job_id}: {failure_reason(exc)}")
        else:
            out += [Publish(found)] if found else []
        self._release_links(job_id, out)
        return True

    def _release_links(self, job_id: str, out: list[FinalEffect[H]]) -> None:
        """The pipeline links the job's final judgement held here (:meth:`JobLedger.release_links`)."""
        try:
            found = self.known.release_links(job_id)
        except Exception as exc:  # logged, never the part's DIAGNOSED
            log.error("job %s: held pipeline links: %s", job_id, failure_reason(exc))
        else:
            out += [Publish(found)] if found else []

    def _close(self, judged: _Judged[H], out: list[FinalEffect[H]]) -> None:
        """The part's DIAGNOSED record, after a dead letter of what it lost; then its held messages acked."""
        job_id, partition = judged.part
        if partition != 0 and not self.summaries.is_open((job_id, 0)):
            # Part 0 (the rank aggregate, which releases them) is judged already or on another worker.
            self._release_links(job_id, out)
        if judged.failures:
            self.stats.states_discarded += len(judged.failures)
            out.append(Discard(judged.handle, "; ".join(judged.failures), job_id))
        topo = self.known.topology_of(job_id)
        last_ns, held = self.summaries.close(judged.part)
        out.append(Mark(self.known.diagnosed_record(job_id, f"l3/{partition}", last_ns,
                                                    topo.world_size if topo else 0)))
        self.stats.l3_parts_diagnosed += 1
        if held:
            out.append(Ack(tuple(held)))

    def _judge_waiting_ranks(self, now: float) -> list[FinalEffect[H]]:
        out: list[FinalEffect[H]] = []
        for job_id, judged in list(self._ranks.items()):
            if self._judge_ranks(judged, now - judged.since > self.cap_s, out):
                del self._ranks[job_id]
                self._close(judged, out)
        return out
