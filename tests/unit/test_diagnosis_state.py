"""The stream agents' per-job diagnosis state: when steps are complete, when a job is finished, when a kernel
window is judged, and that each finding is emitted once."""

from __future__ import annotations

import dataclasses
import functools
import json

import pytest

from argus.detectors.impact import StepClock
from argus.producers.faults import Fault
from argus.producers.seed_cases import paper_case
from argus.producers.simulator import JobSimulator, SimRecord
from argus.schemas.records import (
    JobLifecycle,
    JobTopology,
    KernelSummary,
    LifecycleEvent,
    ParallelGroup,
    PhaseBatch,
    Step,
)
from argus.streams.compression import summarize_windows
from argus.streams.diagnosis import DiagnosisParams, JobDiagnosis, KernelDiagnosis, _row
from argus.streams.windows import WindowBuffer
from argus.topics import Topic
from tests.unit.test_l2 import MS, tp_pairs_batches


@functools.cache
def case1() -> tuple[SimRecord, ...]:
    return tuple(JobSimulator(paper_case(Fault.COMPUTE_STRAGGLER, job_id="c1", steps=30)).records())


def test_job_diagnosis_waits_for_all_records_and_emits_each_finding_once() -> None:
    job = JobDiagnosis("c1", DiagnosisParams(detect_every=5))
    emitted = []
    end = None
    for rec in case1():
        if rec.topic is Topic.LIFECYCLE and rec.record.event is LifecycleEvent.END:
            end = rec.record
            continue
        if rec.topic in (Topic.STEPS, Topic.PHASES, Topic.TOPOLOGY, Topic.LIFECYCLE):
            job.add(rec.record)
            if job.due():
                emitted += job.diagnose()
    assert job.complete_steps == 30 and not job.finished()
    assert end is not None
    job.add(end)
    assert job.finished()
    emitted += job.diagnose()
    ids = [f.finding_id for f in emitted]
    assert len(ids) == len(set(ids))
    assert [(f.kind, f.steps) for f in emitted if f.kind == "step_regression"] == [("step_regression", (15,))]
    assert {r for f in emitted if f.level.value == "L2" for r in f.ranks} == {5}
    assert job.collective_groups == {13: ParallelGroup.DP}
    assert job.diagnose() == []  # nothing new


@pytest.mark.parametrize("kernel_events", [0, None, 1])
def test_a_phase_level_slow_stage_waits_for_the_job_end_and_yields_to_traced_kernels(kernel_events: int | None
                                                                                     ) -> None:
    # Case 3: the last stage's backward runs x1.9 from step 0. Its phase times cannot tell that from its
    # schedule's waiting or its own share of the model: never raised live, raised by the final run only when the
    # job traced no kernels (or did not say: END without a count), else left to the kernels every stage shares.
    spec = paper_case(Fault.PP_LAST_STAGE_SLOW, job_id="c3", steps=20)
    job = JobDiagnosis("c3", DiagnosisParams(detect_every=5))
    live, end = [], None
    for rec in JobSimulator(spec).records():
        if rec.topic is Topic.LIFECYCLE and rec.record.event is LifecycleEvent.END:
            end = dataclasses.replace(rec.record, kernel_events=kernel_events)
        elif rec.topic in (Topic.STEPS, Topic.PHASES, Topic.TOPOLOGY, Topic.LIFECYCLE):
            job.add(rec.record)
            live += job.diagnose() if job.due() else []
    assert end is not None and job.complete_steps == 20
    assert not [f for f in live if f.kind == "pp_stage_slow"]
    job.add(end)
    final = [(f.kind, f.ranks, f.phase) for f in job.diagnose(final=True) if f.kind == "pp_stage_slow"]
    last_stage = tuple(r for r in range(spec.world_size) if r // (spec.world_size // spec.pp) == spec.pp - 1)
    assert job.kernels_traced() is bool(kernel_events)
    assert final == ([] if kernel_events else [("pp_stage_slow", last_stage, "backward")])


@pytest.mark.parametrize("burst", [1, 3, 7, 30])
def test_l1_findings_are_the_same_however_the_steps_arrive(burst: int) -> None:
    # Live, steps complete one at a time; under load, or in a replay, in bursts: L1 reads the same steps first
    # (every detect_every of them), so a step regression carries the same evidence either way.
    def run(burst: int) -> list[tuple[str, tuple[int, ...], str]]:
        job = JobDiagnosis("c1", DiagnosisParams(detect_every=5))
        out, end, seen = [], None, 0
        for rec in case1():
            if rec.topic is Topic.LIFECYCLE and rec.record.event is LifecycleEvent.END:
                end = rec.record
                continue
            if rec.topic in (Topic.STEPS, Topic.PHASES, Topic.TOPOLOGY, Topic.LIFECYCLE):
                job.add(rec.record)
                if job.complete_steps - seen >= burst and job.due():
                    seen = job.complete_steps
                    out += job.diagnose()
        assert end is not None
        job.add(end)
        out += job.diagnose()
        return sorted((f.kind, f.steps, json.dumps(f.evidence, sort_keys=True)) for f in out if f.level.value == "L1")

    one = run(1)
    assert one and run(burst) == one


def test_steps_complete_only_when_every_rank_reported() -> None:
    job = JobDiagnosis("c1")
    steps = [r.record for r in case1() if r.topic is Topic.STEPS and r.record.step == 0]
    phases = [r.record for r in case1() if r.topic is Topic.PHASES and r.record.step == 0]
    topo = next(r.record for r in case1() if r.topic is Topic.TOPOLOGY)
    for s in steps:
        job.add(s)
    for p in phases[:-1]:
        job.add(p)
    job.add(topo)
    assert job.complete_steps == 0
    job.add(phases[-1])
    assert job.complete_steps == 1


def _summaries() -> tuple[JobTopology, list[KernelSummary]]:
    buf = WindowBuffer(2_000_000_000, 500_000_000)
    out: list[KernelSummary] = []
    topo = next(r.record for r in case1() if r.topic is Topic.TOPOLOGY)
    for i, rec in enumerate(case1()):
        if rec.topic is Topic.KERNELS:
            out += summarize_windows(buf.add(rec.record, i).closed)
    return topo, [s for s in out if s.kernel.startswith("sm90_xmma_gemm")]


def test_kernel_windows_are_judged_when_complete_and_after_the_topology() -> None:
    topo, summaries = _summaries()
    state = KernelDiagnosis("c1", summaries[0].kernel, summaries[0].stream)
    for s in summaries:
        state.add(s)
    assert state.diagnose(None) == []  # live judgement waits for the topology
    live = state.diagnose(topo)
    final = state.diagnose(topo, final=True)
    found = live + final
    assert found and {r for f in found for r in f.ranks} == {5}
    assert len({f.finding_id for f in found}) == len(found)
    assert state.diagnose(topo, final=True) == []  # every window judged with all its ranks


def test_a_window_is_judged_live_only_once_every_rank_of_its_stages_has_it() -> None:
    # An import sends one rank after another: a window with some ranks only must wait for the others (the
    # ranks that happen to be there would be compared among themselves).
    topo, summaries = _summaries()
    rows = [_row(s, i) for s in summaries for i in range(len(s.rank))]
    clock = StepClock((max(r.window_end_ns[0] for r in rows),), 1e9)  # a step began after every window
    state = KernelDiagnosis("c1", summaries[0].kernel, summaries[0].stream)
    first = {*sorted({r.rank[0] for r in rows})[: topo.world_size // 2], 5}
    for r in rows:
        if r.rank[0] in first:
            state.add(r)
    assert len({r.window_start_ns[0] for r in rows}) >= 3 and state.diagnose(topo, clock=clock) == []
    for r in rows:
        if r.rank[0] not in first:
            state.add(r)
    found = state.diagnose(topo, clock=clock)
    assert found and {r for f in found for r in f.ranks} == {5}


def test_a_window_is_judged_live_only_once_its_steps_are_known() -> None:
    # A restarted worker may read summaries before the steps they belong to: their impact would be spread
    # over the few steps known (and overstated), so the window waits for a step that began after it.
    topo, summaries = _summaries()
    state = KernelDiagnosis("c1", summaries[0].kernel, summaries[0].stream)
    for s in summaries:
        state.add(s)
    first_end = min(e for s in summaries for e in s.window_end_ns)
    assert state.diagnose(topo, clock=StepClock((first_end - 1,), 1e9)) == []
    assert state.diagnose(topo, clock=StepClock((max(e for s in summaries for e in s.window_end_ns),), 1e9))


def test_l3_late_arrivals_only_corroborate_l2_stragglers() -> None:
    from argus.detectors.victims import drop_victims
    from argus.schemas.records import Finding, Level

    # DP 8 x TP 2 x PP 2: ranks 4 and 5 form TP group 2

    def late(rank: int) -> Finding:
        return Finding(f"id{rank}", "j", Level.L3, "compute_straggler", (rank,), (), 5.0, "{}", 0,
                       kernel="ncclDevKernel_AllReduce", stream=13)

    kept = drop_victims([late(4), late(5), late(9)], {5})
    # rank 4 only waited for its TP partner; rank 9's lateness is corroborated by nothing: late, not a cause
    assert [f.ranks for f in kept] == [(5,)]
    assert drop_victims([late(4)], set()) == []
    other = Finding("k", "j", Level.L3, "kernel_degraded", (4,), (), 1.0, "{}", 0, kernel="gemm", stream=7)
    assert drop_victims([other], set()) == [other]  # other kinds pass


def _late_pair_job(steps: int, seed: int = 0) -> list[Step | PhaseBatch | JobTopology]:
    """A DP 4 x TP 2 job traced without compute phases (each rank's TP reduce-scatter only, as in the L2
    tests): rank 5's GPU runs x1.3, so it reaches the reduce-scatter its TP partner waits in late, every step."""
    topo, batches = tp_pairs_batches(4, seed, {5: 1.3}, steps=steps)
    out: list[Step | PhaseBatch | JobTopology] = [topo]
    for step in range(steps):
        out += [Step("j", r, step, step * 200 * MS, 200 * MS) for r in range(topo.world_size)]
    return out + batches


def test_a_late_arrival_alone_is_named_live_after_ten_steps_or_at_the_end() -> None:
    # Five steps of lateness alone are the weakest L2 verdict (GPUs a few percent apart by nature arrive last
    # over five steps): live runs hold it until `late_only_min_steps`; the job's last run judges what it has.
    def named(records: list[Step | PhaseBatch | JobTopology], end: bool) -> list[tuple[int, ...]]:
        job = JobDiagnosis("j", DiagnosisParams(detect_every=5))
        for rec in records:
            job.add(rec)
        if end:
            job.add(JobLifecycle("j", LifecycleEvent.END, 0, 8))
        return [f.ranks for f in job.diagnose(final=end) if f.kind == "compute_straggler"]

    assert named(_late_pair_job(5), end=False) == []
    assert named(_late_pair_job(10), end=False) == [(5,)]
    assert named(_late_pair_job(5), end=True) == [(5,)]
