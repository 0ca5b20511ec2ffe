"""The L3 agent's logic, without Kafka: decoded kernel summaries in; what to dead-letter, publish, hold and ack out.

:class:`SummaryRouter` keeps the state of every L3 *part* (a job's summaries on one summaries partition): the
bounded (kernel, stream) states, the job-end markers seen, the messages held un-acked, the pieces taken, the
per-rank totals for the job's rank aggregate. It answers each summary with a :class:`SummaryStep`; the Faust
agent in :mod:`argus.streams.diagnosis_agents` carries it out (dead letters, then findings, then acks) and,
when a part has ended, runs its final L3 (:meth:`SummaryRouter.final`) and closes it
(:meth:`SummaryRouter.close`). What the router needs of the job (its topology, collective groups, stragglers,
steps, which parts are DIAGNOSED) it asks a :class:`JobView`, which the agent backs with the job agent's state
and the shared job context. The rules, unit-tested without a broker: see docs/internals/streams.md.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from argus.core.errors import failure_reason
from argus.detectors.impact import StepClock
from argus.detectors.l3_ranks import KernelTotals
from argus.detectors.victims import drop_victims
from argus.schemas.records import Finding, JobTopology, KernelSummary, ParallelGroup
from argus.streams.diagnosis import DiagnosisParams, RankDiagnosis
from argus.streams.diagnosis_stats import DiagnosisStats
from argus.streams.summary_pieces import BoundedKernelDiagnosis, PieceLedger, foreign_ranks, is_end_marker, select_rows

__all__ = ["JobView", "Part", "Rejection", "SummaryRouter", "SummaryStep"]

log = logging.getLogger(__name__)
H = TypeVar("H")
#: An L3 part: (job, summaries partition).
Part = tuple[str, int]


class JobView(Protocol):
    """What the L3 router asks of a job (the job agent's state, or what another worker shared)."""

    def is_diagnosed(self, job_id: str, part: str) -> bool: ...

    def topology_of(self, job_id: str) -> JobTopology | None: ...

    def groups_of(self, job_id: str) -> dict[int, ParallelGroup]: ...

    def stragglers_of(self, job_id: str) -> set[int]: ...

    def clock_of(self, job_id: str) -> StepClock | None: ...


@dataclass(frozen=True)
class Rejection:
    """A dead letter for the summary being routed (stage ``diagnose-kernels``)."""

    reason: str
    rank: int | None = None


@dataclass
class SummaryStep(Generic[H]):
    """What the agent does for one summary, in this order: dead-letter ``rejected``, publish ``findings``, ack
    ``ack``; then, when ``ended`` names a part, that part has all its summaries (final L3 and close)."""

    ack: list[H] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    ended: Part | None = None


class SummaryRouter(Generic[H]):
    """The L3 agent's state and rules (see the module's docstring). One per agent, not thread-safe.

    ``partitions``: of the kernel and summaries topics (an end marker comes from each kernel partition).
    ``max_windows``: judged windows kept per (job, kernel, stream). ``max_pending``: messages held per part
    before the oldest half is acked. ``max_jobs``: jobs whose rank totals are kept (the most recent).
    ``decode``: a held handle's summary.
    """

    def __init__(self, params: DiagnosisParams, stats: DiagnosisStats, decode: Callable[[H], KernelSummary],
                 partitions: int, max_windows: int, max_pending: int = 200_000, max_jobs: int = 10_000) -> None:
        self.params, self.stats, self.decode = params, stats, decode
        self.partitions, self.max_windows, self.max_pending = partitions, max_windows, max_pending
        self.max_jobs = max_jobs
        self._kernels: defaultdict[Part, dict[tuple[str, int], BoundedKernelDiagnosis]] = defaultdict(dict)
        self._markers: defaultdict[Part, set[int]] = defaultdict(set)
        self._held: defaultdict[Part, list[H]] = defaultdict(list)
        self._last_window: dict[Part, int] = {}
        self._ledgers: defaultdict[Part, PieceLedger] = defaultdict(PieceLedger)
        # The job's rank aggregate per part here (summaries partition -> its kernels' per-rank totals).
        self._rank_parts: dict[str, dict[int, RankDiagnosis]] = {}

    # -- what the agent reads ----------------------------------------------------------------------------------

    def held_by_job(self) -> dict[str, int]:
        """Messages held per job (over its parts here)."""
        out: defaultdict[str, int] = defaultdict(int)
        for (job_id, _), held in self._held.items():
            out[job_id] += len(held)
        return dict(out)

    @property
    def held_messages(self) -> int:
        return sum(len(v) for v in self._held.values())

    def jobs(self) -> set[str]:
        """Jobs with rank totals here."""
        return set(self._rank_parts)

    def is_open(self, part: Part) -> bool:
        """Whether ``part`` has summaries, markers or messages here not yet closed."""
        return part in self._kernels or part in self._markers or part in self._held

    def rank_totals(self, job_id: str, partition: int) -> tuple[int, list[KernelTotals]]:
        """The part's per-rank kernel totals (for the job's rank aggregate) and the last event time they cover."""
        mine = self._rank_parts.get(job_id, {}).get(partition)
        return (mine.last_time_ns, list(mine.totals())) if mine is not None else (0, [])

    # -- routing ---------------------------------------------------------------------------------------------

    def take(self, s: KernelSummary, handle: H, partition: int, view: JobView) -> SummaryStep[H]:
        """Route one decoded summary read on ``partition``. Raises what judging it raises (then call
        :meth:`failed`)."""
        part = (s.job_id, partition)
        st = self.stats
        if all(view.is_diagnosed(s.job_id, f"l3/{p}") for p in range(self.partitions)):
            # A copy (or a re-sent end marker) after every L3 part of the job and its rank aggregate were
            # diagnosed: judging again would rewrite its DIAGNOSED records without the finding ids.
            st.replayed += 1
            return SummaryStep(ack=[handle])
        if is_end_marker(s):
            acks = self._hold(part, handle)
            self._markers[part].add(s.stream)
            return SummaryStep(ack=acks, ended=part if len(self._markers[part]) >= self.partitions else None)
        admitted, bad = self._admit(s, view)
        rejected = []
        if bad:
            kept = 0 if admitted is None else len(admitted.rank)
            rejected.append(Rejection(f"rows of ranks {bad} are not in job {s.job_id}'s topology; {kept} of "
                                      f"{len(s.rank)} rows kept", bad[0]))
        if admitted is None:
            return SummaryStep(ack=[handle], rejected=rejected)
        grown, new = self._ledgers[part].fresh(admitted)
        if grown is None:
            st.duplicates += 1  # copies of pieces already taken
            return SummaryStep(ack=[handle], rejected=rejected)
        acks = self._hold(part, handle)
        if new is not None:  # the rank totals add pieces up, so each counts once
            if s.job_id not in self._rank_parts and len(self._rank_parts) >= self.max_jobs:
                del self._rank_parts[next(iter(self._rank_parts))]  # bounded memory: the oldest job's go
            per_part = self._rank_parts.setdefault(s.job_id, {})
            per_part.setdefault(partition, RankDiagnosis(s.job_id, self.params)).add(new)
        self._last_window[part] = max(self._last_window.get(part, 0), *grown.window_end_ns)
        if view.is_diagnosed(s.job_id, f"l3/{partition}"):
            st.replayed += 1  # diagnosed before a restart: feeds the job's rank aggregate only
            return SummaryStep(ack=acks, rejected=rejected)
        state = self._state(part, grown)
        state.add(grown)
        return SummaryStep(ack=acks, rejected=rejected, findings=self._judge(state, view))

    def failed(self, s: KernelSummary, handle: H, partition: int, exc: Exception, view: JobView
               ) -> SummaryStep[H]:
        """``take`` of ``s`` raised ``exc``: its (kernel, stream) state rebuilt from the held summaries with it;
        if that fails too, ``s`` is dead-lettered and acked and the state rebuilt without it (or dropped)."""
        part = (s.job_id, partition)
        if not is_end_marker(s):
            ok, found = self._rebuild(part, s, None, view)
            if ok:
                self.stats.states_repaired += 1
                return SummaryStep(findings=found)
        held = self._held.get(part, [])
        if any(h is handle for h in held):
            held[:] = [h for h in held if h is not handle]
        step: SummaryStep[H] = SummaryStep(ack=[handle], rejected=[Rejection(failure_reason(exc),
                                                                             s.rank[0] if s.rank else None)])
        if is_end_marker(s):
            return step
        ok, step.findings = self._rebuild(part, s, handle, view)
        if ok:
            self.stats.states_repaired += 1
        else:
            self.stats.states_discarded += 1
        return step

    def final(self, part: Part, view: JobView) -> tuple[list[list[Finding]], list[str]]:
        """The final L3 of every (kernel, stream) of ``part`` (their states go): the findings of each, to
        publish in turn, and the failures (one kernel's failure never costs the others)."""
        job_id = part[0]
        topo, groups, clock = view.topology_of(job_id), view.groups_of(job_id), view.clock_of(job_id)
        victims = view.stragglers_of(job_id)
        found, failures = [], []
        for state in self._kernels.pop(part, {}).values():
            try:
                found.append(drop_victims(state.diagnose(topo, final=True, group_kind=groups.get(state.stream),
                                                         clock=clock), victims))
            except Exception as exc:  # one kernel's state must not cost the job's other kernels
                failures.append(f"final L3 of {state.kernel!r} stream {state.stream}: {failure_reason(exc)}")
        return found, failures

    def close(self, part: Part) -> tuple[int, list[H]]:
        """``part`` is DIAGNOSED: the end of its last window (ns, for the DIAGNOSED record) and its held
        messages, to ack now; its markers and pieces go."""
        self._markers.pop(part, None)
        self._ledgers.pop(part, None)
        self._kernels.pop(part, None)
        return self._last_window.pop(part, 0), self._held.pop(part, [])

    def forget_job(self, job_id: str) -> None:
        """Every part of the job is diagnosed: its rank totals go."""
        self._rank_parts.pop(job_id, None)

    def revoked(self) -> None:
        """Partitions were revoked: forget every part, ack nothing (the held messages are re-delivered from the
        committed offsets and taken again)."""
        for d in (self._kernels, self._markers, self._held, self._last_window, self._ledgers, self._rank_parts):
            d.clear()

    # -- the steps -------------------------------------------------------------------------------------------

    def _hold(self, part: Part, handle: H) -> list[H]:
        held = self._held[part]
        held.append(handle)
        if len(held) <= self.max_pending:
            return []
        # Bounded memory for endless jobs: the older state is in findings already.
        old = held[: len(held) // 2]
        del held[: len(held) // 2]
        return old

    def _admit(self, s: KernelSummary, view: JobView) -> tuple[KernelSummary | None, list[int]]:
        """``s`` without rows of ranks outside the job (``None`` if none is left), and those ranks."""
        topo = view.topology_of(s.job_id)
        bad = foreign_ranks(s.rank, topo, topo.world_size if topo else None)
        if not bad:
            return s, []
        rows = [i for i, r in enumerate(s.rank) if r not in bad]
        return (select_rows(s, rows) if rows else None), bad

    def _state(self, part: Part, s: KernelSummary) -> BoundedKernelDiagnosis:
        key = (s.kernel, s.stream)
        state = self._kernels[part].get(key)
        if state is None:
            state = self._kernels[part][key] = BoundedKernelDiagnosis(s.job_id, s.kernel, s.stream, self.params,
                                                                      self.max_windows)
        return state

    def _judge(self, state: BoundedKernelDiagnosis, view: JobView) -> list[Finding]:
        job_id = state.job_id
        found = state.diagnose(view.topology_of(job_id), group_kind=view.groups_of(job_id).get(state.stream),
                               clock=view.clock_of(job_id))
        before = state.rows_ignored
        state.prune()
        self.stats.l3_rows_ignored += state.rows_ignored - before
        return drop_victims(found, view.stragglers_of(job_id))

    def _rebuild(self, part: Part, s: KernelSummary, skip: H | None, view: JobView) -> tuple[bool, list[Finding]]:
        """Rebuild the (kernel, stream) state of ``s`` in ``part`` from the held summaries (without ``skip``):
        whether the rebuilt state works, and its findings."""
        self._kernels[part].pop((s.kernel, s.stream), None)
        state = self._state(part, s)
        for h in self._held.get(part, []):
            if h is skip:
                continue
            held = self.decode(h)
            if (held.kernel, held.stream) == (s.kernel, s.stream):
                admitted, _ = self._admit(held, view)  # the rejected rows were dead-lettered on arrival
                if admitted is not None:
                    state.add(admitted)
        try:
            return True, self._judge(state, view)
        except Exception as exc:
            log.warning("L3 state of job %s kernel %r stream %s still fails after a rebuild: %s", s.job_id,
                        s.kernel, s.stream, failure_reason(exc))
            self._kernels[part].pop((s.kernel, s.stream), None)
            return False, []
