"""A simulated synchronous training job that emits argus records, with the paper's faults injectable.

:class:`JobSimulator` generates, per step and rank, a :class:`~argus.schemas.records.Step`, a
:class:`~argus.schemas.records.PhaseBatch` and kernel events (accumulated into
:class:`~argus.schemas.records.KernelBatch` es), numpy-vectorized over the ranks. Kernels, streams and phases are
described in :mod:`argus.producers.sim_workload`, timing semantics (collectives end together, pipeline bubbles,
the ``finish_grad_sync`` barrier) in :mod:`argus.producers.sim_timeline`, faults in :mod:`argus.producers.faults`.

Phases of one step of one rank (names repeat: one entry per microbatch, layer or bucket):
see docs/internals/producers.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from argus.producers.faults import Fault, FaultSpec
from argus.producers.sim_timeline import StepTimes, Timeline
from argus.producers.sim_workload import Cat, GradSync, build_programs
from argus.producers.topology import build_topology
from argus.schemas.records import (
    Heartbeat,
    JobLifecycle,
    JobTopology,
    KernelBatch,
    LifecycleEvent,
    ParallelGroup,
    PhaseBatch,
    PhaseKind,
    Step,
)
from argus.topics import PublisherLike, Topic, job_key, publish_in_order, rank_key

__all__ = ["JobSimulator", "JobSpec", "PublisherLike", "SimRecord", "SimStats", "simulate"]

log = logging.getLogger(__name__)

#: 2026-01-01T00:00:00Z, integer nanoseconds since the Unix epoch.
DEFAULT_START_NS = 1_767_225_600_000_000_000
#: Host time from step start to the first kernel (launch latency), integer nanoseconds.
LAUNCH_NS = 30_000
#: Host time between the end of a step's GPU work and the next step (dataloader, bookkeeping), ns.
HOST_GAP_NS = 300_000


@dataclass(frozen=True)
class JobSpec:
    """A simulated job.

    Attributes:
        job_id: training job identifier.
        dp, tp, pp, ep: parallel degrees (Megatron rank order, see :mod:`argus.producers.topology`).
        steps: number of training steps.
        seed: seed of every random draw; the same spec gives the same records.
        start_ns: job start, integer nanoseconds since the Unix epoch.
        step_time_ns: healthy step time the kernel durations are scaled to (approximately), ns.
        layers: transformer layers per pipeline stage (one DP gradient bucket each).
        microbatches: microbatches per step (1F1B schedule; gradient accumulation when pp = 1).
        fault: the injected fault, or ``None`` for a healthy job.
        noise: sigma of the per-kernel lognormal duration jitter (0.04 = about 4 %).
        rank_spread: benign constant per-rank compute speed factor, uniform in ``1 +- rank_spread / 2``
            (0.01: the fastest and slowest ranks differ by up to 1 %).
        grad_sync: DDP AllReduce or distributed-optimizer ReduceScatter/AllGather gradient sync.
        hosts_per_node: ranks per host.
        heartbeat_interval_ns: liveness faults and pauses: event time between two heartbeats of a blocked
            (or pausing) rank, ns.
        pause_step: a checkpoint pause before this step (1 <= pause_step < steps; -1: none): every rank stops
            after step ``pause_step - 1`` for ``pause_ns``, heartbeating outside any phase (see the module
            docstring), then the job resumes.
        pause_ns: length of the pause, ns (0: none).
    """

    job_id: str
    dp: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    steps: int = 40
    seed: int = 0
    start_ns: int = DEFAULT_START_NS
    step_time_ns: int = 200_000_000
    layers: int = 4
    microbatches: int = 4
    fault: FaultSpec | None = None
    noise: float = 0.04
    rank_spread: float = 0.01
    grad_sync: GradSync = GradSync.ALL_REDUCE
    hosts_per_node: int = 8
    heartbeat_interval_ns: int = 2_000_000_000
    pause_step: int = -1
    pause_ns: int = 0

    def __post_init__(self) -> None:
        if self.heartbeat_interval_ns <= 0:
            raise ValueError(f"heartbeat_interval_ns must be > 0, got {self.heartbeat_interval_ns}")
        if self.pause_ns < 0 or (self.pause_ns > 0 and not 1 <= self.pause_step < self.steps):
            raise ValueError(f"a pause needs pause_ns >= 0 and 1 <= pause_step < steps, got pause_ns="
                             f"{self.pause_ns}, pause_step={self.pause_step}, steps={self.steps}")
        if self.steps < 1 or self.step_time_ns <= 0:
            raise ValueError(f"steps and step_time_ns must be > 0, got {self.steps}, {self.step_time_ns}")
        if self.noise < 0 or not 0 <= self.rank_spread < 0.5:
            raise ValueError(f"noise must be >= 0 and rank_spread in [0, 0.5), got {self.noise}, "
                             f"{self.rank_spread}")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def pauses_before(self, step: int) -> bool:
        """Whether the job pauses (a checkpoint) between ``step - 1`` and ``step``."""
        return self.pause_ns > 0 and step == self.pause_step


class SimRecord(NamedTuple):
    """One record to publish, with its topic and Kafka key."""

    topic: Topic
    key: bytes
    record: Any


@dataclass(frozen=True)
class SimStats:
    """What :meth:`JobSimulator.run` published: counts of records (``steps`` = Step records)."""

    kernel_events: int
    kernel_batches: int
    steps: int
    phase_batches: int
    messages: int
    dropped: int


StepRecords = tuple[list[Step], list[PhaseBatch], list[KernelBatch]]
_FB = (PhaseKind.OTHER, "forward-backward", ParallelGroup.NONE, -1)


class JobSimulator:
    """Generates the records of one simulated job (see the module docstring); single use.

    Args:
        spec: the job.
        batch_events: kernel events per :class:`KernelBatch`: a rank's batch is emitted once it has this
            many pending events (every batch but the last of a rank, and its partial one before a pause, holds
            exactly this many).
    """

    def __init__(self, spec: JobSpec, batch_events: int = 4096) -> None:
        if batch_events < 1:
            raise ValueError(f"batch_events must be >= 1, got {batch_events}")
        self.spec = spec
        self.batch_events = batch_events
        self._topology = build_topology(spec.job_id, spec.dp, spec.tp, spec.pp, spec.ep, spec.hosts_per_node)
        if spec.fault is not None:
            spec.fault.check(self._topology)
        self.names, self.programs = build_programs(dp=spec.dp, tp=spec.tp, pp=spec.pp, layers=spec.layers,
                                                   microbatches=spec.microbatches, grad_sync=spec.grad_sync)
        self._timeline = Timeline(self.programs, spec.dp, spec.tp)
        self._rng = np.random.default_rng(spec.seed)
        self._per_stage = spec.dp * spec.tp
        world = spec.world_size
        rank_factor = 1.0 + spec.rank_spread * self._rng.uniform(-0.5, 0.5, world)
        self.scale = self._calibrate()
        self._base: list[npt.NDArray[np.float64]] = []
        self._fault_rows: list[list[tuple[int, npt.NDArray[np.float64]]]] = []
        for s, p in enumerate(self.programs):
            rows = rank_factor[s * self._per_stage:(s + 1) * self._per_stage, None]
            self._base.append(p.base_us * 1e3 * self.scale * np.where(p.compute, rows, 1.0))
            self._fault_rows.append(self._fault_vectors(s))
        self._names_arr = np.array(self.names, dtype=object)
        self._pending: list[list[tuple[npt.NDArray[Any], ...]]] = [[] for _ in range(world)]
        self._pending_n = [0] * world
        self._seq = [0] * world
        self._clock = spec.start_ns
        self._generated = 0
        self._started = False
        self._finished = False
        self._closed = False
        #: Liveness faults: ranks that publish nothing any more, heartbeats of the current step, stop flag.
        self._mute: set[int] = set()
        self._heartbeats: list[Heartbeat] = []
        self._stopped = False
        #: Event time the injected hang (or silence) began, ns; ``None`` before it.
        self.hang_start_ns: int | None = None
        #: Event time the pause (``spec.pause_step``) began, ns; ``None`` before it (it lasts ``spec.pause_ns``).
        self.pause_start_ns: int | None = None

    # -- setup ---------------------------------------------------------------------------------------

    def _calibrate(self) -> float:
        """Scale of the relative durations that gives ``spec.step_time_ns`` (timing is affine in it)."""
        def measure(scale: float) -> int:
            durs = [np.repeat((p.base_us * 1e3 * scale).astype(np.int64)[None, :], self._per_stage, axis=0)
                    for p in self.programs]
            zero = [np.zeros(self._per_stage, dtype=np.int64) for _ in self.programs]
            return self._timeline.run(durs, zero).end_ns + LAUNCH_NS + HOST_GAP_NS

        one, two = measure(1.0), measure(2.0)
        slope, fixed = two - one, 2 * one - two
        if self.spec.step_time_ns <= fixed or slope <= 0:
            raise ValueError(f"step_time_ns={self.spec.step_time_ns} is below the fixed overheads "
                             f"({fixed} ns) of this job")
        return (self.spec.step_time_ns - fixed) / slope

    def _fault_vectors(self, stage: int) -> list[tuple[int, npt.NDArray[np.float64]]]:
        f, p = self.spec.fault, self.programs[stage]
        if f is None:
            return []
        vec = np.ones(len(p))
        vec[(p.cat == Cat.ATTENTION) & p.compute] *= f.attention_factor
        vec[(p.cat == Cat.MLP) & p.compute] *= f.mlp_factor
        vec[p.backward & p.compute] *= f.backward_factor
        vec[p.cat == Cat.ALL_REDUCE] *= f.all_reduce_factor
        vec[p.cat == Cat.ALL_GATHER] *= f.all_gather_factor
        vec[p.cat == Cat.REDUCE_SCATTER] *= f.reduce_scatter_factor
        lo = stage * self._per_stage
        return [(r - lo, vec) for r in f.ranks if lo <= r < lo + self._per_stage]

    # -- records -------------------------------------------------------------------------------------

    def topology(self) -> JobTopology:
        """The job's topology record."""
        return self._topology

    def start(self) -> JobLifecycle:
        """The START lifecycle record (at ``spec.start_ns``)."""
        return JobLifecycle(self.spec.job_id, LifecycleEvent.START, self.spec.start_ns,
                            self.spec.world_size, source="simulator")

    def end(self) -> JobLifecycle:
        """The END lifecycle record: at the end of the last step, with the kernel events generated."""
        records = self.spec.world_size * self.spec.steps  # one Step and one PhaseBatch per rank and step
        return JobLifecycle(self.spec.job_id, LifecycleEvent.END, self._clock, self.spec.world_size,
                            source="simulator", kernel_events=self._generated, steps=records,
                            phase_batches=records)

    def steps(self) -> Iterator[StepRecords]:
        """Per step: the Step and PhaseBatch records of every rank and the KernelBatches that filled up."""
        if self._started:
            raise RuntimeError("JobSimulator.steps() can run only once")
        self._started = True
        f = self.spec.fault
        for step in range(self.spec.steps):
            if f is not None and f.fault is Fault.CRASH and step >= f.onset_step:
                self._stopped = True
            if self._stopped:
                break
            yield self._step(step)
        self._finished = True

    @property
    def stopped(self) -> bool:
        """The job stopped early (crash, a hang that does not resume, a silent rank): no END follows."""
        f = self.spec.fault
        return self._stopped or (f is not None and f.fault in (Fault.CRASH, Fault.SILENT_RANK))

    def final_batches(self) -> list[KernelBatch]:
        """Each rank's last batch (``end_of_stream=True``, possibly empty); after :meth:`steps` is done."""
        if not self._finished or self._closed:
            raise RuntimeError("final_batches() needs steps() to be exhausted, and runs once")
        self._closed = True
        return [self._emit(r, self._pending_n[r], end_of_stream=True) for r in range(self.spec.world_size)]

    def records(self, progress: Callable[[int, int], None] | None = None) -> Iterator[SimRecord]:
        """Every record in publication order: topology, START, per step (steps, phases, kernel batches),
        the end_of_stream batches, END. ``progress(done_steps, total_steps)`` is called after each step."""
        jid = self.spec.job_id
        yield SimRecord(Topic.TOPOLOGY, job_key(jid), self.topology())
        yield SimRecord(Topic.LIFECYCLE, job_key(jid), self.start())
        for i, (steps, phases, batches) in enumerate(self.steps()):
            for hb in self._heartbeats:
                yield SimRecord(Topic.HEARTBEATS, job_key(jid), hb)
            for st in steps:
                yield SimRecord(Topic.STEPS, job_key(jid), st)
            for ph in phases:
                yield SimRecord(Topic.PHASES, job_key(jid), ph)
            for kb in batches:
                yield SimRecord(Topic.KERNELS, rank_key(jid, kb.rank), kb)
            if progress is not None:
                progress(i + 1, self.spec.steps)
        if self.stopped:
            return  # no end_of_stream batches, no END: the job died or hangs
        for kb in self.final_batches():
            yield SimRecord(Topic.KERNELS, rank_key(jid, kb.rank), kb)
        yield SimRecord(Topic.LIFECYCLE, job_key(jid), self.end())

    def run(self, publisher: PublisherLike, progress: Callable[[int, int], None] | None = None,
            flush_timeout_s: float = 30.0, realtime_heartbeats: bool = False, realtime: bool = False) -> SimStats:
        """Publish every record (see :meth:`records`) through ``publisher``, then flush it.

        With ``realtime_heartbeats`` the heartbeats of a hang (or a pause) are published at the wall-clock
        pace of their event time (the publisher is flushed before each wait), so a live worker sees the hang
        as it would happen; every other record is published as fast as it is generated. With ``realtime``
        every record is: a step's records when the step ends (its Step's ``start_ns + wall_ns``), as live
        ranks would publish them, and the heartbeats at their time."""
        counts = {t: 0 for t in Topic}
        events = dropped = 0
        origin: tuple[float, int] | None = None
        log.info("simulating job %s: %d ranks x %d steps", self.spec.job_id, self.spec.world_size,
                 self.spec.steps)
        for rec in self.records(progress):
            counts[rec.topic] += 1
            if rec.topic is Topic.KERNELS:
                events += len(rec.record)
            at = _event_time(rec.record) if realtime or realtime_heartbeats else None
            if at is not None and (realtime or isinstance(rec.record, Heartbeat)):
                if origin is None:
                    publisher.flush(flush_timeout_s)
                    origin = (time.monotonic(), at)
                wait = origin[0] + (at - origin[1]) / 1e9 - time.monotonic()
                if wait > 0:
                    publisher.flush(flush_timeout_s)
                    time.sleep(wait)
            if isinstance(rec.record, JobLifecycle) and rec.record.event is LifecycleEvent.END:
                sent = publish_in_order(publisher, rec.topic, rec.key, rec.record, flush_timeout_s)
            else:
                sent = publisher.publish(rec.topic, rec.key, rec.record)
            if not sent:
                dropped += 1
        left = publisher.flush(flush_timeout_s)
        if left:
            log.warning("job %s: %d messages still unsent after %.1f s flush", self.spec.job_id, left,
                        flush_timeout_s)
        stats = SimStats(kernel_events=events, kernel_batches=counts[Topic.KERNELS],
                         steps=counts[Topic.STEPS], phase_batches=counts[Topic.PHASES],
                         messages=sum(counts.values()), dropped=dropped)
        log.info("job %s published: %s", self.spec.job_id, stats)
        return stats

    # -- one step ------------------------------------------------------------------------------------

    def _step(self, step: int) -> StepRecords:
        spec, rng, fault = self.spec, self._rng, self.spec.fault
        self._heartbeats = []
        if spec.pauses_before(step):
            self._pause(step)
        t0 = self._clock
        durs, gpu_start = [], []
        for s, base in enumerate(self._base):
            d = base * np.exp(spec.noise * rng.standard_normal(base.shape))
            if fault is not None and fault.active(step):
                for row, vec in self._fault_rows[s]:
                    d[row] *= vec
            durs.append(np.maximum(d.astype(np.int64), 1))
            g = np.full(self._per_stage, t0 + LAUNCH_NS, dtype=np.int64)
            if fault is not None and fault.stall_at(step):
                lo = s * self._per_stage
                for r in fault.ranks:
                    if lo <= r < lo + self._per_stage:
                        g[r - lo] += fault.stall_at(step)
            gpu_start.append(g)
        if fault is not None and fault.fault is Fault.SILENT_RANK and step == fault.onset_step:
            self._mute.update(fault.ranks)  # publishes nothing from this step on; the others complete it
            self.hang_start_ns = t0
        blocked = fault is not None and ((fault.fault is Fault.HANG and step == fault.onset_step)
                                         or (fault.fault is Fault.SILENT_RANK and step == fault.onset_step + 1))
        if blocked:
            assert fault is not None
            self._block(step, self._timeline.run([d.copy() for d in durs], [g.copy() for g in gpu_start]))
            if not fault.resume:
                self._stopped = True
                return [], [], []
            r = fault.ranks[0]
            gpu_start[r // self._per_stage][r % self._per_stage] += fault.hang_ns  # late by the hang
        times = self._timeline.run(durs, gpu_start)
        nxt = times.end_ns + int(HOST_GAP_NS * np.exp(spec.noise * rng.standard_normal()))
        self._clock = nxt
        steps: list[Step] = []
        phases: list[PhaseBatch] = []
        batches: list[KernelBatch] = []
        for s, p in enumerate(self.programs):
            start, dur = times.start[s], times.dur[s]
            end = start + dur
            ph, pe = start[:, p.phases.first], end[:, p.phases.last]
            order = np.argsort(start, axis=1, kind="stable")
            s_start = np.take_along_axis(start, order, axis=1)
            s_dur = np.take_along_axis(dur, order, axis=1)
            s_name, s_stream = p.name_idx[order], p.stream[order]
            first, last = start.min(axis=1), end.max(axis=1)
            step_col = np.full(len(p), step, dtype=np.int32)
            kinds, names = (*p.phases.kinds, _FB[0]), (*p.phases.names, _FB[1])
            groups, streams = (*p.phases.groups, _FB[2]), (*p.phases.streams, _FB[3])
            for j in range(self._per_stage):
                rank = s * self._per_stage + j
                if rank in self._mute:
                    continue
                steps.append(Step(spec.job_id, rank, step, t0, nxt - t0, int(last[j] - first[j])))
                g0 = int(gpu_start[s][j])
                phases.append(PhaseBatch(
                    spec.job_id, rank, step, kinds, names, groups, streams,
                    (*ph[j].tolist(), g0), (*(pe[j] - ph[j]).tolist(), times.fb_end_ns - g0)))
                self._pending[rank].append((s_name[j], s_stream[j], s_start[j], s_dur[j], step_col))
                self._pending_n[rank] += len(p)
                self._generated += len(p)
                while self._pending_n[rank] >= self.batch_events:
                    batches.append(self._emit(rank, self.batch_events, end_of_stream=False))
        if spec.pauses_before(step + 1):
            # Idle through the pause: the tracer's kernel thread sends each rank's partial batch.
            batches += [self._emit(r, self._pending_n[r], end_of_stream=False)
                        for r in range(spec.world_size) if self._pending_n[r] and r not in self._mute]
        return steps, phases, batches

    def _pause(self, step: int) -> None:
        """The heartbeats of a checkpoint pause before ``step`` (see the module docstring): every publishing
        rank heartbeats from the pause's start and every ``heartbeat_interval_ns`` for ``pause_ns``, in step
        ``step - 1`` (the last begun) with no phase and no collective; the clock moves past the pause."""
        spec, at = self.spec, self._clock
        self.pause_start_ns = at
        ticks = range(at, at + spec.pause_ns, spec.heartbeat_interval_ns)
        self._heartbeats = [Heartbeat(spec.job_id, r, t, step - 1) for t in ticks for r in range(spec.world_size)
                            if r not in self._mute]
        self._clock = at + spec.pause_ns

    def _block(self, step: int, times: StepTimes) -> None:
        """The heartbeats of a hang in ``step`` (healthy timing ``times``): the fault's rank never enters
        its first DP collective of the step, its DP peers block in it, every other rank waits at the step's
        ``finish_grad_sync`` barrier (``forward-backward``, no collective); one heartbeat per rank on entry
        and every ``heartbeat_interval_ns`` for the fault's ``hang_ns`` (muted ranks publish none)."""
        fault, jid, per = self.spec.fault, self.spec.job_id, self._per_stage
        assert fault is not None
        hung = fault.ranks[0]
        s, j = divmod(hung, per)
        p, ph = self.programs[s], self.programs[s].phases
        start, end = times.start[s], times.start[s] + times.dur[s]
        dp_phases = [k for k in range(len(ph.names)) if ph.groups[k] is ParallelGroup.DP]
        arrive = {k: start[:, int(ph.first[k])] for k in dp_phases}
        k = min(dp_phases, key=lambda q: (int(arrive[q][j]), q))
        seq = step * len(dp_phases) + sorted(dp_phases, key=lambda q: (int(arrive[q][j]), q)).index(k)
        hang_at = int(arrive[k][j])
        if self.hang_start_ns is None:
            self.hang_start_ns = hang_at
        # The innermost compute phase the hung rank is in.
        ps, pe = start[j, p.phases.first], end[j, p.phases.last]
        inside = [q for q in range(len(ph.names)) if ph.groups[q] is ParallelGroup.NONE and ps[q] <= hang_at < pe[q]]
        q_in = min(inside, key=lambda q: (int(pe[q] - ps[q]), q)) if inside else None
        hung_phase = (ph.names[q_in], ph.kinds[q_in]) if q_in is not None else ("backward", PhaseKind.BACKWARD)
        topo = self._topology
        gidx = topo.dp_group[topo.rank.index(hung)]
        peers = {r for r, g in zip(topo.rank, topo.dp_group, strict=True) if g == gidx and r != hung}
        until = hang_at + fault.hang_ns
        ticks = list(range(hang_at, max(until, hang_at + 1), self.spec.heartbeat_interval_ns))
        out: list[Heartbeat] = []
        for r in range(self.spec.world_size):
            if r in self._mute:
                continue
            arr = int(arrive[k][r % per]) if r in peers else hang_at
            for t in sorted({*ticks, arr} if arr < until else set(ticks)):
                if r == hung:
                    out.append(Heartbeat(jid, r, t, step, hung_phase[0], hung_phase[1]))
                elif r in peers and t >= arr:
                    out.append(Heartbeat(jid, r, t, step, ph.names[k], ph.kinds[k], ph.kinds[k],
                                         ParallelGroup.DP, gidx, seq, arr))
                elif r in peers:
                    out.append(Heartbeat(jid, r, t, step, hung_phase[0], hung_phase[1]))
                else:
                    out.append(Heartbeat(jid, r, t, step, _FB[1], _FB[0]))
        out.sort(key=lambda hb: (hb.time_ns, hb.rank))
        self._heartbeats += out  # after a pause's, if the job paused before this step

    def _emit(self, rank: int, n: int, *, end_of_stream: bool) -> KernelBatch:
        chunks = self._pending[rank]
        cols = [np.concatenate([c[i] for c in chunks]) if chunks else np.zeros(0, dtype=np.int64)
                for i in range(5)]
        rest = [c[n:] for c in cols]
        self._pending[rank] = [tuple(rest)] if rest[0].shape[0] else []
        self._pending_n[rank] -= n
        idx = cols[0][:n].astype(np.int64)
        used = np.flatnonzero(np.bincount(idx, minlength=len(self.names)))
        remap = np.zeros(len(self.names), dtype=np.uint32)
        remap[used] = np.arange(used.shape[0], dtype=np.uint32)
        seq = self._seq[rank]
        self._seq[rank] += 1
        return KernelBatch(
            job_id=self.spec.job_id, rank=rank, seq=seq, names=tuple(self._names_arr[used].tolist()),
            name_idx=remap[idx], stream=cols[1][:n].astype(np.uint32), start_ns=cols[2][:n],
            duration_ns=cols[3][:n], step=cols[4][:n].astype(np.int32), host=self._topology.host[rank],
            end_of_stream=end_of_stream)


def _event_time(record: Any) -> int | None:
    """When a record is published live, ns since the epoch: a heartbeat's time, a step's end; ``None`` for the
    rest (phases and kernels follow their step's Step records, topology and lifecycle records need no wait)."""
    if isinstance(record, Heartbeat):
        return record.time_ns
    if isinstance(record, Step):
        return record.start_ns + record.wall_ns
    return None


def simulate(spec: JobSpec, batch_events: int = 4096) -> Iterator[SimRecord]:
    """Every record of the simulated job ``spec`` in publication order (see :meth:`JobSimulator.records`)."""
    return JobSimulator(spec, batch_events).records()
