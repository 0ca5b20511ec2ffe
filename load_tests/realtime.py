"""A large job followed live: 10,240 ranks at 0.5 s steps through the real stack, at the job's own pace.

``python load_tests/realtime.py [--ranks 10240] [--step-s 0.5] [--duration-s 300] [--kernel-sample 64]
[--onset-frac 0.5]`` starts a private stack (:func:`scale_stack.running_stack`: broker, worker, sink) and
publishes one job of ``ranks`` (TP 8 x PP 4 x DP ``ranks / 32``) for ``--duration-s`` seconds, one step every
``--step-s``, as its ranks would: every rank's Step and PhaseBatch each step (the simulator's phases of one
step per (TP index, stage), durations jittered 2 %), every rank's heartbeat every 2 s (spread over the steps),
and kernel batches at the simulator's full rate from ``--kernel-sample`` ranks (whole DP replicas: every stage
and TP index, so L3 has peers). Rank ``SLOW_TP_INDEX`` of DP replica 0, stage 0 (in the kernel sample)
becomes a compute straggler at ``--onset-frac`` of the run (its compute phases and kernels x``SLOW_FACTOR``).
Event times are the wall clock's: the job runs now.

Everything is generated before the clock starts (the messages as pre-encoded pieces joined per step,
:mod:`wire_templates`: checked byte for byte against the records' own encoding; the kernel batches of
``CYCLE_STEPS`` steps, healthy and slow, re-stamped per cycle), so the publisher only joins bytes and hands
them to librdkafka; ``publisher_behind_s`` says how far it fell behind the job's pace anyway.

Measured, printed as one JSON line:

* ``lag_steps``: steps published minus the newest step the worker's job agent has taken (its ``/stats``,
  which the worker refreshes on its idle-jobs timer, every quarter of ``ARGUS_JOB_IDLE_TIMEOUT_S`` clamped to
  10 s: each refresh is sampled within ``POLL_S``; while the value does not change for two refreshes the
  worker is taken as stalled and every poll is a sample). Judged after ``WARMUP_S`` (max <
  ``BUDGET_LAG_STEPS``). The worker runs with its default settings: a shorter idle timeout (a denser
  refresh) makes a lagging worker abandon the job (its compressor saw no kernel batch for twice the timeout
  in a run with 8 s).
* ``straggler``: seconds and windows from the onset step's publication to the first finding naming the slow
  rank read from the findings topic (budget ``BUDGET_NAMED_WINDOWS`` windows of ``ARGUS_WINDOW_NS``).
* ``worker_rss_mb``: sampled every ``--sample-s``; flat when the mean of the run's last quarter is within
  ``BUDGET_RSS_GROWTH`` of its second quarter's.
* ``load_average`` at the start and the end (the machine is shared: a missed budget may be the load's).

``within_budget`` is all three. Exits 1 when a budget is missed. The job gets no END: the stack is taken down
after the run and what the worker still holds is dropped with it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from confluent_kafka import Consumer, Producer
from scale_diagnosis import _COMPUTE_KINDS, phase_templates
from scale_stack import load_average, running_stack
from wire_templates import WireTemplate, avro_long, avro_longs

from argus.core.kafka_security import client_config, producer_config
from argus.core.settings import Settings
from argus.producers.faults import Fault, FaultSpec
from argus.producers.simulator import JobSimulator, JobSpec
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
from argus.topics import PARTITIONER, Topic, job_key, rank_key

#: The worker's lag behind the job, steps (issue 37: "stays under 2 steps").
BUDGET_LAG_STEPS = 2.0
#: The straggler named within this many windows of its onset (issue 37).
BUDGET_NAMED_WINDOWS = 2.0
#: The worker's memory is flat: the last quarter's mean RSS at most this fraction above the second quarter's.
BUDGET_RSS_GROWTH = 0.10
#: Lag samples of the first seconds (the worker's first assignment and fetches) are reported, not judged.
WARMUP_S = 15.0
POLL_S = 0.25
TP, PP = 8, 4
SLOW_TP_INDEX = 5
SLOW_FACTOR = 1.5
#: Steps of kernel batches simulated ahead (healthy and slow); the run repeats them, re-stamped.
CYCLE_STEPS = 8
#: Pre-encoded duration rows per rank (cycled over the steps: the jitter repeats every VARIANTS steps).
VARIANTS = 4
HEARTBEAT_S = 2.0
#: Events per simulated kernel batch: about a step's worth of one rank, so each step sends its sample's kernels.
KERNEL_BATCH_EVENTS = 512
SEED = 37


def _say(msg: str) -> None:
    sys.stderr.write(f"[realtime {time.strftime('%H:%M:%S')}] {msg}\n")
    sys.stderr.flush()


@dataclass
class Plan:
    """The run, generated ahead: per-rank message templates and encoded pieces, the kernel cycles."""

    job: str
    topo: JobTopology
    start_ns: int
    step_ns: int
    steps: int
    onset_step: int
    slow_rank: int
    sample: list[int]  # the ranks that send kernel batches
    tpl_of_rank: list[int]
    offsets: list[np.ndarray]  # per phase template, the phases' offsets from the step start, ns
    phase_wire: list[WireTemplate]  # per rank, its PhaseBatch with rank bound
    durations: list[list[bytes]]  # per rank, VARIANTS encoded duration rows
    slow_durations: list[bytes]  # the straggler's, after its onset
    step_wire: list[WireTemplate]  # per rank, its Step with rank bound
    step_times: list[list[tuple[bytes, bytes]]]  # per rank, VARIANTS encoded (wall_ns, gpu_ns)
    heartbeat_wire: list[WireTemplate]
    kernels: tuple[list[list[KernelBatch]], list[list[KernelBatch]]]  # healthy, slow: per cycle step


def plan(ranks: int, step_s: float, duration_s: float, kernel_sample: int, onset_frac: float,
         batch_events: int) -> Plan:
    """Generate everything ahead (see the module docstring)."""
    dp = ranks // (TP * PP)
    job = f"realtime-{ranks}-{uuid.uuid4().hex[:6]}"
    topo = build_topology(job, dp, TP, PP)
    step_ns = int(step_s * 1e9)
    steps = max(int(duration_s / step_s), 2)
    start_ns = time.time_ns() + 60_000_000_000  # re-based when the clock starts (see run)
    slow = SLOW_TP_INDEX  # TP index 5 of DP replica 0 in stage 0 (Megatron order)
    rng = np.random.default_rng(SEED)
    templates, wall_ns = phase_templates(SEED)
    scale = step_ns / wall_ns
    offsets = [np.rint(t.offset_ns * scale).astype(np.int64) for t in templates]
    tpl_of = (np.asarray(topo.rank) % TP + TP * np.asarray(topo.pp_stage)).tolist()
    phase_base = [WireTemplate(PhaseBatch(job, 0, 0, t.kinds, t.names, t.groups, t.streams,
                                          tuple(range(len(t.kinds))), tuple(range(len(t.kinds)))),
                               ("rank", "step", "start_ns", "duration_ns")) for t in templates]
    step_base = WireTemplate(Step(job, 0, 0, start_ns, step_ns, step_ns), ("rank", "step", "start_ns", "wall_ns",
                                                                          "gpu_ns"))
    hb_base = WireTemplate(Heartbeat(job, 0, start_ns, 0, "forward", PhaseKind.FORWARD, None, ParallelGroup.NONE, 0,
                                     0), ("rank", "time_ns", "step", "seq"))
    phase_wire, durations, step_wire, step_times, hb_wire = [], [], [], [], []
    for r in range(ranks):
        t = templates[tpl_of[r]]
        rank = {"rank": avro_long(r)}
        phase_wire.append(phase_base[tpl_of[r]].bind(**rank))
        jitter = np.exp(rng.normal(0.0, 0.02, (VARIANTS, t.duration_ns.size)))
        rows = np.maximum(np.rint(t.duration_ns * scale * jitter), 1).astype(np.int64)
        durations.append([avro_longs(row.tolist()) for row in rows])
        wall = (step_ns * np.exp(rng.normal(0.0, 0.003, VARIANTS))).astype(np.int64)
        step_wire.append(step_base.bind(**rank))
        step_times.append([(avro_long(int(w)), avro_long(int(w * 0.97))) for w in wall])
        hb_wire.append(hb_base.bind(**rank))
    t = templates[tpl_of[slow]]
    slowed = t.duration_ns * scale * np.where(np.array([k in _COMPUTE_KINDS for k in t.kinds]), SLOW_FACTOR, 1.0)
    slow_durations = [avro_longs(np.maximum(np.rint(slowed * j), 1).astype(np.int64).tolist())
                      for j in np.exp(rng.normal(0.0, 0.02, (VARIANTS, t.duration_ns.size)))]
    sample = [r for r in range(ranks) if (r // TP) % dp < kernel_sample // (TP * PP)]
    out = Plan(job, topo, start_ns, step_ns, steps, int(steps * onset_frac), slow, sample, tpl_of, offsets,
               phase_wire, durations, slow_durations, step_wire, step_times, hb_wire,
               (kernel_cycle(job, kernel_sample, step_ns, batch_events, None),
                kernel_cycle(job, kernel_sample, step_ns, batch_events, slow)))
    check(out)
    return out


def kernel_cycle(job: str, kernel_sample: int, step_ns: int, batch_events: int,
                 slow: int | None) -> list[list[KernelBatch]]:
    """The kernel batches of ``kernel_sample`` ranks (DP replicas of the big job; simulated as a job of their
    own, ranks mapped back) over ``CYCLE_STEPS`` steps, per step; ``slow`` a compute straggler from step 0."""
    if kernel_sample == 0:
        return [[] for _ in range(CYCLE_STEPS)]
    dp = kernel_sample // (TP * PP)
    fault = None if slow is None else FaultSpec(Fault.COMPUTE_STRAGGLER, ranks=(_sim_rank(slow, dp),),
                                                attention_factor=SLOW_FACTOR, mlp_factor=SLOW_FACTOR)
    sim = JobSimulator(JobSpec(job, dp=dp, tp=TP, pp=PP, steps=CYCLE_STEPS, seed=SEED, start_ns=0,
                               step_time_ns=step_ns, fault=fault), batch_events=batch_events)
    return [list(kernels) for _, _, kernels in sim.steps()]


def _sim_rank(big_rank: int, dp: int) -> int:
    """The rank in the kernel sample's own job (DP ``dp``) of a rank of the sampled replicas (TP index 0-7,
    DP replica < dp, stage): both in Megatron order, rank = tp + TP * (dp_index + DP * stage)."""
    return big_rank % TP + TP * (big_rank // TP % dp)  # stage 0 only (the straggler's)


def check(p: Plan, s: int = 3) -> None:
    """Raise ``AssertionError`` unless step ``s``'s joined messages decode to the intended records and equal
    their own encoding (the first, the last and the slow rank's Step and PhaseBatch, heartbeats, kernels)."""
    msgs = step_messages(p, s, {})
    n, start = len(p.phase_wire), p.start_ns + s * p.step_ns
    for r in (0, n - 1, p.slow_rank):
        phase, step = PhaseBatch.decode(msgs[r][2]), Step.decode(msgs[n + r][2])
        assert phase.encode() == msgs[r][2] and step.encode() == msgs[n + r][2], r
        assert (phase.rank, phase.step, step.rank, step.step, step.start_ns) == (r, s, r, s, start), (phase, step)
        assert phase.start_ns == tuple((p.offsets[p.tpl_of_rank[r]] + start).tolist())
    for topic, _, value in msgs[2 * n:]:
        rec = (Heartbeat if topic is Topic.HEARTBEATS else KernelBatch).decode(value)
        assert rec.encode() == value and rec.job_id == p.job, rec


def step_messages(p: Plan, s: int, seqs: dict[int, int]) -> list[tuple[Topic, bytes, bytes]]:
    """Step ``s``'s messages of every rank: (topic, key, value). ``seqs``: each kernel rank's next batch seq."""
    start = p.start_ns + s * p.step_ns
    key = job_key(p.job)
    step_b, start_b = avro_long(s), avro_long(start)
    starts = [avro_longs((o + start).tolist()) for o in p.offsets]
    v = s % VARIANTS
    out: list[tuple[Topic, bytes, bytes]] = []
    for r, wire in enumerate(p.phase_wire):
        dur = p.slow_durations[v] if r == p.slow_rank and s >= p.onset_step else p.durations[r][v]
        out.append((Topic.PHASES, key, wire.join(step=step_b, start_ns=starts[p.tpl_of_rank[r]], duration_ns=dur)))
    for r, wire in enumerate(p.step_wire):
        wall, gpu = p.step_times[r][v]
        out.append((Topic.STEPS, key, wire.join(step=step_b, start_ns=start_b, wall_ns=wall, gpu_ns=gpu)))
    every = max(1, round(HEARTBEAT_S * 1e9 / p.step_ns))
    for r in range(s % every, len(p.heartbeat_wire), every):
        at = start + (r * 7919) % p.step_ns
        out.append((Topic.HEARTBEATS, key, p.heartbeat_wire[r].join(
            time_ns=avro_long(at), step=step_b, seq=avro_long(s // every))))
    shift = s // CYCLE_STEPS * CYCLE_STEPS
    sim_dp = max(1, len(p.sample) // (TP * PP))
    for kb in kernel_batches(p, s):
        rank = _big_rank(kb.rank, sim_dp, p.topo.dp_size)
        seq = seqs.get(rank, 0)
        seqs[rank] = seq + 1
        kb2 = dataclasses.replace(kb, rank=rank, seq=seq, start_ns=kb.start_ns + p.start_ns + shift * p.step_ns,
                                  step=kb.step + shift)
        out.append((Topic.KERNELS, rank_key(p.job, rank), kb2.encode()))
    return out


def kernel_batches(p: Plan, s: int) -> list[KernelBatch]:
    """The kernel sample's batches of step ``s`` (as simulated: ranks, seqs and times of the cycle)."""
    return p.kernels[1 if s >= p.onset_step else 0][s % CYCLE_STEPS]


def _big_rank(sim_rank: int, sim_dp: int, dp: int) -> int:
    tp, dp_i, stage = sim_rank % TP, sim_rank // TP % sim_dp, sim_rank // (TP * sim_dp)
    return tp + TP * (dp_i + dp * stage)


class Watch:
    """The worker's newest step taken (``/stats``, polled) and the findings naming the slow rank (read from
    the findings topic), in threads while the run publishes."""

    def __init__(self, settings: Settings, port: str, p: Plan) -> None:
        self.settings, self.port, self.p = settings, port, p
        self.published = -1  # the newest step handed to the producer
        self.published_at: dict[int, float] = {}
        self.lag: list[tuple[float, float]] = []  # (seconds since the clock started, lag in steps)
        self.named: list[tuple[float, dict[str, Any]]] = []
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=f, daemon=True) for f in (self._poll, self._findings)]

    def start(self) -> None:
        self.t0 = time.monotonic()
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(10)

    def _last_step(self) -> int | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/stats", timeout=2) as r:
                doc = json.loads(r.read())
        except (OSError, ValueError):
            return None
        for j in (doc.get("diagnosis") or {}).get("jobs", []):
            if j.get("job") == self.p.job:
                return int(j.get("last_step", -1))
        return None

    def _poll(self) -> None:
        last, changed_at = None, time.monotonic()
        stalled_after = 2 * min(max(self.settings.worker.job_idle_timeout_s / 4, 0.05), 10.0) + POLL_S
        while not self._stop.wait(POLL_S):
            got, now = self._last_step(), time.monotonic()
            if got is None or self.published < 0:
                continue
            if got != last or now - changed_at > stalled_after:
                if got != last:
                    last, changed_at = got, now
                self.lag.append((now - self.t0, float(self.published - got)))

    def _findings(self) -> None:
        consumer = Consumer(client_config(self.settings.kafka, {
            "group.id": f"{self.settings.app_id}-realtime-{uuid.uuid4().hex[:6]}", "auto.offset.reset": "earliest",
            "enable.auto.commit": False}))
        consumer.subscribe([Topic.FINDINGS_JSON.full(self.settings)])
        try:
            while not self._stop.is_set():
                for msg in consumer.consume(100, 0.5):
                    if msg.error() is not None:
                        continue
                    f = json.loads(msg.value())
                    if f.get("job") == self.p.job and self.p.slow_rank in f.get("ranks", ()):
                        self.named.append((time.monotonic(), f))
        finally:
            consumer.close()


def publish(p: Plan, settings: Settings, watch: Watch, step_s: float) -> dict[str, Any]:
    """Publish the run at the job's pace; what was sent and how far the publisher fell behind."""
    producer = Producer(producer_config(settings.kafka, {
        "compression.type": settings.compression, "linger.ms": 5, "batch.size": 1_000_000,
        "queue.buffering.max.messages": 2_000_000, "queue.buffering.max.kbytes": 1 << 21,
        "message.timeout.ms": 300_000, "partitioner": PARTITIONER}))
    names = {t: t.full(settings) for t in Topic}
    counts: dict[str, int] = {}
    kernel_events, behind, seqs = 0, 0.0, {}
    producer.produce(names[Topic.TOPOLOGY], p.topo.encode(), job_key(p.job))
    producer.produce(names[Topic.LIFECYCLE], JobLifecycle(p.job, LifecycleEvent.START, p.start_ns,
                                                          p.topo.world_size, source="realtime").encode(),
                     job_key(p.job))
    producer.flush(60)
    t0 = time.monotonic()
    watch.start()
    for s in range(p.steps):
        due = t0 + s * step_s
        wait = due - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        behind = max(behind, -wait)
        for topic, key, value in step_messages(p, s, seqs):
            while True:
                try:
                    producer.produce(names[topic], value, key)
                    break
                except BufferError:  # librdkafka's queue is full: let it send
                    producer.poll(0.05)
            counts[topic.value] = counts.get(topic.value, 0) + 1
        producer.poll(0)
        kernel_events += sum(len(kb) for kb in kernel_batches(p, s))
        watch.published = s
        watch.published_at[s] = time.monotonic()
    left = producer.flush(120)
    if left:
        raise RuntimeError(f"{left} messages not delivered")
    return {"messages": counts, "kernel_events": kernel_events, "publisher_behind_s": round(behind, 2),
            "published_s": round(time.monotonic() - t0, 1)}


def run(ranks: int, step_s: float, duration_s: float, kernel_sample: int, onset_frac: float,
        sample_s: float) -> dict[str, Any]:
    load_start = load_average()
    with running_stack("argus-realtime-", sample_s) as (stack, settings, sampler):
        _say(f"generating {ranks} ranks x {duration_s:.0f} s at {step_s} s steps")
        g0 = time.monotonic()
        p = plan(ranks, step_s, duration_s, kernel_sample, onset_frac, KERNEL_BATCH_EVENTS)
        # The job runs from now: event times are the wall clock's.
        p.start_ns = time.time_ns()
        generate_s = time.monotonic() - g0
        watch = Watch(settings, stack.env["ARGUS_WORKER_WEB_PORT"], p)
        _say(f"generated in {generate_s:.1f} s; publishing {p.steps} steps, straggler rank {p.slow_rank} from "
             f"step {p.onset_step}")
        rss_from = len(sampler.samples)
        sent = publish(p, settings, watch, step_s)
        window_s = settings.window_ns / 1e9
        # Findings for the last windows come after them: wait up to the budget past the onset, then stop.
        onset_at = watch.published_at[p.onset_step]
        while not watch.named and time.monotonic() < onset_at + BUDGET_NAMED_WINDOWS * window_s + 5:
            time.sleep(0.5)
        watch.stop()
        rss = [m for t, m in sampler.samples[rss_from:]]
        load_end = load_average()
    return report(p, step_s, duration_s, kernel_sample, generate_s, sent, watch, onset_at, window_s, rss,
                  load_start, load_end)


def report(p: Plan, step_s: float, duration_s: float, kernel_sample: int, generate_s: float, sent: dict[str, Any],
           watch: Watch, onset_at: float, window_s: float, rss: list[float], load_start: list[float],
           load_end: list[float]) -> dict[str, Any]:
    judged = [lag for t, lag in watch.lag if t >= WARMUP_S]
    lags = [lag for _, lag in watch.lag]
    first = min((t for t, _ in watch.named), default=None)
    named_s = None if first is None else round(first - onset_at, 1)
    q = len(rss) // 4
    q2 = statistics.fmean(rss[q:2 * q]) if q else None
    q4 = statistics.fmean(rss[3 * q:]) if q else None
    growth = None if not q2 or q4 is None else round(q4 / q2 - 1, 3)
    out: dict[str, Any] = {
        "benchmark": "realtime", "ranks": p.topo.world_size, "topology": f"DP {p.topo.dp_size} x TP {TP} x PP {PP}",
        "step_s": step_s, "duration_s": duration_s, "steps": p.steps, "kernel_sample_ranks": kernel_sample,
        "generate_s": round(generate_s, 1), **sent,
        "lag_steps": {"samples": len(lags), "judged": len(judged), "max": max(judged, default=None),
                      "p50": statistics.median(judged) if judged else None,
                      "p95": float(np.percentile(judged, 95)) if judged else None,
                      "last": lags[-1] if lags else None, "max_all": max(lags, default=None)},
        "straggler": {"rank": p.slow_rank, "onset_step": p.onset_step, "named_after_s": named_s,
                      "named_after_windows": None if named_s is None else round(named_s / window_s, 2),
                      "findings": sorted({(f["level"], f["kind"]) for _, f in watch.named})},
        "worker_rss_mb": {"start": round(rss[0], 1) if rss else None, "peak": round(max(rss), 1) if rss else None,
                          "end": round(rss[-1], 1) if rss else None, "q2_mean": None if q2 is None else round(q2, 1),
                          "q4_mean": None if q4 is None else round(q4, 1), "growth_q2_to_q4": growth,
                          "samples": len(rss)},
        "budgets": {"lag_steps_below": BUDGET_LAG_STEPS, "named_within_windows": BUDGET_NAMED_WINDOWS,
                    "rss_growth_q2_to_q4": BUDGET_RSS_GROWTH, "warmup_s": WARMUP_S},
        "load_average": {"start": load_start, "end": load_end},
    }
    out["within_budget"] = bool(judged and max(judged) < BUDGET_LAG_STEPS and named_s is not None
                                and named_s <= BUDGET_NAMED_WINDOWS * window_s
                                and growth is not None and growth <= BUDGET_RSS_GROWTH)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=10240, help="a multiple of 32")
    ap.add_argument("--step-s", type=float, default=0.5)
    ap.add_argument("--duration-s", type=float, default=300.0)
    ap.add_argument("--kernel-sample", type=int, default=64, help="ranks sending kernel batches, a multiple of 32")
    ap.add_argument("--onset-frac", type=float, default=0.5, help="the straggler's onset, fraction of the run")
    ap.add_argument("--sample-s", type=float, default=1.0, help="seconds between RSS samples")
    args = ap.parse_args(argv)
    if args.ranks % (TP * PP) or args.ranks < TP * PP:
        ap.error("--ranks must be a multiple of 32")
    if args.kernel_sample % (TP * PP) or not 0 < args.kernel_sample <= args.ranks:
        ap.error("--kernel-sample must be a multiple of 32, at most --ranks, and > 0 (the straggler is in it)")
    if not 0 < args.onset_frac < 1:
        ap.error("--onset-frac must be in (0, 1)")
    out = run(args.ranks, args.step_s, args.duration_s, args.kernel_sample, args.onset_frac, args.sample_s)
    sys.stdout.write(json.dumps(out) + "\n")
    return 0 if out["within_budget"] else 1


if __name__ == "__main__":
    sys.exit(main())
