"""The job simulator: timing semantics, the paper's five faults, batching and publication order."""

from __future__ import annotations

import functools
import re
import time
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import pytest

from argus.producers.faults import Fault, FaultSpec
from argus.producers.seed_cases import paper_case
from argus.producers.sim_workload import (
    COMPUTE_STREAM,
    DP_STREAM,
    K_ALL_GATHER,
    K_ALL_REDUCE,
    K_GEMM,
    K_REDUCE_SCATTER,
    K_SEND_RECV,
    TP_STREAM,
    GradSync,
)
from argus.producers.simulator import JobSimulator, JobSpec, simulate
from argus.producers.topology import build_topology
from argus.schemas.records import (
    Heartbeat,
    JobLifecycle,
    KernelBatch,
    LifecycleEvent,
    ParallelGroup,
    PhaseBatch,
    PhaseKind,
    Step,
)
from argus.topics import Topic, job_key, rank_key
from tests.samples import RecordingPublisher


@dataclass
class Run:
    sim: JobSimulator
    steps: list[Step]
    phases: list[PhaseBatch]
    batches: list[KernelBatch]

    def events(self, rank: int) -> dict[str, np.ndarray]:
        bs = [b for b in self.batches if b.rank == rank]
        return {
            "name": np.concatenate([np.array(b.names, dtype=object)[b.name_idx] for b in bs]),
            "stream": np.concatenate([b.stream for b in bs]),
            "start": np.concatenate([b.start_ns for b in bs]),
            "dur": np.concatenate([b.duration_ns for b in bs]),
            "step": np.concatenate([b.step for b in bs]),
        }

    def kernel_p50(self, kernel: str, stream: int | None = None, min_step: int = 0) -> dict[int, float]:
        out = {}
        for r in range(self.sim.spec.world_size):
            ev = self.events(r)
            m = (ev["name"] == kernel) & (ev["step"] >= min_step)
            if stream is not None:
                m &= ev["stream"] == stream
            if m.any():
                out[r] = float(np.median(ev["dur"][m]))
        return out

    def phase_mean(self, name: str, min_step: int = 0, kind: PhaseKind | None = None) -> dict[int, float]:
        acc: dict[int, list[int]] = defaultdict(list)
        for pb in self.phases:
            if pb.step >= min_step:
                acc[pb.rank] += [d for k, n, d in zip(pb.kinds, pb.names, pb.duration_ns, strict=True)
                                 if n == name and (kind is None or k == kind)]
        return {r: float(np.mean(v)) for r, v in sorted(acc.items())}

    def walls(self) -> np.ndarray:
        per: dict[int, int] = {}
        for s in self.steps:
            per[s.step] = max(per.get(s.step, 0), s.wall_ns)
        return np.array([per[k] for k in sorted(per)], dtype=float)


def _collect(spec: JobSpec, batch_events: int = 4096) -> Run:
    sim = JobSimulator(spec, batch_events)
    run = Run(sim, [], [], [])
    for steps, phases, batches in sim.steps():
        run.steps += steps
        run.phases += phases
        run.batches += batches
    run.batches += sim.final_batches()
    return run


@functools.cache
def case(fault: Fault) -> Run:
    return _collect(paper_case(fault))


@functools.cache
def healthy() -> Run:
    return _collect(JobSpec("healthy", dp=4, tp=2, pp=2, steps=12, grad_sync=GradSync.DISTRIBUTED))


def _others(d: dict[int, float], ranks: set[int]) -> list[float]:
    return [v for r, v in d.items() if r not in ranks]


# -- generic semantics -------------------------------------------------------------------------------


def test_deterministic_by_seed() -> None:
    spec = JobSpec("d", dp=2, tp=2, steps=3, seed=7)
    a, b = _collect(spec), _collect(spec)
    c = _collect(JobSpec("d", dp=2, tp=2, steps=3, seed=8))
    assert a.steps == b.steps and a.phases == b.phases
    for x, y in zip(a.batches, b.batches, strict=True):
        assert x.names == y.names and np.array_equal(x.start_ns, y.start_ns)
        assert np.array_equal(x.duration_ns, y.duration_ns)
    assert not np.array_equal(a.events(0)["dur"], c.events(0)["dur"])


def test_kernels_ordered_and_streams_sequential() -> None:
    run = healthy()
    for r in range(run.sim.spec.world_size):
        ev = run.events(r)
        assert (ev["dur"] > 0).all()
        assert (np.diff(ev["start"]) >= 0).all()
        assert (np.diff(ev["step"]) >= 0).all()
        for stream in np.unique(ev["stream"]):
            m = ev["stream"] == stream
            assert (ev["start"][m][1:] >= (ev["start"] + ev["dur"])[m][:-1]).all(), (r, stream)


def test_healthy_job_looks_healthy() -> None:
    run = healthy()
    walls = run.walls()
    assert walls.std() / walls.mean() < 0.02
    assert 0.9 < walls.mean() / run.sim.spec.step_time_ns < 1.1
    for phase in ("self_attention", "mlp", "forward", "optimizer"):
        means = list(run.phase_mean(phase).values())
        assert max(means) / min(means) < 1.05, phase
    p50 = run.kernel_p50(K_ALL_GATHER, DP_STREAM)
    assert max(p50.values()) / min(p50.values()) < 1.1


def test_gemm_is_trimodal() -> None:
    ev = healthy().events(0)
    logs = np.sort(np.log(ev["dur"][ev["name"] == K_GEMM]))
    gaps = np.flatnonzero(np.diff(logs) > 0.4)
    assert len(gaps) == 2
    sizes = np.diff(np.concatenate([[0], gaps + 1, [logs.size]]))
    assert sizes.tolist() == [logs.size // 4, logs.size // 4, logs.size // 2]


def test_collectives_end_together() -> None:
    run = healthy()
    topo = run.sim.topology()
    for stream in (DP_STREAM, TP_STREAM):
        ends: dict[tuple[int, int], list[np.ndarray]] = {}
        for r in range(topo.world_size):
            ev = run.events(r)
            m = (ev["stream"] == stream) & (ev["step"] == 5)
            group = topo.dp_group[r] if stream == DP_STREAM else topo.tp_group[r]
            ends.setdefault((group, 0), []).append((ev["start"] + ev["dur"])[m])
        for members in ends.values():
            assert all(np.array_equal(members[0], e) for e in members[1:])


def test_steps_aligned_and_forward_backward_equal() -> None:
    run = healthy()
    per_step: dict[int, set[tuple[int, int]]] = defaultdict(set)
    for s in run.steps:
        per_step[s.step].add((s.start_ns, s.wall_ns))
        assert s.gpu_ns is not None and 0 < s.gpu_ns <= s.wall_ns
    assert all(len(v) == 1 for v in per_step.values())
    fb = run.phase_mean("forward-backward")
    assert len(set(fb.values())) == 1


# -- the paper's cases -------------------------------------------------------------------------------


def test_case1_compute_straggler() -> None:
    run = case(Fault.COMPUTE_STRAGGLER)
    for name, factor in (("self_attention", 25), ("mlp", 20)):
        post = run.phase_mean(name, min_step=15)
        ratio = post[5] / float(np.median(_others(post, {5})))
        assert factor * 0.9 < ratio < factor * 1.1, (name, ratio)
        pre = run.phase_mean(name)
        assert pre[5] < post[5]
    walls = run.walls()
    assert walls[15:].min() > 5 * walls[:15].max()
    assert walls[:15].std() / walls[:15].mean() < 0.02
    ar = run.phase_mean("dp-allreduce", min_step=15)
    assert ar[5] == min(ar.values()) and ar[5] * 10 < min(_others(ar, {5}))


def test_case2_link_degradation() -> None:
    run = case(Fault.LINK_DEGRADATION)
    bad = {4, 5, 6, 7}
    for kernel, factor in ((K_ALL_REDUCE, 8), (K_ALL_GATHER, 12), (K_REDUCE_SCATTER, 20)):
        p50 = run.kernel_p50(kernel, DP_STREAM)
        healthy_max = max(_others(p50, bad))
        assert min(p50[r] for r in bad) > 0.5 * factor * healthy_max, kernel
        assert max(p50[r] for r in bad) / min(p50[r] for r in bad) < 1.05
    for kernel, stream in ((K_GEMM, COMPUTE_STREAM), (K_SEND_RECV, None)):
        p50 = run.kernel_p50(kernel, stream)
        assert max(p50.values()) / min(p50.values()) < 1.1, kernel
    walls = run.walls()
    assert walls.std() / walls.mean() < 0.02


def test_case3_last_stage_backward() -> None:
    run = case(Fault.PP_LAST_STAGE_SLOW)
    bwd = run.phase_mean("backward")
    ratio = bwd[3] / float(np.median([bwd[0], bwd[1], bwd[2]]))
    assert 1.8 < ratio < 2.0
    fwd = run.phase_mean("forward")
    assert max(fwd.values()) / min(fwd.values()) < 1.05
    totals: dict[int, set[int]] = defaultdict(set)
    for pb in run.phases:
        totals[pb.step].add(pb.duration_ns[pb.names.index("forward-backward")])
    assert all(len(v) == 1 for v in totals.values())
    walls = run.walls()
    assert walls.std() / walls.mean() < 0.02
    # upstream stages idle longer: their GPU span holds bigger bubbles than the busy time of stage 3
    gpu = {s.rank: s.gpu_ns for s in run.steps if s.step == 10}
    assert gpu[0] > gpu[3]


def test_case4_host_stall() -> None:
    run = case(Fault.HOST_JIT_STALL)
    walls = run.walls()
    base = float(np.median(walls))
    spikes = np.flatnonzero(walls > base + 40e6).tolist()
    assert spikes == [12, 27]
    assert np.allclose(walls[spikes] - base, 80e6, rtol=0.05)
    gpu = np.array([max(s.gpu_ns or 0 for s in run.steps if s.step == k) for k in range(len(walls))], float)
    assert gpu.std() / gpu.mean() < 0.02


def test_case5_short_collectives() -> None:
    run = case(Fault.COMPUTE_STRAGGLER_SHORT_COLLECTIVES)
    mlp = run.phase_mean("mlp")
    assert mlp[5] > 2.5 * max(_others(mlp, {5}))
    rs = run.kernel_p50(K_REDUCE_SCATTER, DP_STREAM)
    assert rs[5] == min(rs.values()) and rs[5] * 3 < min(_others(rs, {5}))
    phase = run.phase_mean("dp-reduce-scatter")
    assert phase[5] == min(phase.values())


def test_link_fault_must_be_whole_groups() -> None:
    topo = build_topology("j", dp=8)
    with pytest.raises(ValueError):
        FaultSpec.link_degradation(topo)
    assert FaultSpec.link_degradation(build_topology("j", dp=4, pp=2)).ranks == (4, 5, 6, 7)
    with pytest.raises(ValueError):
        FaultSpec.compute_straggler(build_topology("j", dp=4))


# -- batches, records, publication -------------------------------------------------------------------


def test_batches_and_end_of_stream() -> None:
    spec = JobSpec("b", dp=2, steps=4, layers=1, microbatches=1)
    run = _collect(spec, batch_events=10)
    per_rank = len(run.sim.programs[0])
    for r in range(2):
        bs = [b for b in run.batches if b.rank == r]
        assert [b.seq for b in bs] == list(range(len(bs)))
        assert all(len(b) == 10 and not b.end_of_stream for b in bs[:-1])
        assert bs[-1].end_of_stream and len(bs[-1]) == (4 * per_rank) % 10
        assert sum(len(b) for b in bs) == 4 * per_rank
    exact = _collect(spec, batch_events=per_rank)
    last = [b for b in exact.batches if b.rank == 0][-1]
    assert last.end_of_stream and len(last) == 0
    assert exact.sim.end().kernel_events == 2 * 4 * per_rank


def test_records_roundtrip() -> None:
    run = _collect(JobSpec("rt", dp=2, tp=2, steps=2), batch_events=100)
    kb = run.batches[0]
    back = KernelBatch.decode(kb.encode())
    for col in KernelBatch.COLUMNS:
        assert np.array_equal(getattr(back, col), getattr(kb, col))
    assert back.names == kb.names and back.host == kb.host
    eos = run.batches[-1]
    assert KernelBatch.decode(eos.encode()).end_of_stream
    assert Step.decode(run.steps[0].encode()) == run.steps[0]
    assert PhaseBatch.decode(run.phases[-1].encode()) == run.phases[-1]
    assert JobLifecycle.decode(run.sim.end().encode()) == run.sim.end()


def test_run_order_and_counts() -> None:
    spec = JobSpec("pub", dp=2, pp=2, steps=3)
    pub = RecordingPublisher(refuse_every=7)
    progress: list[tuple[int, int]] = []
    stats = JobSimulator(spec, batch_events=500).run(pub, lambda done, total: progress.append((done, total)))
    topics = [c[0] for c in pub.records]
    assert topics[0] is Topic.TOPOLOGY and pub.records[0][1] == job_key("pub")
    assert topics[1] is Topic.LIFECYCLE and pub.records[1][2].event is LifecycleEvent.START
    assert topics[-1] is Topic.LIFECYCLE and pub.records[-1][2].event is LifecycleEvent.END
    # END only once every record before it was delivered (a flush with all of them queued, none after).
    assert len(pub.records) - 1 in pub.flushed_at
    body = pub.records[2:-1]
    eos = [c for c in body if c[0] is Topic.KERNELS and c[2].end_of_stream]
    assert len(eos) == 4 and body[-4:] == eos
    letters = "".join({Topic.STEPS: "S", Topic.PHASES: "P", Topic.KERNELS: "K"}[c[0]] for c in body)
    assert re.fullmatch(r"(S{4}P{4}K*){3}K{4}", letters), letters
    step_of = [c[2].step for c in body if c[0] is not Topic.KERNELS]
    assert step_of == sorted(step_of)
    for topic, key, record in body:
        # Kernels stay ordered per rank; steps and phases of a job meet in one partition for L1/L2.
        assert key == (rank_key("pub", record.rank) if topic is Topic.KERNELS else job_key("pub"))
    assert stats.steps == 3 * 4 and stats.phase_batches == 3 * 4
    assert stats.kernel_batches == topics.count(Topic.KERNELS)
    assert stats.kernel_events == sum(len(c[2]) for c in body if c[0] is Topic.KERNELS)
    assert stats.kernel_events == pub.records[-1][2].kernel_events
    assert stats.messages == len(pub.records) and stats.dropped == len(pub.records) // 7
    assert pub.flushes == 2 and progress == [(1, 3), (2, 3), (3, 3)]  # before END, and at the end
    again = [(t, k) for t, k, _ in simulate(spec, batch_events=500)]
    assert again == [(t, k) for t, k, _ in pub.records]


def test_single_use() -> None:
    sim = JobSimulator(JobSpec("s", dp=1, steps=1))
    with pytest.raises(RuntimeError):
        sim.final_batches()
    list(sim.steps())
    with pytest.raises(RuntimeError):
        list(sim.steps())
    assert len(sim.final_batches()) == 1


def test_invalid_specs() -> None:
    with pytest.raises(ValueError):
        JobSpec("x", dp=1, steps=0)
    with pytest.raises(ValueError):
        JobSimulator(JobSpec("x", dp=1, step_time_ns=10_000))
    with pytest.raises(ValueError):
        JobSimulator(JobSpec("x", dp=1), batch_events=0)


# -- liveness faults: hang, silent rank, crash ---------------------------------------------------------------


def _liveness_records(fault: FaultSpec, steps: int = 8) -> tuple[JobSimulator, list[object]]:
    spec = JobSpec("live", 8, tp=2, pp=2, steps=steps, fault=fault, heartbeat_interval_ns=250_000_000)
    sim = JobSimulator(spec, batch_events=512)
    return sim, [r.record for r in sim.records()]


def test_hang_heartbeats_name_the_collective() -> None:
    topo = build_topology("live", 8, 2, 2)
    sim, recs = _liveness_records(FaultSpec.hang(topo, rank=5, step=4, hang_ns=1_000_000_000))
    hbs = [r for r in recs if isinstance(r, Heartbeat)]
    assert hbs and sim.hang_start_ns is not None
    dp = topo.dp_group[topo.rank.index(5)]
    peers = {r for r, g in zip(topo.rank, topo.dp_group, strict=True) if g == dp and r != 5}
    assert {h.rank for h in hbs} == set(range(32))
    # Peers that reach the collective before the hung rank would have start waiting earlier (on entry).
    assert all(sim.hang_start_ns - 200_000_000 <= h.time_ns < sim.hang_start_ns + 1_000_000_000 for h in hbs)
    hung = [h for h in hbs if h.rank == 5]
    assert len(hung) == 4 and all(h.collective is None and h.step == 4 and h.phase for h in hung)
    last = {h.rank: h for h in hbs}
    for r in peers:
        h = last[r]
        assert h.collective is PhaseKind.ALL_REDUCE and h.group is ParallelGroup.DP and h.group_index == dp
        assert h.step == 4 and h.seq == last[min(peers)].seq >= 0 and h.in_flight_since_ns >= 0
    assert all(last[r].collective is None for r in range(32) if r not in peers)
    # No step 4 before the hang's heartbeats; the job resumes: every step and END follow.
    first_hb = recs.index(hbs[0])
    assert not [r for r in recs[:first_hb] if isinstance(r, Step) and r.step >= 4]
    steps = [r for r in recs if isinstance(r, Step)]
    assert len(steps) == 32 * 8
    assert isinstance(recs[-1], JobLifecycle) and recs[-1].event is LifecycleEvent.END
    hung_step = next(s for s in steps if s.step == 4)
    assert hung_step.wall_ns > 1_000_000_000


def test_hang_without_resume_stops_without_end() -> None:
    topo = build_topology("live", 8, 2, 2)
    sim, recs = _liveness_records(FaultSpec.hang(topo, rank=5, step=4, hang_ns=500_000_000, resume=False))
    assert sim.stopped
    assert max(r.step for r in recs if isinstance(r, Step)) == 3
    assert any(isinstance(r, Heartbeat) for r in recs)
    assert not [r for r in recs if isinstance(r, JobLifecycle) and r.event is LifecycleEvent.END]
    assert not [r for r in recs if isinstance(r, KernelBatch) and r.end_of_stream]


def test_silent_rank_publishes_nothing_after_its_step() -> None:
    topo = build_topology("live", 8, 2, 2)
    _, recs = _liveness_records(FaultSpec.silent_rank(topo, rank=5, step=4, hang_ns=1_000_000_000))
    mine = [r for r in recs if getattr(r, "rank", None) == 5]
    assert mine and all(getattr(r, "step", 0) < 4 for r in mine if not isinstance(r, KernelBatch))
    assert all(int(r.step.max()) < 4 for r in mine if isinstance(r, KernelBatch))
    assert not [r for r in mine if isinstance(r, Heartbeat)]
    steps = [r for r in recs if isinstance(r, Step)]
    assert {s.rank for s in steps if s.step == 4} == set(range(32)) - {5}  # the others complete one step
    assert not [s for s in steps if s.step > 4]
    hbs = [r for r in recs if isinstance(r, Heartbeat)]
    assert hbs and {h.step for h in hbs} == {5} and 5 not in {h.rank for h in hbs}
    assert not [r for r in recs if isinstance(r, JobLifecycle) and r.event is LifecycleEvent.END]


def test_crash_never_sends_end() -> None:
    topo = build_topology("live", 8, 2, 2)
    _, recs = _liveness_records(FaultSpec.crash(topo))
    assert len([r for r in recs if isinstance(r, Step)]) == 32 * 8
    assert not [r for r in recs if isinstance(r, JobLifecycle) and r.event is LifecycleEvent.END]
    _, early = _liveness_records(FaultSpec.crash(topo, step=3))
    assert max(r.step for r in early if isinstance(r, Step)) == 2
    assert not [r for r in early if isinstance(r, Heartbeat)]


def test_hang_needs_dp_peers() -> None:
    with pytest.raises(ValueError):
        FaultSpec.hang(build_topology("solo", 1, 2, 2), rank=1)


# -- checkpoint pause -----------------------------------------------------------------------------------------


def _pause_records(pause_ns: int, steps: int = 8, pause_step: int = 4) -> tuple[JobSimulator, list[object]]:
    spec = JobSpec("ckpt", 8, tp=2, pp=2, steps=steps, heartbeat_interval_ns=250_000_000, pause_step=pause_step,
                   pause_ns=pause_ns)
    sim = JobSimulator(spec, batch_events=512)
    return sim, [r.record for r in sim.records()]


def test_checkpoint_pause_heartbeats_between_steps_then_resumes() -> None:
    sim, recs = _pause_records(1_000_000_000)
    hbs = [r for r in recs if isinstance(r, Heartbeat)]
    at = sim.pause_start_ns
    assert at is not None and sim.hang_start_ns is None and not sim.stopped
    # Every rank heartbeats on entry and every interval: in the last step begun, outside any phase or collective.
    assert len(hbs) == 32 * 4 and {h.rank for h in hbs} == set(range(32))
    assert sorted({h.time_ns for h in hbs}) == [at + k * 250_000_000 for k in range(4)]
    assert all(h.step == 3 and h.phase == "" and h.phase_kind is None and not h.in_flight for h in hbs)
    # Before the heartbeats: every record of steps 0-3 (the partial kernel batches too), nothing of step 4 on.
    first, last = recs.index(hbs[0]), recs.index(hbs[-1])
    before, after = recs[:first], recs[last + 1:]
    assert all(r.step <= 3 for r in before if isinstance(r, (Step, PhaseBatch)))
    assert len([r for r in before if isinstance(r, Step)]) == 32 * 4
    assert all(int(r.step.max()) <= 3 for r in before if isinstance(r, KernelBatch) and len(r))
    assert all(int(r.step.min()) >= 4 for r in after if isinstance(r, KernelBatch) and len(r))
    assert max(r.start_ns + r.wall_ns for r in before if isinstance(r, Step)) <= at
    assert min(r.start_ns for r in after if isinstance(r, Step)) == at + 1_000_000_000
    assert isinstance(recs[-1], JobLifecycle) and recs[-1].event is LifecycleEvent.END


def test_checkpoint_pause_only_shifts_the_steps_after_it() -> None:
    _, paused = _pause_records(1_000_000_000)
    _, plain = _pause_records(0)
    assert not [r for r in plain if isinstance(r, Heartbeat)]
    a = [r for r in paused if isinstance(r, Step)]
    b = [r for r in plain if isinstance(r, Step)]
    shift = [1_000_000_000 if s.step >= 4 else 0 for s in b]
    assert [(s.rank, s.step, s.start_ns, s.wall_ns, s.gpu_ns) for s in a] == \
        [(s.rank, s.step, s.start_ns + d, s.wall_ns, s.gpu_ns) for s, d in zip(b, shift, strict=True)]
    events = [sum(len(r) for r in recs if isinstance(r, KernelBatch)) for recs in (paused, plain)]
    assert events[0] == events[1] == paused[-1].kernel_events  # type: ignore[attr-defined]


@pytest.mark.parametrize("pause_step, pause_ns", [(0, 1), (8, 1), (-1, 1), (4, -1)])
def test_invalid_pauses(pause_step: int, pause_ns: int) -> None:
    with pytest.raises(ValueError):
        JobSpec("x", dp=1, steps=8, pause_step=pause_step, pause_ns=pause_ns)


def test_realtime_run_publishes_at_the_pace_of_event_time() -> None:
    spec = JobSpec("rt", dp=1, steps=3, layers=1, microbatches=1, step_time_ns=50_000_000,
                   heartbeat_interval_ns=50_000_000, pause_step=1, pause_ns=100_000_000)

    class Clocked(RecordingPublisher):
        def __init__(self) -> None:
            super().__init__()
            self.at: list[float] = []

        def publish(self, topic: Topic, key: bytes, record: object) -> bool:
            self.at.append(time.monotonic())
            return super().publish(topic, key, record)

    pub = Clocked()
    JobSimulator(spec).run(pub, realtime=True)
    recs = [r for _, _, r in pub.records]
    steps = [(a, r) for a, r in zip(pub.at, recs, strict=True) if isinstance(r, Step)]
    hbs = [(a, r) for a, r in zip(pub.at, recs, strict=True) if isinstance(r, Heartbeat)]
    assert len(steps) == 3 and len(hbs) == 2
    (a0, s0), *_ = steps
    due = [(a, s.start_ns + s.wall_ns) for a, s in steps] + [(a, h.time_ns) for a, h in hbs]
    for a, t in due:  # never early; late by at most scheduling noise
        assert -0.005 <= (a - a0) - (t - s0.start_ns - s0.wall_ns) / 1e9 <= 0.25, (a - a0, t)


def test_build_spec_takes_a_checkpoint_pause() -> None:
    from argus.core.errors import ArgusError
    from argus.demo import build_spec

    spec = build_spec("j", 2, 2, 1, 20, "none", pause_step=8, pause_s=3.0)
    assert spec.pauses_before(8) and spec.pause_ns == 3_000_000_000
    assert build_spec("j", 2, 2, 1, 20, "none").pause_ns == 0
    with pytest.raises(ArgusError, match="pause"):
        build_spec("j", 2, 2, 1, 20, "none", pause_step=20, pause_s=3.0)
