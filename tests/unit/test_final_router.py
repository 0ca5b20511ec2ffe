"""The L3 parts' ends without a broker: final judgement now or after the job's steps, part 0 waiting for every
part's totals, the timeouts on an explicit clock, tombstones, rebalance, failures, and the one lifecycle scan
(what the Faust agents in argus.streams.diagnosis_agents carry out)."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from argus.core.settings import Settings
from argus.detectors.impact import StepClock
from argus.schemas.records import KernelSummary
from argus.streams.diagnosis import DiagnosisParams, RankDiagnosis
from argus.streams.diagnosis_shell import LifecycleScan
from argus.streams.diagnosis_stats import DiagnosisStats
from argus.streams.final_router import Discard, FinalEffect, FinalRouter, ShareTotals, Tombstone
from argus.streams.job_context import ContextTable, totals_context
from argus.streams.job_effects import Ack, Mark, Publish
from argus.streams.job_ledger import JobLedger
from argus.streams.summary_pieces import summary_end_marker
from argus.streams.summary_router import SummaryRouter
from tests.unit.test_links import _rank_finding, _side_finding
from tests.unit.test_summary_router import summary

IDLE_S, WAIT_S = 10.0, 1.0
CAP_S = IDLE_S + 4 * WAIT_S


@dataclass(frozen=True)
class Msg:
    """A message handle: an id to tell the acks, and the summary it carries."""

    id: int
    summary: KernelSummary = field(compare=False, repr=False)


@dataclass
class Jobs:
    """The job agent's answers: jobs whose final steps are known here, jobs open here."""

    ready: set[str] = field(default_factory=set)
    open: set[str] = field(default_factory=set)

    def ready_for_final(self, job_id: str, partition: int) -> bool:
        return job_id in self.ready

    def is_open(self, job_id: str) -> bool:
        return job_id in self.open


class World:
    """A worker's L3 side: the L3 router fed real summaries, the job ledger, the context table (not reading)."""

    def __init__(self, partitions: int = 2, ready: bool = True, held: bool = True) -> None:
        self.partitions = partitions
        self.stats = DiagnosisStats()
        self.summaries: SummaryRouter[Msg] = SummaryRouter(DiagnosisParams(), self.stats, lambda m: m.summary,
                                                           partitions, max_windows=4)
        self.jobs = Jobs(ready={"j"} if ready else set())
        self.known = JobLedger("v1")
        self.shared = ContextTable(Settings(), 100)
        self.held: set[str] = {"j"} if held else set()
        self.router: FinalRouter[Msg] = FinalRouter(self.summaries, self.jobs, self.known, self.shared,
                                                    DiagnosisParams(), self.stats, partitions, self.held.__contains__,
                                                    IDLE_S, WAIT_S, now=0.0)
        self.ids = itertools.count()
        self.sent: dict[int, list[int]] = {}  # partition -> ids of its messages

    def ended(self, partition: int, now: float = 0.0, windows: int = 3) -> tuple[FinalEffect[Msg], ...]:
        """The part's summaries (rank 3 slow) and every compressor's end marker, then its end."""
        ended = None
        for s in [*(summary(w, slow={3: 2.0}) for w in range(windows)),
                  *(summary_end_marker("j", q) for q in range(self.partitions))]:
            msg = Msg(next(self.ids), s)
            self.sent.setdefault(partition, []).append(msg.id)
            step = self.summaries.take(s, msg, partition, self.known)
            assert step.rejected == [] and step.ack == []
            ended = step.ended or ended
        assert ended == ("j", partition)
        return self.router.ended(ended, msg, now)


def marks(effects: tuple[FinalEffect[Msg], ...]) -> list[str]:
    return [e.record.part for e in effects if isinstance(e, Mark)]


def acks(effects: tuple[FinalEffect[Msg], ...]) -> list[int]:
    return [h.id for e in effects if isinstance(e, Ack) for h in e.handles]


def test_a_part_of_a_finished_job_is_judged_shared_diagnosed_and_acked_in_that_order() -> None:
    w = World()
    out = w.ended(1)
    kinds = [type(e) for e in out]
    assert kinds.index(ShareTotals) < kinds.index(Mark) < kinds.index(Ack)
    assert marks(out) == ["l3/1"] and sorted(acks(out)) == w.sent[1]
    share = next(e for e in out if isinstance(e, ShareTotals))
    assert share.context.part == "l3/1" and "l3/1" in w.shared.get("j")  # in the table before it is written
    assert w.stats.l3_parts_diagnosed == 1 and w.stats.finals_deferred == 0


def test_part_0_waits_for_every_parts_totals_and_is_diagnosed_last_with_the_rank_aggregate(
        monkeypatch: pytest.MonkeyPatch) -> None:
    judged: list[dict[int, float]] = []

    def spy(self: RankDiagnosis, *args: object) -> list[object]:
        judged.append(dict(self.totals()[0].calls))
        return []

    monkeypatch.setattr(RankDiagnosis, "diagnose", spy)
    w = World(partitions=3)
    out = w.ended(0)
    assert marks(out) == [] and acks(out) == [] and w.router.waiting_ranks() == {"j"} and judged == []
    assert marks(w.ended(1)) == ["l3/1"] and w.router.waiting_ranks() == {"j"}
    out = w.ended(2)
    assert marks(out) == ["l3/2", "l3/0"] and sorted(acks(out)) == sorted(w.sent[2] + w.sent[0])
    assert w.router.waiting_ranks() == set()
    # Judged once, on the three parts' totals: 3 windows of 50 calls per rank in each part.
    assert len(judged) == 1 and set(judged[0].values()) == {3 * 3 * 50}


def test_part_0_takes_the_totals_another_worker_shares_at_the_next_tick() -> None:
    w = World()
    assert marks(w.ended(0)) == []
    assert w.router.tick(1.0) == ()
    w.shared.put(totals_context("j", 1, 0, []))  # part 1 ended on another worker: read from the context topic
    assert marks(w.router.tick(2.0)) == ["l3/0"]
    assert w.router.tick(3.0) == ()


def test_part_0_judges_the_totals_that_came_once_it_waited_past_the_cap() -> None:
    w = World()
    w.ended(0, now=5.0)
    assert w.router.tick(5.0 + CAP_S) == ()
    out = w.router.tick(5.0 + CAP_S + 0.1)
    assert marks(out) == ["l3/0"] and not any(isinstance(e, Discard) for e in out)


def test_a_part_waits_for_the_jobs_final_steps_and_is_judged_once_they_are_final() -> None:
    w = World(ready=False, held=False)
    assert w.ended(1, now=1.0) == () and w.router.waiting_finals("j") == [("j", 1)]
    assert w.stats.finals_deferred == 1
    assert w.router.tick(1.0 + CAP_S) == ()  # not held here: only the cap ends the wait
    out = w.router.finish_waiting("j", 3.0)
    assert marks(out) == ["l3/1"] and w.router.waiting_finals("j") == []
    assert w.router.finish_waiting("j", 4.0) == () and w.stats.finals_without_steps == 0


def test_a_waiting_part_gives_up_once_the_job_agent_holding_the_job_read_nothing_for_final_wait_s() -> None:
    w = World(ready=False, held=True)
    w.router.job_read(0.0)
    w.ended(1, now=1.0)
    assert w.router.tick(1.0 + WAIT_S) == ()
    w.router.job_read(1.5)  # the job agent still reads: the job it holds may still finish
    assert w.router.tick(1.0 + WAIT_S + 0.2) == ()
    w.jobs.open.add("j")  # open in the job agent: its end will come
    assert w.router.tick(1.5 + WAIT_S + 0.1) == ()
    w.jobs.open.clear()
    assert marks(w.router.tick(1.5 + WAIT_S + 0.1)) == ["l3/1"] and w.stats.finals_without_steps == 1


def test_a_waiting_part_held_elsewhere_is_judged_when_the_holder_shares_the_final_steps_or_at_the_cap() -> None:
    w = World(ready=False, held=False)
    w.ended(1, now=0.0)
    assert w.router.tick(WAIT_S * 3) == ()
    w.known.final_clocks["j"] = StepClock((0, 10**9), 1e9)  # the holder shared the job's final steps
    assert marks(w.router.tick(WAIT_S * 3)) == ["l3/1"]
    w2 = World(ready=False, held=False)
    w2.ended(1, now=0.0)
    assert w2.router.tick(CAP_S) == () and marks(w2.router.tick(CAP_S + 0.1)) == ["l3/1"]


def test_forgetting_a_diagnosed_job_tombstones_its_context_parts_only_where_it_was_written() -> None:
    w = World(partitions=2)
    w.ended(1)
    w.shared.put(totals_context("j", 0, 0, []))
    assert w.summaries.jobs() == {"j"}
    assert w.router.forget("j", tombstones=False) == ()
    assert w.summaries.jobs() == set() and set(w.shared.get("j")) == {"l3/0", "l3/1"}
    out = w.router.forget("j", tombstones=True)
    assert out == (Tombstone("j", "job"), Tombstone("j", "l3/0"), Tombstone("j", "l3/1"))
    assert w.shared.get("j") == {}


def test_a_rebalance_forgets_what_waits() -> None:
    w = World(ready=False)
    w.ended(1)
    w.jobs.ready.add("j")
    w.ended(0)
    assert w.router.waiting_finals("j") and w.router.waiting_ranks() == {"j"}
    w.router.revoked()
    assert w.router.waiting_finals("j") == [] and w.router.waiting_ranks() == set()
    assert w.router.tick(CAP_S * 2) == () and w.router.finish_waiting("j", CAP_S * 2) == ()


def test_a_failing_rank_aggregate_is_dead_lettered_and_part_0_is_diagnosed_all_the_same(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(self: RankDiagnosis, *args: object) -> None:
        raise RuntimeError("aggregate exploded")

    monkeypatch.setattr(RankDiagnosis, "diagnose", boom)
    w = World()
    w.ended(1)
    out = w.ended(0)
    kinds = [type(e) for e in out]
    assert kinds.index(Discard) < kinds.index(Mark) and marks(out) == ["l3/0"]
    discard = next(e for e in out if isinstance(e, Discard))
    assert "aggregate exploded" in discard.reason and discard.job == "j"
    assert w.stats.states_discarded == 1


def published(effects: tuple[FinalEffect[Msg], ...]) -> list[tuple[str, tuple[int, ...]]]:
    return [(f.kind.value, f.ranks) for e in effects if isinstance(e, Publish) for f in e.findings]


@pytest.mark.parametrize("straggler", [False, True])
def test_a_final_pipeline_pair_is_published_after_the_rank_aggregate_and_none_beside_a_straggler(
        monkeypatch: pytest.MonkeyPatch, straggler: bool) -> None:
    # Part 1's final judgement pairs two pipeline sides; part 0's rank aggregate, judged last, may name the
    # straggler they wait for (the offline path answers the same: test_links).
    sides = [_side_finding(1, 0, 1.8, 1e6), _side_finding(5, 1, 2.2, 3e6)]
    monkeypatch.setattr(SummaryRouter, "final", lambda self, part, view: ([sides] if part[1] == 1 else [], []))
    monkeypatch.setattr(RankDiagnosis, "diagnose",
                        lambda self, *a: [_rank_finding(41)] if straggler else [])
    w = World()
    assert marks(w.ended(0)) == []
    out = w.ended(1)
    assert marks(out) == ["l3/1", "l3/0"]
    link = [("link_degraded", (1, 5))]
    assert published(out) == ([("rank_degraded", (41,))] if straggler else link)
    kinds = [type(e) for e in out]
    assert straggler or kinds.index(Publish) < [i for i, k in enumerate(kinds) if k is Mark][-1]


def test_a_final_pipeline_pair_of_a_part_whose_part_0_is_elsewhere_is_published_at_its_close(
        monkeypatch: pytest.MonkeyPatch) -> None:
    sides = [_side_finding(1, 0, 1.8, 1e6), _side_finding(5, 1, 2.2, 3e6)]
    monkeypatch.setattr(SummaryRouter, "final", lambda self, part, view: ([sides], []))
    out = World().ended(1)  # part 0 is judged by another worker: its aggregate never comes here
    kinds = [type(e) for e in out]
    assert published(out) == [("link_degraded", (1, 5))] and kinds.index(Publish) < kinds.index(Mark)


@settings(max_examples=25, deadline=None)
@given(partitions=st.integers(1, 4), data=st.data())
def test_every_part_is_diagnosed_once_part_0_last_and_every_message_acked_once_after_its_mark(
        partitions: int, data: st.DataObject) -> None:
    """Whatever the order the parts end in, whether the job's steps are final yet, and the timer's ticks."""
    w = World(partitions=partitions, ready=data.draw(st.booleans()), held=data.draw(st.booleans()))
    order = data.draw(st.permutations(range(partitions)))
    now, ended_0 = 0.0, 0.0
    out: list[tuple[float, FinalEffect[Msg]]] = []
    for p in order:
        ended_0 = now if p == 0 else ended_0
        out += [(now, e) for e in w.ended(p, now, windows=data.draw(st.integers(1, 2)))]
        if data.draw(st.booleans()):
            now += data.draw(st.sampled_from([0.1, WAIT_S, CAP_S]))
            out += [(now, e) for e in w.router.tick(now)]
    if data.draw(st.booleans()):
        out += [(now, e) for e in w.router.finish_waiting("j", now)]
    now += CAP_S + 1
    out += [(now, e) for e in w.router.tick(now)]
    effects = tuple(e for _, e in out)
    assert sorted(marks(effects)) == sorted(f"l3/{p}" for p in range(partitions))
    # Part 0 is diagnosed last, unless it gave up waiting for the other parts' totals past the cap.
    at_0 = next(t for t, e in out if isinstance(e, Mark) and e.record.part == "l3/0")
    assert marks(effects)[-1] == "l3/0" or at_0 - ended_0 > CAP_S
    assert sorted(acks(effects)) == sorted(i for ids in w.sent.values() for i in ids)
    marked: set[int] = set()
    for e in effects:
        if isinstance(e, Mark):
            marked.add(int(e.record.part.split("/")[1]))
        if isinstance(e, Ack):
            assert {p for p, ids in w.sent.items() if {h.id for h in e.handles} & set(ids)} <= marked
    assert w.router.tick(now + 2 * CAP_S) == () and w.router.waiting_ranks() == set()


def test_the_lifecycle_scan_runs_once_for_both_agents_and_fills_the_ledger_before_either_goes_on() -> None:
    known, calls, starts = JobLedger("v1"), [], []

    def read() -> dict[str, set[str]]:
        calls.append(1)
        return {"old": {"l1l2", "l3/0"}}

    scan = LifecycleScan(read, known, lambda: starts.append(1))

    async def agent() -> bool:
        await scan.wait()
        return known.is_diagnosed("old", "l3/0") and known.is_diagnosed("old", "l1l2")

    async def both() -> list[bool]:
        return list(await asyncio.gather(agent(), agent()))

    assert asyncio.run(both()) == [True, True]
    assert calls == [1] and starts == [1]


def test_a_failed_lifecycle_scan_stops_both_agents() -> None:
    def read() -> dict[str, set[str]]:
        raise OSError("broker gone")

    scan = LifecycleScan(read, JobLedger("v1"))

    async def both() -> list[object]:
        return list(await asyncio.gather(scan.wait(), scan.wait(), return_exceptions=True))

    assert [type(r) for r in asyncio.run(both())] == [OSError, OSError]

