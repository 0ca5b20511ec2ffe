"""The L3 agent's router without a broker: holding and acking, end markers, copies, replays after a restart,
foreign rows, rebalance, repair of a failing state, the final judgement (what the Faust agent carries out)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from argus.core.kinds import FindingKind
from argus.detectors.impact import StepClock
from argus.schemas.records import Finding, JobTopology, KernelSummary, ParallelGroup
from argus.streams.diagnosis import DiagnosisParams
from argus.streams.diagnosis_stats import DiagnosisStats
from argus.streams.summary_pieces import BoundedKernelDiagnosis, summary_end_marker
from argus.streams.summary_router import SummaryRouter, SummaryStep

W = 10_000_000_000
T0 = 1_767_225_600 * 10**9
RANKS = tuple(range(16))


@dataclass(frozen=True)
class Msg:
    """A message handle: the summary it carries, and an id to tell the acks."""

    id: int
    summary: KernelSummary = field(compare=False)


@dataclass
class View:
    diagnosed: set[str] = field(default_factory=set)
    topology: JobTopology | None = None
    stragglers: set[int] = field(default_factory=set)

    def is_diagnosed(self, job_id: str, part: str) -> bool:
        return part in self.diagnosed

    def topology_of(self, job_id: str) -> JobTopology | None:
        return self.topology

    def groups_of(self, job_id: str) -> dict[int, ParallelGroup]:
        return {}

    def stragglers_of(self, job_id: str) -> set[int]:
        return self.stragglers

    def clock_of(self, job_id: str) -> StepClock | None:
        return None


def summary(window: int, ranks: tuple[int, ...] = RANKS, slow: dict[int, float] | None = None, n: int = 50,
            kernel: str = "gemm", piece: int = 0) -> KernelSummary:
    """One cluster per rank: ``n`` calls of 100 us (x ``slow[rank]``), a little spread by rank."""
    slow = slow or {}
    p50 = [int(100_000 * slow.get(r, 1.0) * (1 + 0.002 * (r % 5))) for r in ranks]
    ws = T0 + window * W
    k = len(ranks)
    return KernelSummary(job_id="j", kernel=kernel, stream=7, rank=ranks, window_start_ns=(ws,) * k,
                         window_end_ns=(ws + W,) * k, n_events=(n,) * k, n_clusters=(1,) * k,
                         cluster_count=(n,) * k, cluster_p50_ns=tuple(p50),
                         cluster_p99_ns=tuple(int(p * 1.1) for p in p50), cluster_min_ns=tuple(int(p * 0.95)
                                                                                              for p in p50),
                         cluster_max_ns=tuple(int(p * 1.2) for p in p50), cluster_sum_ns=tuple(n * p for p in p50),
                         piece=(piece,) * k)


class Agent:
    """Plays the Faust agent: routes summaries and records dead letters, findings and acks."""

    def __init__(self, partitions: int = 2, max_pending: int = 1000, view: View | None = None) -> None:
        self.router: SummaryRouter[Msg] = SummaryRouter(DiagnosisParams(), DiagnosisStats(), lambda m: m.summary,
                                                        partitions, max_windows=4, max_pending=max_pending)
        self.view = view or View()
        self.acked: list[int] = []
        self.findings: list[Finding] = []
        self.rejected: list[str] = []
        self.ended: list[tuple[str, int]] = []
        self.next_id = 0

    def carry_out(self, step: SummaryStep[Msg]) -> SummaryStep[Msg]:
        self.rejected += [r.reason for r in step.rejected]
        self.findings += step.findings
        self.acked += [m.id for m in step.ack]
        if step.ended is not None:
            self.ended.append(step.ended)
        return step

    def take(self, s: KernelSummary, partition: int = 0) -> SummaryStep[Msg]:
        msg = Msg(self.next_id, s)
        self.next_id += 1
        try:
            return self.carry_out(self.router.take(s, msg, partition, self.view))
        except Exception as exc:  # as the agent: a raising summary goes to the router's repair
            return self.carry_out(self.router.failed(s, msg, partition, exc, self.view))

    def end(self, partition: int = 0) -> None:
        """Every compressor partition's marker, then the final L3 and the close, as the agent does."""
        for q in range(self.router.partitions):
            self.take(summary_end_marker("j", q), partition)
        assert self.ended[-1] == ("j", partition)
        found, failures = self.router.final(("j", partition), self.view)
        assert failures == []
        for f in found:
            self.findings += f
        self.acked += [m.id for m in self.router.close(("j", partition))[1]]


def test_messages_are_held_until_the_part_closes_and_it_ends_with_every_partitions_marker() -> None:
    a = Agent(partitions=2)
    for w in range(3):
        a.take(summary(w))
    assert a.acked == [] and a.router.held_messages == 3
    a.take(summary_end_marker("j", 0))
    assert a.ended == []  # one kernel partition of two has finished the job
    a.end()
    assert sorted(a.acked) == list(range(a.next_id)) and a.router.held_messages == 0


def test_a_slow_rank_is_found_and_victims_of_a_known_straggler_are_not() -> None:
    a = Agent()
    for w in range(4):
        a.take(summary(w, slow={5: 1.8}))
    a.end()
    assert [(f.kind, f.ranks) for f in a.findings] == [(FindingKind.KERNEL_DEGRADED, (5,))]
    b = Agent(view=View(stragglers={5}))  # named a straggler already: its kernels are its finding's evidence
    for w in range(4):
        b.take(summary(w, slow={5: 1.8}))
    b.end()
    assert b.findings == []


def test_copies_are_acked_not_added_and_a_larger_copy_replaces() -> None:
    a = Agent()
    a.take(summary(0, n=40))
    a.take(summary(0, n=40))  # a copy
    assert a.acked == [1] and a.router.stats.duplicates == 1
    a.take(summary(0, n=50))  # a complete re-summary after a partial one: taken
    assert a.acked == [1] and a.router.held_messages == 2
    assert a.router.rank_totals("j", 0)[1][0].calls[0] == 40  # the rank totals count each piece once


def test_after_a_restart_a_diagnosed_part_feeds_only_the_rank_totals() -> None:
    a = Agent(view=View(diagnosed={"l3/0"}))
    for w in range(4):
        step = a.take(summary(w, slow={5: 1.8}))
        assert step.findings == [] and step.ack == []
    assert a.router.stats.replayed == 4 and a.router.rank_totals("j", 0)[1][0].calls[5] == 200
    # Every part diagnosed: a copy is acked at once.
    b = Agent(view=View(diagnosed={"l3/0", "l3/1"}))
    assert [m.id for m in b.take(summary(0)).ack] == [0] and b.router.held_messages == 0


def test_rows_of_ranks_outside_the_job_are_dead_lettered_the_rest_kept() -> None:
    topo = JobTopology("j", 4, 4, 1, 1, (0, 1, 2, 3), ("h",) * 4, (0,) * 4, (0, 1, 2, 3), (0,) * 4, (0,) * 4,
                       (0,) * 4, (0,) * 4, (0,) * 4)
    a = Agent(view=View(topology=topo))
    step = a.take(summary(0, ranks=(0, 1, 2, 3, 9)))
    assert step.rejected[0].rank == 9 and "4 of 5 rows kept" in step.rejected[0].reason and step.ack == []
    step = a.take(summary(1, ranks=(7, 9)))
    assert [m.id for m in step.ack] == [1] and "0 of 2 rows kept" in step.rejected[0].reason


def test_rebalance_forgets_and_acks_nothing_and_the_redelivery_judges_the_same() -> None:
    msgs = [summary(w, slow={3: 2.0}) for w in range(4)]
    a = Agent()
    for s in msgs[:2]:
        a.take(s)
    a.router.revoked()
    assert a.acked == [] and a.router.held_messages == 0 and a.router.jobs() == set()
    fresh = Agent()
    for agent in (a, fresh):
        agent.findings.clear()
        for s in msgs:
            agent.take(s)
        agent.end()
    assert [f.finding_id for f in a.findings] == [f.finding_id for f in fresh.findings] != []


def test_more_than_max_pending_held_acks_the_oldest_half() -> None:
    a = Agent(max_pending=4)
    for w in range(5):
        a.take(summary(w))
    assert a.acked == [0, 1] and a.router.held_messages == 3


def test_a_summary_that_breaks_its_state_is_dead_lettered_and_the_state_rebuilt_without_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    real = BoundedKernelDiagnosis.diagnose

    def fragile(self: BoundedKernelDiagnosis, *args: object, **kwargs: object) -> list[Finding]:
        if 99 in self._seen_ranks:
            raise ValueError("poisoned by rank 99")
        return real(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(BoundedKernelDiagnosis, "diagnose", fragile)
    a = Agent()
    a.take(summary(0))
    step = a.take(summary(0, ranks=(99,), piece=1))
    assert [m.id for m in step.ack] == [1] and step.rejected[0].reason == "ValueError: poisoned by rank 99"
    assert a.router.stats.states_repaired == 1 and a.router.held_messages == 1
    a.take(summary(1))
    a.end()
    assert sorted(a.acked) == list(range(a.next_id))


def test_one_failing_kernel_in_the_final_judgement_costs_only_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    a = Agent()
    for w in range(4):
        a.take(summary(w, slow={5: 1.8}))
        a.take(summary(w, kernel="bad"))
    real = BoundedKernelDiagnosis.diagnose

    def fails_bad(self: BoundedKernelDiagnosis, *args: object, **kwargs: object) -> list[Finding]:
        if self.kernel == "bad" and kwargs.get("final"):
            raise RuntimeError("boom")
        return real(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(BoundedKernelDiagnosis, "diagnose", fails_bad)
    for q in range(2):
        a.take(summary_end_marker("j", q))
    found, failures = a.router.final(("j", 0), a.view)
    assert failures == ["final L3 of 'bad' stream 7: RuntimeError: boom"]
    assert [f.ranks for f in a.findings + [f for fs in found for f in fs]] == [(5,)]
