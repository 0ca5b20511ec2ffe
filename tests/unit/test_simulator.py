"""The job simulator: timing semantics, the paper's five faults, batching and publication order."""

from __future__ import annotations

import functools
import re
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import pytest

from argus.topics import Topic, job_key, rank_key
from producers.faults import Fault, FaultSpec
from producers.sim_workload import (
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
from producers.simulator import JobSimulator, JobSpec, paper_case, simulate
from producers.topology import build_topology
from schemas.records import JobLifecycle, KernelBatch, LifecycleEvent, PhaseBatch, PhaseKind, Step
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
    assert pub.flushes == 1 and progress == [(1, 3), (2, 3), (3, 3)]
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
