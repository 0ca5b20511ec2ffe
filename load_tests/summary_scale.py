"""Diagnosis at 10,240-102,400 ranks through the real worker, from generated kernel summaries.

``python load_tests/summary_scale.py [--ranks 10240] [--windows 3] [--steps-per-window 5]`` starts a private
stack (``argus up`` with its own home, ports, topics and groups: :func:`scale_stack.running_stack`; above
65,536 ranks with ``ARGUS_MAX_RANKS_PER_JOB`` raised to the next power of two) and
publishes one job of ``ranks`` (TP 8 x PP 4 x DP ``ranks / 32``) the way the compression stage would have
left it: the topology, START, every rank's Step records, and per 10 s event-time window one
:class:`~argus.schemas.records.KernelSummary` row per rank for each of four (kernel, stream) pairs (two GEMM
shapes, a TP all-reduce, a pipeline send/receive; two clusters a row, realistic counts), split into
``--pieces`` records per (kernel, window) as several compressor partitions would send them; then each
compressor partition's job-end marker and END. One rank's GEMMs run 1.6x slower from the first window
(``SLOW_RANK``), and its TP peers wait for it in the all-reduce.

The compression stage is skipped (:mod:`load_tests.compression_throughput` measures it): this measures what
issue 10 asks of diagnosis at 10k ranks through the worker -- the L1/L2 job agent and the L3 summary agents
reading real Kafka topics, their state, the job context between them, the sink.

Prints one JSON line: ranks, windows, summary rows and records, steps, publish seconds, seconds from END to
the job diagnosed and stored (``end_to_diagnosed_s``), the worker's RSS (start, peak, end, MB) and per rank
(``worker_kb_per_rank``: peak and peak - start over the ranks), the findings (level, kind, ranks),
``named_slow_rank`` and ``slow_rank_named_after_windows`` (event time of the first L3 finding naming it, in
windows after its onset, the job's start: a finding on window 0 is stamped at its end, 1.0), and
``l3_ms_per_kernel_window``: :func:`~argus.detectors.l3_kernels.detect_l3` over one window's rows of each
(kernel, stream) pair, timed in this process after the stack is down (median of ``--l3-repeats``, CPU and wall
ms; the worker runs the same call on the same rows; the budget judges CPU ms, one core's work, as the machine
is shared). Budgets (``budgets`` in the line): the slow rank named at L3 within
``BUDGET_NAMED_WITHIN_WINDOWS`` windows, L3 per (kernel, window) at most ``BUDGET_L3_MS``, END to stored at
most ``BUDGET_END_TO_DIAGNOSED_S`` and the worker's peak at most ``BUDGET_WORKER_PEAK_MB``, both at 10,240
ranks and scaled linearly above (the job agent takes every Step record, and holds them until the
job is diagnosed). Exits 1 when one is missed. ``load_average`` says how busy the machine was.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from confluent_kafka import Producer

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scale_stack import load_average, running_stack

from argus.core.kafka_security import client_config
from argus.detectors.l3_kernels import detect_l3
from argus.producers.publisher import Publisher
from argus.producers.sim_workload import K_ALL_REDUCE, K_GEMM
from argus.producers.topology import build_topology
from argus.schemas.records import JobLifecycle, JobTopology, KernelSummary, LifecycleEvent, Step
from argus.streams.summary_pieces import summary_end_marker
from argus.topics import Topic, job_key, kernel_key

#: Most seconds from the job's END to its diagnosis stored at 10,240 ranks (this 2-core machine; x ranks / 10,240
#: above).
BUDGET_END_TO_DIAGNOSED_S = 300.0
#: Most resident memory of the worker while it holds the job at 10,240 ranks, MB (x ranks / 10,240 above).
BUDGET_WORKER_PEAK_MB = 3000.0
#: The slow rank named at L3 by a finding at most this many windows after its onset (issue 37).
BUDGET_NAMED_WITHIN_WINDOWS = 2.0
#: Most milliseconds of L3 per (kernel, window) (issue 37, at 102,400 ranks).
BUDGET_L3_MS = 1000.0
#: Ranks the worker keeps state for per job unless raised (``ARGUS_MAX_RANKS_PER_JOB``'s default).
DEFAULT_MAX_RANKS = 65_536

TP, PP = 8, 4
WINDOW_NS = 10_000_000_000
START_NS = 1_800_000_000_000_000_000
SEND_RECV = "ncclDevKernel_SendRecv"
#: (kernel, stream, ((p50 us, calls per window), ...)): the job's summarized (kernel, stream) pairs.
KERNELS = ((K_GEMM, 7, ((200.0, 480), (600.0, 320))),
           (K_GEMM + "_splitk", 7, ((90.0, 960),)),
           (K_ALL_REDUCE, 17, ((90.0, 2400), (350.0, 800))),
           (SEND_RECV, 21, ((40.0, 400), (120.0, 400))))
#: Short names of KERNELS' pairs in the JSON line.
LABELS = ("gemm", "gemm_splitk", "all_reduce", "send_recv")
SLOW_FACTOR = 1.6
#: The waiting of the slow rank's TP peers in the all-reduce (x its transfer time).
WAIT_FACTOR = 4.0


def _say(msg: str) -> None:
    sys.stderr.write(f"[summary-scale {time.strftime('%H:%M:%S')}] {msg}\n")
    sys.stderr.flush()


def slow_rank_of(n_ranks: int) -> int:
    """TP index 5 of the 4th DP replica (the last if fewer) of pipeline stage 1."""
    dp = n_ranks // (TP * PP)
    return n_ranks // PP + min(3, dp - 1) * TP + 5


def summaries(job: str, topo: JobTopology, window: int, pieces: int, rng: np.random.Generator) -> list[KernelSummary]:
    """One window's rows of every (kernel, stream) pair, ``pieces`` records per pair (ranks split evenly)."""
    n = topo.world_size
    slow = slow_rank_of(n)
    peers = np.flatnonzero((np.asarray(topo.tp_group) == topo.tp_group[slow]) & (np.arange(n) != slow))
    ws = START_NS + window * WINDOW_NS
    out = []
    for kernel, stream, modes in KERNELS:
        k = len(modes)
        p50 = np.array([m[0] * 1e3 for m in modes])[None, :] * np.exp(rng.normal(0.0, 0.01, (n, 1))
                                                                    + rng.normal(0.0, 0.004, (n, k)))
        if kernel.startswith(K_GEMM):
            p50[slow] *= SLOW_FACTOR
        elif kernel == K_ALL_REDUCE:
            p50[peers] *= WAIT_FACTOR
        p99 = p50 * np.exp(np.abs(rng.normal(0.12, 0.02, (n, k))))
        calls = np.broadcast_to(np.array([m[1] for m in modes], dtype=np.int64), (n, k))
        cols = [np.rint(a).astype(np.int64) for a in (calls, p50, p99, p50 * 0.95, p99 * 1.05, calls * p50 * 1.01)]
        for part in np.array_split(np.arange(n), pieces):
            c, q50, q99, lo, hi, tot = (a[part].ravel().tolist() for a in cols)
            m = part.size
            out.append(KernelSummary(job, kernel, stream, tuple(part.tolist()), (ws,) * m, (ws + WINDOW_NS,) * m,
                                     tuple(calls[part].sum(axis=1).tolist()), (k,) * m, tuple(c), tuple(q50),
                                     tuple(q99), tuple(lo), tuple(hi), tuple(tot)))
    return out


def run(ranks: int, windows: int, steps_per_window: int, pieces: int, sample_s: float,
        l3_repeats: int) -> dict[str, Any]:
    env = {} if ranks <= DEFAULT_MAX_RANKS else {"ARGUS_MAX_RANKS_PER_JOB": str(1 << (ranks - 1).bit_length())}
    job = f"summary-scale-{ranks}"
    topo = build_topology(job, ranks // (TP * PP), TP, PP)
    rng = np.random.default_rng(20261202)
    n_steps = windows * steps_per_window
    step_ns = WINDOW_NS // steps_per_window
    counts = {"summary_records": 0, "summary_rows": 0, "step_records": 0}
    slow = slow_rank_of(ranks)
    first_window: list[KernelSummary] = []  # window 0's records, for timing L3 on them afterwards
    with running_stack("argus-summary-scale-", sample_s, env=env) as (stack, settings, sampler):
        t0 = time.monotonic()
        _say(f"publishing {job}: {ranks} ranks, {windows} windows, {n_steps} steps")
        with Publisher(settings, lossless=True) as pub:
            pub.publish(Topic.TOPOLOGY, job_key(job), topo)
            pub.publish(Topic.LIFECYCLE, job_key(job), JobLifecycle(job, LifecycleEvent.START, START_NS, ranks,
                                                                    source="summary_scale"))
            for w in range(windows):
                for s in range(w * steps_per_window, (w + 1) * steps_per_window):
                    wall = (step_ns * np.exp(rng.normal(0.0, 0.005, ranks))).astype(np.int64)
                    wall[slow] = int(step_ns * 1.05)  # the others wait for it in step time, too (L1 sees it)
                    for r in range(ranks):
                        pub.publish(Topic.STEPS, job_key(job), Step(job, r, s, START_NS + s * step_ns,
                                                                    int(wall[r]), int(wall[r] * 0.97)))
                    counts["step_records"] += ranks
                for rec in summaries(job, topo, w, pieces, rng):
                    pub.publish(Topic.SUMMARIES, kernel_key(job, rec.kernel, rec.stream), rec)
                    counts["summary_records"] += 1
                    counts["summary_rows"] += len(rec.rank)
                    if w == 0:
                        first_window.append(rec)
            pub.flush(300)
            # Each compressor partition's end marker, on every summaries partition (as the compression stage
            # sends them once its kernels of the job are summarized).
            markers = Producer(client_config(settings.kafka))
            for source in range(settings.partitions):
                for q in range(settings.partitions):
                    markers.produce(Topic.SUMMARIES.full(settings), summary_end_marker(job, source).encode(),
                                    job_key(job), partition=q)
            if markers.flush(60):
                raise RuntimeError("the job-end markers were not delivered")
            del markers  # its connections close now, not when the broker is gone
            pub.publish(Topic.LIFECYCLE, job_key(job), JobLifecycle(
                job, LifecycleEvent.END, START_NS + n_steps * step_ns, ranks, source="summary_scale",
                kernel_events=0, steps=ranks * n_steps, phase_batches=0))
            pub.flush(300)
        end_at = time.monotonic()
        published_s = end_at - t0
        _say(f"published in {published_s:.1f} s; waiting for the diagnosis")
        ok, findings = stack.wait_findings(job, 3600)
        diagnosed_at = time.monotonic()
        load = load_average()
    _say("timing L3 on window 0's rows")
    l3_ms = l3_per_kernel_window(first_window, topo, l3_repeats)
    return report(ranks, windows, n_steps, counts, published_s, diagnosed_at - end_at, ok, findings, slow,
                  sampler.summary(), l3_ms, load)


def l3_per_kernel_window(records: list[KernelSummary], topo: JobTopology, repeats: int) -> dict[str, dict[str, float]]:
    """Median milliseconds of :func:`detect_l3` over one window's rows of each (kernel, stream) pair: ``cpu``
    (this process's CPU time: one core's work, what the budget judges; the call is single-threaded) and
    ``wall`` (inflated by whatever else the machine runs)."""
    out = {}
    for label, (kernel, stream, _) in zip(LABELS, KERNELS, strict=True):
        rows = [r for r in records if (r.kernel, r.stream) == (kernel, stream)]
        cpu, wall = [], []
        for _ in range(repeats):
            c, t = time.process_time(), time.perf_counter()
            detect_l3(rows, topo)
            cpu.append((time.process_time() - c) * 1e3)
            wall.append((time.perf_counter() - t) * 1e3)
        out[label] = {"cpu": round(statistics.median(cpu), 1), "wall": round(statistics.median(wall), 1)}
    return out


def report(ranks: int, windows: int, n_steps: int, counts: dict[str, int], published_s: float,
           end_to_diagnosed_s: float, ok: bool, findings: list[dict[str, Any]], slow: int, rss: dict[str, Any],
           l3_ms: dict[str, dict[str, float]], load: list[float]) -> dict[str, Any]:
    """The JSON line (see the module docstring) and ``within_budget``."""
    named_at = [f["time_ns"] for f in findings if f["level"] == "L3" and slow in f["ranks"]]
    after = None if not named_at else round((min(named_at) - START_NS) / WINDOW_NS, 2)
    scale = max(1.0, ranks / 10_240)
    per_rank = None if rss["peak"] is None else {
        "peak": round(rss["peak"] * 1024 / ranks, 1), "peak_minus_start": round((rss["peak"] - rss["start"]) * 1024
                                                                                / ranks, 1)}
    budgets = {"named_within_windows": BUDGET_NAMED_WITHIN_WINDOWS, "l3_ms_per_kernel_window": BUDGET_L3_MS,
               "end_to_diagnosed_s": round(BUDGET_END_TO_DIAGNOSED_S * scale, 1),
               "worker_peak_mb": round(BUDGET_WORKER_PEAK_MB * scale, 1)}
    out: dict[str, Any] = {
        "benchmark": "summary_scale", "ranks": ranks, "topology": f"DP {ranks // 32} x TP {TP} x PP {PP}",
        "windows": windows, "steps": n_steps, "kernel_stream_pairs": len(KERNELS), **counts,
        "publish_s": round(published_s, 1), "diagnosed": ok, "end_to_diagnosed_s": round(end_to_diagnosed_s, 1),
        "worker_rss_mb": rss, "worker_kb_per_rank": per_rank,
        "findings": [(f["level"], f["kind"], f["ranks"]) for f in findings],
        "slow_rank": slow, "named_slow_rank": bool(named_at), "slow_rank_named_after_windows": after,
        "l3_ms_per_kernel_window": l3_ms, "budgets": budgets, "load_average": load,
    }
    out["within_budget"] = bool(
        ok and after is not None and after <= BUDGET_NAMED_WITHIN_WINDOWS
        and max(m["cpu"] for m in l3_ms.values()) <= BUDGET_L3_MS
        and end_to_diagnosed_s <= budgets["end_to_diagnosed_s"]
        and rss["peak"] is not None and rss["peak"] <= budgets["worker_peak_mb"])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=10240, help="a multiple of 32")
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--steps-per-window", type=int, default=5)
    ap.add_argument("--pieces", type=int, default=16, help="summary records per (kernel, stream, window)")
    ap.add_argument("--sample-s", type=float, default=2.0)
    ap.add_argument("--l3-repeats", type=int, default=3, help="timed detect_l3 runs per (kernel, window)")
    args = ap.parse_args(argv)
    if args.ranks % (TP * PP) or args.ranks < 2 * TP * PP:
        ap.error("--ranks must be a multiple of 32 and >= 64")
    out = run(args.ranks, args.windows, args.steps_per_window, args.pieces, args.sample_s, args.l3_repeats)
    sys.stdout.write(json.dumps(out) + "\n")
    return 0 if out["within_budget"] else 1


if __name__ == "__main__":
    sys.exit(main())
