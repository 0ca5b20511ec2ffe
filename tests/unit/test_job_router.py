"""The job agent's router without a broker: acks only after delivery, holding until the job's topology and its
L3 parts, the job's end and DIAGNOSED marker, repair after a failure, rebalance, abandoned jobs, heartbeats and
hangs on an explicit clock, dead letters (what the Faust agent in argus.streams.diagnosis_agents carries out)."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from argus.core.kinds import FindingKind
from argus.core.settings import Settings
from argus.producers.faults import Fault
from argus.producers.seed_cases import paper_case
from argus.producers.simulator import JobSimulator
from argus.schemas.records import Finding, Heartbeat, JobLifecycle, LifecycleEvent, PhaseBatch, Step
from argus.streams.diagnosis import DiagnosisParams, JobDiagnosis
from argus.streams.diagnosis_stats import DiagnosisStats
from argus.streams.job_effects import (
    Abandon,
    Ack,
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
from argus.streams.job_router import JobRouter
from argus.topics import Topic

SETTINGS = Settings(job_idle_timeout_s=2.0, heartbeat_interval_s=4.0)  # idle tick 0.5 s, hang tick 1 s
PARAMS = DiagnosisParams(detect_every=5)


@functools.cache
def job(steps: int = 30, job_id: str = "c1") -> tuple[JobRecord, ...]:
    """A job with a compute straggler (rank 5 of 8) and its step regression, as the job agent reads it."""
    topics = (Topic.STEPS, Topic.PHASES, Topic.TOPOLOGY, Topic.LIFECYCLE)
    sim = JobSimulator(paper_case(Fault.COMPUTE_STRAGGLER, job_id=job_id, steps=steps)).records()
    return tuple(r.record for r in sim if r.topic in topics)


START_NS = next(r.time_ns for r in job() if isinstance(r, JobLifecycle))


def end_of(rec: JobRecord) -> float:
    """When a record arrives at the worker (s after the job's start): when its event ended."""
    t0 = START_NS
    if isinstance(rec, Step):
        ns = rec.start_ns + rec.wall_ns
    elif isinstance(rec, PhaseBatch):
        ns = max(s + d for s, d in zip(rec.start_ns, rec.duration_ns, strict=True))
    elif isinstance(rec, JobLifecycle):
        ns = rec.time_ns
    else:
        ns = t0
    return max(0.0, (ns - t0) / 1e9)


def diagnosed(job_id: str, part: str) -> JobLifecycle:
    return JobLifecycle(job_id, LifecycleEvent.DIAGNOSED, 0, 8, source="streams", part=part)


@dataclass(frozen=True, eq=False)
class Msg:
    """A message handle: an id to tell the acks, and the record it carries."""

    id: int
    record: JobRecord = field(repr=False)


class BrokerDownError(ConnectionError):
    """A send the broker did not take."""


class Agent:
    """Plays the Faust agent: routes records, carries out the effects in order and records them."""

    def __init__(self, settings: Settings = SETTINGS, partitions: int = 2, fail: type | None = None) -> None:
        self.stats = DiagnosisStats()
        self.router: JobRouter[Msg] = JobRouter(settings.worker, partitions, PARAMS, self.stats,
                                                lambda m: m.record, "test", final_wait_s=1.0)
        self.log: list[tuple[str, Any]] = []  # the effects carried out, in order
        self.acked: list[int] = []
        self.published: list[Finding] = []
        self.marks: list[JobLifecycle] = []
        self.abandons: list[JobLifecycle] = []
        self.rejected: list[tuple[int, str]] = []
        self.forgotten: list[tuple[str, bool]] = []
        self.fail = fail  # the kind of effect whose delivery fails (the broker is down)
        self.next_id = 0
        self.now = self.ticked = 0.0

    def take(self, rec: JobRecord, now: float | None = None) -> JobStep[Msg]:
        self.now = self.now if now is None else now
        msg = Msg(self.next_id, rec)
        self.next_id += 1
        step = self.router.take(rec, msg, self.now)
        self.carry_out(step)
        return step

    def feed(self, records: tuple[JobRecord, ...] | list[JobRecord]) -> None:
        for r in records:
            self.take(r)

    def carry_out(self, step: JobStep[Msg]) -> None:
        for e in step.effects:
            if self.fail is not None and isinstance(e, self.fail):
                raise BrokerDownError("not delivered")
            if isinstance(e, Publish):
                self.published += e.findings
                self.log.append(("publish", [f.finding_id for f in e.findings]))
            elif isinstance(e, Share):
                self.log.append(("share", e.context.final))
            elif isinstance(e, Mark):
                self.marks.append(e.record)
                self.log.append(("mark", e.record.part))
                self.carry_out(self.router.marked(e.record, self.now, e.release))
            elif isinstance(e, Abandon):
                self.abandons.append(e.record)
                self.log.append(("abandon", e.record.job_id))
            elif isinstance(e, Reject):
                self.rejected.append((e.handle.id, e.reason))
                self.log.append(("reject", e.handle.id))
            elif isinstance(e, Ack):
                self.acked += [h.id for h in e.handles]
                self.log += [("ack", h.id) for h in e.handles]
            elif isinstance(e, FinishParts):
                self.log.append(("finish parts", e.job_id))
            elif isinstance(e, Release):
                self.carry_out(self.router.release(e.job_id, self.now))
            elif isinstance(e, Forget):
                self.forgotten.append((e.job_id, e.tombstones))

    def tick(self, until: float, step_s: float = 0.5) -> None:
        """The worker's timers, every ``step_s`` from their last tick to ``until``."""
        while self.ticked + step_s <= until + 1e-9:
            self.ticked += step_s
            self.now = max(self.now, self.ticked)
            self.carry_out(self.router.idle_jobs(self.now, 0))
            self.carry_out(self.router.judge_hangs(self.now))

    def ids(self) -> list[str]:
        return [f.finding_id for f in self.published]


def found(findings: list[Finding]) -> set[tuple[FindingKind, tuple[int, ...]]]:
    return {(f.kind, f.ranks) for f in findings}


def test_records_are_held_until_every_part_is_diagnosed_and_the_marker_lists_the_findings() -> None:
    a = Agent()
    a.feed(job())
    assert found(a.published) >= {(FindingKind.COMPUTE_STRAGGLER, (5,))}
    assert [m.part for m in a.marks] == ["l1l2"] and a.marks[0].finding_ids == tuple(sorted(a.ids()))
    assert a.log.index(("share", True)) < a.log.index(("mark", "l1l2")) < a.log.index(("finish parts", "c1"))
    assert a.acked == [] and not a.router.is_open("c1")  # held: a restart before L3 re-reads the job
    a.take(diagnosed("c1", "l3/0"))
    assert a.acked == [a.next_id - 1]  # the marker itself
    a.take(diagnosed("c1", "l3/1"))
    assert sorted(a.acked) == list(range(a.next_id)) and a.forgotten == [("c1", True)]
    assert len(a.ids()) == len(set(a.ids()))
    a.take(job()[10])  # a copy after the end: acked, not diagnosed
    assert a.acked[-1] == a.next_id - 1 and a.stats.replayed == 1


def test_a_message_is_acked_only_after_what_it_caused_was_delivered() -> None:
    for fail in (Mark, Share, Publish):
        a = Agent(fail=fail)
        a.router.ledger.add_diagnosed("c1", ["l3/0", "l3/1"])  # the L3 parts first: the end frees everything
        with pytest.raises(BrokerDownError):
            a.feed(job())
        assert a.acked == []
    a = Agent()
    a.router.ledger.add_diagnosed("c1", ["l3/0", "l3/1"])
    a.feed(job())
    first_ack = next(i for i, (what, _) in enumerate(a.log) if what == "ack")
    assert a.log.index(("mark", "l1l2")) < first_ack
    assert all(what != "publish" for what, _ in a.log[first_ack:])
    assert sorted(a.acked) == list(range(a.next_id))


def test_records_before_the_topology_are_held_and_those_outside_it_dead_lettered() -> None:
    records = list(job())
    topo, start = records.pop(0), records.pop(0)  # the steps' topic is read ahead of the other two
    early = [r for r in records if isinstance(r, Step | PhaseBatch) and r.step == 0]
    stray = dataclasses.replace(early[0], rank=9)  # a rank the topology does not have
    a = Agent()
    a.feed([*early, stray])
    assert a.acked == [] and a.rejected == [] and a.published == []
    a.take(topo)
    assert a.rejected == [(len(early), "RejectedRecordError: rank 9 is not in job c1 (world size None, "
                                       "topology known)")]
    assert a.acked == [len(early)]  # the stray only; the others wait for the job's end
    a.take(start)
    a.feed([r for r in records if r not in early])
    clean = Agent()
    clean.feed(job())
    assert sorted(a.ids()) == sorted(clean.ids()) and [m.part for m in a.marks] == ["l1l2"]


def test_a_failing_state_is_rebuilt_with_the_same_finding_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    clean = Agent()
    clean.feed(job())
    real, calls = JobDiagnosis.diagnose, [0]

    def flaky(self: JobDiagnosis, final: bool = False) -> list[Finding]:
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("transient")
        return real(self, final)

    monkeypatch.setattr(JobDiagnosis, "diagnose", flaky)
    a = Agent()
    a.feed(job())
    assert a.stats.states_repaired == 1 and a.rejected == []
    assert sorted(a.ids()) == sorted(clean.ids()) and len(a.ids()) == len(set(a.ids()))
    assert a.marks[0].finding_ids == clean.marks[0].finding_ids


def test_a_bad_record_is_dead_lettered_with_its_reason_and_the_job_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    real = JobDiagnosis.diagnose

    def fragile(self: JobDiagnosis, final: bool = False) -> list[Finding]:
        if self.end is not None and self.end.reason == "poison":
            raise ValueError("poisoned END")
        return real(self, final)

    monkeypatch.setattr(JobDiagnosis, "diagnose", fragile)
    *body, end = job()
    assert isinstance(end, JobLifecycle)
    a = Agent()
    a.feed(body)
    mid = body[50]
    assert isinstance(mid, Step)
    a.take(dataclasses.replace(mid, rank=12))  # outside the job: rejected on arrival
    a.take(dataclasses.replace(end, reason="poison"))  # breaks the job's state: rejected, the job rebuilt
    n = len(body)
    assert a.rejected == [(n, "RejectedRecordError: rank 12 is not in job c1 (world size 8, topology known)"),
                          (n + 1, "ValueError: poisoned END")]
    assert a.acked == [n, n + 1] and a.router.is_open("c1") and a.stats.states_repaired == 1
    a.take(end)  # the stage goes on: the job ends on its real END
    clean = Agent()
    clean.feed(job())
    assert sorted(a.ids()) == sorted(clean.ids()) and [m.part for m in a.marks] == ["l1l2"]


def test_rebalance_forgets_acks_nothing_and_the_redelivery_doubles_nothing() -> None:
    a = Agent()
    a.feed(job()[:400])  # findings published already
    a.router.revoked()
    assert a.acked == [] and not a.router.is_open("c1")
    before = len(a.published)
    a.feed(job())  # re-delivered from the committed offsets, then the rest
    clean = Agent()
    clean.feed(job())
    assert before > 0 and sorted(a.ids()) == sorted(clean.ids()) and len(a.ids()) == len(set(a.ids()))
    assert a.marks[0].finding_ids == clean.marks[0].finding_ids and a.stats.duplicates == 0


def test_a_silent_job_is_abandoned_after_the_idle_timeout_and_closed_by_its_record() -> None:
    a = Agent()
    a.feed([r for r in job() if not isinstance(r, Step | PhaseBatch) or r.step < 12][:-1])  # no END
    a.tick(1.5)
    assert a.abandons == []
    a.tick(2.5)
    (rec,) = a.abandons
    assert rec.event is LifecycleEvent.ABANDONED and rec.last_step == 11 and rec.world_size == 8
    assert rec.reason.startswith("idle: no record for 2.0 s")
    a.tick(4.0)
    assert len(a.abandons) == 1  # written once; the job closes when it is read back
    a.take(rec)
    assert [m.part for m in a.marks] == ["l1l2"] and not a.router.is_open("c1") and a.acked == []
    assert a.stats.jobs_closed_abandoned == 1 and a.stats.jobs_abandoned == 1
    a.tick(a.now + 2.0 + 4 * 1.0 + 0.5)  # its L3 parts never came: its records are acked past the cap
    assert sorted(a.acked) == list(range(a.next_id))


def test_heartbeats_are_acked_at_once_and_a_stall_is_judged_by_the_timer() -> None:
    records = [r for r in job() if not isinstance(r, Step | PhaseBatch) or r.step < 10]
    records = sorted(records[:-1], key=end_of)  # no END: the job hangs in step 10
    last = end_of(records[-1])
    starts = sorted((r.start_ns, r.step) for r in job() if isinstance(r, Step) and r.step <= 10)

    def began(t: float) -> int:  # the step the ranks are in at ``t`` s
        return max((s for ns, s in starts if ns <= START_NS + t * 1e9), default=-1)

    beats = [Heartbeat("c1", r, START_NS + int(t * 1e9), step=began(t)) for t in (x / 2 for x in range(
        int(2 * last) + 30)) for r in range(8)]
    start = START_NS
    timeline = sorted([(end_of(r), 0, r) for r in records] + [((b.time_ns - start) / 1e9, 1, b) for b in beats],
                      key=lambda x: (x[0], x[1]))
    a = Agent()
    stalled_at = None
    for t, _, rec in timeline:
        a.tick(t, step_s=1.0)
        step = a.take(rec, now=max(a.now, t))
        if isinstance(rec, Heartbeat):
            assert len(step.effects) == 1 and [m.id for m in step.acks] == [a.next_id - 1]
        if stalled_at is None and any(f.kind is FindingKind.JOB_STALLED for f in a.published):
            stalled_at = a.now
    assert a.stats.heartbeats == len(beats)
    assert stalled_at is not None and stalled_at - last > 2.0  # at least the stall bound after the last step
    assert [f.kind for f in a.published].count(FindingKind.JOB_STALLED) == 1  # judged again, published once
    a.router.refresh_stats(a.now, {}, [])
    assert a.stats.stalled_jobs == 1  # the gauge of the ArgusJobStalled alert
    nxt = next(r for r in job() if isinstance(r, Step) and r.step == 10)
    a.take(nxt, now=a.now + 1.0)
    assert FindingKind.JOB_RESUMED in [f.kind for f in a.published]
    a.router.refresh_stats(a.now, {}, [])
    assert a.stats.stalled_jobs == 0


@settings(max_examples=20, deadline=None)
@given(order=st.permutations(range(len(job(6, "p")))), copies=st.lists(st.integers(0, len(job(6, "p")) - 1),
                                                                     max_size=8))
def test_every_message_is_acked_exactly_once_whatever_the_order(order: list[int], copies: list[int]) -> None:
    records = job(6, "p")
    a = Agent()
    for i in [*order, *copies]:
        a.take(records[i])
    for part in ("l3/0", "l3/1"):
        a.take(diagnosed("p", part))
    for m in list(a.marks):  # the DIAGNOSED written, read back from the lifecycle topic
        a.take(m)
    assert sorted(a.acked) == list(range(a.next_id))  # each once
    assert [m.part for m in a.marks] == ["l1l2"] and len(a.ids()) == len(set(a.ids()))
    assert a.stats.duplicates + a.stats.replayed >= len(copies) - sum(1 for i in copies
                                                                      if not isinstance(records[i], Step | PhaseBatch))


def test_a_jobs_topology_is_fixed_once_set_and_a_contradicting_lifecycle_refused() -> None:
    """One decodable record could rewrite a job: a second, different topology replaced the first (later records
    rejected, the straggler lost), an END of another world size or of time -2^62 ended the job early."""
    records = list(job())
    topo, start = records[0], records[1]
    assert isinstance(start, JobLifecycle) and start.event is LifecycleEvent.START
    *body, end = records
    assert isinstance(end, JobLifecycle) and end.event is LifecycleEvent.END
    a = Agent()
    a.feed(body[:200])
    n = a.next_id
    a.take(topo)  # an identical copy: acked, nothing changes
    assert a.acked == [n] and a.rejected == []
    a.take(dataclasses.replace(topo, world_size=16, dp_size=8, rank=tuple(range(16)), host=("h",) * 16,
                               dp_group=tuple(range(16)), tp_group=(0,) * 16, pp_group=(0,) * 16,
                               ep_group=tuple(range(16)), pp_stage=(0,) * 16))
    a.take(dataclasses.replace(end, world_size=4))
    a.take(dataclasses.replace(end, time_ns=-(2**62) + 1))
    a.take(dataclasses.replace(start, world_size=2))
    assert [i for i, _ in a.rejected] == [n + 1, n + 2, n + 3, n + 4]
    assert "topology is fixed once set" in a.rejected[0][1] and "world size 4, its topology 8" in a.rejected[1][1]
    assert "precedes the job's steps" in a.rejected[2][1] and "START of job c1 says world size 2" in a.rejected[3][1]
    assert a.router.is_open("c1") and a.marks == []
    a.feed(body[200:])
    a.take(end)
    clean = Agent()
    clean.feed(job())
    assert sorted(a.ids()) == sorted(clean.ids()) and [m.part for m in a.marks] == ["l1l2"]
    assert found(a.published) >= {(FindingKind.COMPUTE_STRAGGLER, (5,))}
