"""Benchmark: cost of the pure diagnosis core (L1, L2, L3) per window / per step at 1,024 to 10,240 ranks.

No Kafka, no worker: the detectors are called in-process on inputs shaped as the stream agents feed them
(:mod:`argus.streams.diagnosis`), for a job of TP 8 x PP 4 x DP ``ranks / 32`` (:func:`argus.producers.topology.
build_topology`) with one slow rank (the report says what each detector found, so the inputs are seen to
be judged, not skipped). Inputs are generated with numpy (fixed seeds) before any timing. Every timing is
``time.perf_counter`` wall time, after ``gc.collect()``, repeated; the median is reported (``*_ms`` in
milliseconds, ``*_bytes`` in bytes, ``*_mib`` in MiB).

What is timed, per rank count:

* **L3** (budget: ``BUDGET_L3_MS`` per (kernel, window)). One event-time window of one (job, kernel, stream)
  as :class:`~argus.streams.diagnosis.KernelDiagnosis` passes it to
  :func:`~argus.detectors.l3_kernels.detect_l3`: a list of one-row
  :class:`~argus.schemas.records.KernelSummary` (one per rank, ordered by rank), each row with two clusters
  (a bimodal kernel, realistic counts for a 10 s window), the topology, default ``L3Params`` and
  ``group_kind=None`` (the stream's group not known: every group kind is tried, the worst case). Two kernels:
  a compute GEMM (stream 7; the slow rank's second mode 1.3x slower) and a TP all-reduce
  ``ncclDevKernel_AllReduce_Sum_bf16_RING_LL`` (stream 17; the slow rank arrives last in its TP group: its
  collective is the bare transfer, 1.3x shorter than a healthy member's, and its TP peers wait, 6x longer).
  ``ms_per_window`` = one ``detect_l3`` call. One untimed warm-up call first. Also reported, not budgeted:

  - ``ingest_ms_per_window``: the worker's per-row bookkeeping (``argus.streams.summary_pieces.
    BoundedKernelDiagnosis.add``) of the window's rank rows, one run;
  - ``detect_peak_mib``: the tracemalloc peak (numpy temporaries included) of one ``detect_l3`` call;
  - ``state_bytes_per_rank_window_row``: tracemalloc bytes a ``KernelDiagnosis`` retains per (rank, window)
    row of its (job, kernel, stream) after taking decoded copies (as read from Kafka) of up to 1,024 rows;
    ``worker_state_bytes_per_rank_window_row`` the same for the worker's ``BoundedKernelDiagnosis``, and
    ``worker_state_mib_per_window`` that x ranks (the worker keeps up to ``l3_max_windows``, 64, windows).

* **L2** (budget: ``BUDGET_L2_MS`` per step). ``N = --l2-steps`` complete steps of every rank's
  :class:`~argus.schemas.records.PhaseBatch` (the simulator's per-stage phase layout, ~150 phases per batch,
  durations jittered per rank; the slow rank's compute phases 1.6x longer), each decoded from its own Avro bytes
  (untimed) as the worker holds them. Timed as :class:`~argus.detectors.l2_history.PhaseHistory` does it
  live: each step folded once into a fresh history (``fold_ms_per_step``), then one ``detect`` over the N
  steps (``detect_ms_per_run``); ``ms_per_step`` = (fold + detect) / N, the cost per step judged once.
  ``live_ms_per_step_est`` = fold per step + detect / ``detect_every`` (the live figure is measured below);
  ``table_ms_per_step``: ``PhaseTable.from_batches`` over the same batches (the one-shot table, for
  comparison; ``same_as_table``: the history finds what ``detect_l2`` finds on that table).
  ``state_bytes_per_rank_step`` is the tracemalloc size of one decoded PhaseBatch, ``history_state_gib_est``
  the folded bytes per rank and step x ranks x 200. ``in_memory``: the same timings over the generated records
  themselves (tuples shared per layout and, per (TP index, stage) and step, starts: as the simulator's, folded
  from their tuples by ``struct``), not budgeted (a worker folds decoded records only).

* **L2 live** (``l2.live``, budget: ``BUDGET_L2_MS`` per step; ``--live-steps``, 0: none).
  :class:`~argus.streams.diagnosis.JobDiagnosis` driven through ``history_steps`` (200) untimed steps to its
  steady state (a full history; its last ``detect_every`` steps fed decoded records, as the timed ones, so that
  what a process does once for them is done), then ``--live-steps`` steps each timed: ``add`` of every rank's Step
  and PhaseBatch of the step (folding the step into the history as it completes) plus ``diagnose()`` when due
  (every ``detect_every``, 5, steps). Records are generated per step, untimed. The timed steps take the records as
  the worker gets them: each decoded from its own Avro bytes (``PhaseBatch.decode(b.encode())``, ``Step.decode``;
  untimed, ``decode_ms_per_step`` says what it took), so each holds tuples of its own (starts included) but for
  what decoding shares (a layout equal to one decoded lately: see ``PhaseBatch.from_avro``); ``decode_cpu_ms_per_step``
  the same in CPU time of this process. ``columnar_decode_ms_per_step`` / ``columnar_decode_cpu_ms_per_step``
  (budget: ``BUDGET_DECODE_MS`` CPU ms, one core's work whatever else runs on the machine): the same messages
  decoded by columns (:mod:`argus.schemas.record_columns`, one reused join buffer), the median over the timed
  steps; ``columnar_same``: the first timed step's columns hold the records the record-wise decode gave.
  ``live_ms_per_step``:
  the mean over the timed steps (the diagnoses amortized; the budget is judged on it); ``add_ms_per_step`` and
  ``diagnose_ms_per_run``: medians. ``shared_tuples``: the same figures over ``--live-steps`` further steps fed
  the generated records themselves, whose PhaseBatch records of one (TP index, stage) share their
  names/kinds/groups/streams and, within a step, their starts (one tuple each), as the simulator's do (the warm-up
  is fed those too: the state is the same).

* **L1** (budget: ``BUDGET_L1_MS`` per step). ``N = --l1-steps`` steps (a 10 % regression from the middle):
  ``IterationSeries.from_arrays`` over one (step, wall, gpu) entry per (rank, step) (the reduction to the
  job's series: max over ranks, ``reduce_ms_per_step``) plus ``detect_l1`` over the series
  (``detect_ms_per_run``), divided by N: ``ms_per_step``.

* ``job_diagnosis`` (not budgeted): the whole L1 + L2 state of the stream, ``JobDiagnosis.add`` of every Step
  and PhaseBatch of the L2 steps plus one ``diagnose()``, divided by N (per-record Python bookkeeping
  included).

``load_average`` is the machine's (1, 5, 15 min) at the start and the end. ``peak_rss_mib`` is ``ru_maxrss``
of the process (inputs included), ``peak_rss_mib_after`` the same after each rank count. Budgets apply at
every rank count measured (they are stated for 10,240; cost grows with the ranks). Prints one JSON line; exits 1
when a budget is missed (``over_budget`` lists which).

Run: .venv/bin/python load_tests/scale_diagnosis.py [--ranks 1024,4096,10240] [--repeats 5] [--l2-steps 10]
     [--l1-steps 200] [--quick] [--profile]
``--quick``: 1,024 ranks only, 3 repeats (a fast check). ``--profile``: after the run, cProfile of one
``detect_l3`` call per kernel at the largest rank count, top 15 functions by cumulative time, on stderr.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import resource
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from argus.detectors.l1_iteration import IterationSeries, L1Result, detect_l1  # noqa: E402
from argus.detectors.l2_history import PhaseHistory  # noqa: E402
from argus.detectors.l2_phases import L2Params, L2Result, PhaseTable, detect_l2  # noqa: E402
from argus.detectors.l3_kernels import L3Params, L3Result, detect_l3  # noqa: E402
from argus.producers.sim_workload import K_ALL_REDUCE, K_GEMM  # noqa: E402
from argus.producers.simulator import DEFAULT_START_NS, JobSimulator, JobSpec  # noqa: E402
from argus.producers.topology import build_topology  # noqa: E402
from argus.schemas.record_columns import (  # noqa: E402
    JoinBuffer,
    PhaseColumns,
    StepColumns,
    decode_phase_batches,
    decode_steps,
)
from argus.schemas.records import JobTopology, KernelSummary, PhaseBatch, PhaseKind, Step  # noqa: E402
from argus.streams.diagnosis import DiagnosisParams, JobDiagnosis, KernelDiagnosis  # noqa: E402

#: Budgets (issue 10, "Scale to 10,240 ranks per job"), milliseconds.
BUDGET_L3_MS = 100.0  # per (kernel, window), compute and collective alike
BUDGET_L2_MS = 50.0  # per step
BUDGET_L1_MS = 1.0  # per step
#: Columnar decoding of one step's Step and PhaseBatch messages, CPU ms of this process (one core).
BUDGET_DECODE_MS = 60.0

TP, PP = 8, 4
SEED = 20260
WINDOW_NS = 10_000_000_000  # the default ARGUS_WINDOW_NS
WINDOW_START_NS = DEFAULT_START_NS
COMPUTE_STREAM, COLLECTIVE_STREAM = 7, 17
#: Per (rank, 10 s window): the GEMM's two shapes (p50 us, calls) and the TP all-reduce's two message sizes.
GEMM_MODES = ((200.0, 480), (600.0, 320))
ALL_REDUCE_MODES = ((90.0, 2400), (350.0, 800))
_COMPUTE_KINDS = frozenset({PhaseKind.FORWARD, PhaseKind.BACKWARD, PhaseKind.OPTIMIZER})

F64 = npt.NDArray[np.float64]
T = TypeVar("T")


def _timed(fn: Callable[[], T], repeats: int, warmup: bool = False) -> tuple[float, list[float], T]:
    """Median ms of ``repeats`` calls of ``fn`` (after ``gc.collect()`` each), all runs in ms, last result."""
    if warmup:
        fn()
    runs: list[float] = []
    out: T | None = None
    for _ in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        out = fn()
        runs.append((time.perf_counter() - t0) * 1e3)
    assert out is not None
    return statistics.median(runs), runs, out


def _r(x: float, digits: int = 3) -> float:
    return round(float(x), digits)


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def _found(results: Sequence[L1Result | L2Result | L3Result]) -> list[str]:
    """``kind:ranks`` of each result (ranks cut to 8), for the report."""
    out = []
    for res in results:
        ranks = list(getattr(res, "ranks", ()) or getattr(res, "steps", ()))
        more = "..." if len(ranks) > 8 else ""
        out.append(f"{res.kind.value}:{','.join(map(str, ranks[:8]))}{more}")
    return out


def slow_rank_of(n_ranks: int) -> int:
    """The slow rank: TP index 5 of the 4th DP replica (the last if fewer) of pipeline stage 1."""
    dp = n_ranks // (TP * PP)
    return n_ranks // PP + min(3, dp - 1) * TP + 5


# -- L3 inputs ---------------------------------------------------------------------------------------------

def kernel_rows(job_id: str, kernel: str, stream: int, n_ranks: int, modes: tuple[tuple[float, int], ...],
                rng: np.random.Generator, scale: dict[int, F64]) -> list[KernelSummary]:
    """One window's rows of one (kernel, stream): a one-row KernelSummary per rank (ordered by rank) with one
    cluster per mode, as :class:`KernelDiagnosis` keeps them; ``scale``: per rank, a factor per mode."""
    k = len(modes)
    p50_base = np.array([m[0] * 1e3 for m in modes])
    calls = np.broadcast_to(np.array([m[1] for m in modes], dtype=np.int64), (n_ranks, k))
    speed = np.exp(rng.normal(0.0, 0.01, (n_ranks, 1)))  # benign per-rank spread (~1 %)
    p50 = p50_base[None, :] * speed * np.exp(rng.normal(0.0, 0.004, (n_ranks, k)))
    for rank, factor in scale.items():
        p50[rank] *= factor
    p99 = p50 * np.exp(np.abs(rng.normal(0.12, 0.02, (n_ranks, k))))
    cols = [calls, p50, p99, p50 * 0.95, p99 * 1.05, calls * p50 * 1.01]
    c, q50, q99, lo, hi, total = (np.rint(a).astype(np.int64).tolist() for a in cols)
    n_events = calls.sum(axis=1).tolist()
    ws, we = (WINDOW_START_NS,), (WINDOW_START_NS + WINDOW_NS,)
    return [KernelSummary(job_id, kernel, stream, (r,), ws, we, (n_events[r],), (k,), tuple(c[r]), tuple(q50[r]),
                          tuple(q99[r]), tuple(lo[r]), tuple(hi[r]), tuple(total[r])) for r in range(n_ranks)]


def l3_inputs(job_id: str, topo: JobTopology, seed: int) -> dict[str, list[KernelSummary]]:
    """The GEMM's and the TP all-reduce's rows of one window (see the module docstring)."""
    n, slow = topo.world_size, slow_rank_of(topo.world_size)
    tp_peers = [r for r in range(n) if topo.tp_group[r] == topo.tp_group[slow] and r != slow]
    specs = {
        "compute": (K_GEMM, COMPUTE_STREAM, GEMM_MODES, {slow: np.array([1.0, 1.3])}),
        # A collective ends together on every member: a healthy member's time is the transfer plus some
        # waiting (x1.3 here), the last arrival's the transfer alone; the slow rank arrives last in its TP
        # group, whose other members wait for it (x6).
        "collective": (K_ALL_REDUCE, COLLECTIVE_STREAM, ALL_REDUCE_MODES,
                       {slow: np.full(2, 1 / 1.3)} | {r: np.full(2, 6.0) for r in tp_peers}),
    }
    return {name: kernel_rows(job_id, kernel, stream, n, modes, np.random.default_rng(seed + i), scale)
            for i, (name, (kernel, stream, modes, scale)) in enumerate(specs.items())}


def state_bytes_per_row(rows: Sequence[KernelSummary], make: Callable[[], KernelDiagnosis]) -> float:
    """Tracemalloc bytes per row that a fresh ``make()`` state retains after taking decoded copies of
    ``rows`` (fresh tuples and ints, as read from Kafka) one by one."""
    payloads = [r.encode() for r in rows]
    state = make()
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for p in payloads:
        state.add(KernelSummary.decode(p))
    gc.collect()
    size = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    del state
    return size / len(payloads)


def measure_l3(rows: list[KernelSummary], topo: JobTopology, repeats: int) -> dict[str, Any]:
    from argus.streams.summary_pieces import BoundedKernelDiagnosis

    params = L3Params()
    med, runs, found = _timed(lambda: detect_l3(rows, topo, params, None), repeats, warmup=True)
    gc.collect()
    tracemalloc.start()
    detect_l3(rows, topo, params, None)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    first = rows[0]
    key = (first.job_id, first.kernel, first.stream)
    # The worker's per-row bookkeeping of one window (each add re-sorts the window's rows).
    worker = BoundedKernelDiagnosis(*key, DiagnosisParams(), 64)
    gc.collect()
    t0 = time.perf_counter()
    for row in rows:
        worker.add(row)
    ingest_ms = (time.perf_counter() - t0) * 1e3
    del worker
    sample = rows[:1024]
    pure = state_bytes_per_row(sample, lambda: KernelDiagnosis(*key))
    bounded = state_bytes_per_row(sample, lambda: BoundedKernelDiagnosis(*key, DiagnosisParams(), 64))
    return {
        "kernel": first.kernel, "stream": first.stream, "clusters_per_row": first.n_clusters[0],
        "ms_per_window": _r(med), "runs_ms": [_r(x, 2) for x in runs],
        "ingest_ms_per_window": _r(ingest_ms), "detect_peak_mib": _r(peak / 2**20, 1),
        "state_bytes_per_rank_window_row": round(pure),
        "worker_state_bytes_per_rank_window_row": round(bounded),
        "worker_state_mib_per_window": _r(bounded * len(rows) / 2**20, 2),
        "found": _found(found),
    }


# -- L2 inputs ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Template:
    """One (TP index, stage)'s phase layout of one step: columns of its PhaseBatch, offsets from the step."""

    kinds: tuple[PhaseKind, ...]
    names: tuple[str, ...]
    groups: tuple[Any, ...]
    streams: tuple[int, ...]
    offset_ns: npt.NDArray[np.int64]
    duration_ns: F64
    compute: npt.NDArray[np.bool_]


def phase_templates(seed: int) -> tuple[list[_Template], int]:
    """The simulator's phases of one step of a TP x PP job (DP 1), per rank (= TP index + TP * stage), and
    the step's wall time (ns)."""
    sim = JobSimulator(JobSpec("scale-template", dp=1, tp=TP, pp=PP, steps=1, seed=seed), batch_events=1 << 40)
    steps, phases, _ = next(iter(sim.steps()))
    by_rank = {b.rank: b for b in phases}
    out = []
    for r in range(TP * PP):
        b = by_rank[r]
        out.append(_Template(b.kinds, b.names, b.groups, b.streams,
                             np.asarray(b.start_ns, dtype=np.int64) - steps[0].start_ns,
                             np.asarray(b.duration_ns, dtype=np.float64),
                             np.array([k in _COMPUTE_KINDS for k in b.kinds], dtype=bool)))
    return out, int(steps[0].wall_ns)


def phase_inputs(job_id: str, topo: JobTopology, n_steps: int, seed: int,
                 templates: list[_Template], step_ns: int) -> tuple[list[list[Step]], list[list[PhaseBatch]]]:
    """Per step, every rank's Step and PhaseBatch (durations jittered 2 % per phase; the slow rank's compute
    phases 1.6x). Starts are shared by the ranks of one template in one step (one tuple)."""
    rng = np.random.default_rng(seed)
    steps: list[list[Step]] = []
    batches: list[list[PhaseBatch]] = []
    for s in range(n_steps):
        st, bs = phase_step(job_id, topo, s, rng, templates, step_ns)
        steps.append(st)
        batches.append(bs)
    return steps, batches


def phase_step(job_id: str, topo: JobTopology, s: int, rng: np.random.Generator, templates: list[_Template],
               step_ns: int) -> tuple[list[Step], list[PhaseBatch]]:
    """Step ``s``'s records of every rank (see :func:`phase_inputs`)."""
    n = topo.world_size
    slow = slow_rank_of(n)
    tpl_of = np.asarray(topo.rank) % TP + TP * np.asarray(topo.pp_stage)
    members = [np.flatnonzero(tpl_of == t) for t in range(len(templates))]
    t0 = WINDOW_START_NS + s * step_ns
    gpu = (step_ns * 0.98 * np.exp(rng.normal(0.0, 0.005, n))).astype(np.int64).tolist()
    steps = [Step(job_id, r, s, t0, step_ns, gpu[r]) for r in range(n)]
    row: list[PhaseBatch | None] = [None] * n
    for t, tpl in enumerate(templates):
        ranks = members[t]
        dur = tpl.duration_ns[None, :] * np.exp(rng.normal(0.0, 0.02, (ranks.size, tpl.duration_ns.size)))
        hit = np.flatnonzero(ranks == slow)
        if hit.size:
            dur[hit[0], tpl.compute] *= 1.6
        starts = tuple((tpl.offset_ns + t0).tolist())
        for r, d in zip(ranks.tolist(), np.maximum(np.rint(dur), 1).astype(np.int64).tolist(), strict=True):
            row[r] = PhaseBatch(job_id, r, s, tpl.kinds, tpl.names, tpl.groups, tpl.streams, starts, tuple(d))
    return steps, [b for b in row if b is not None]


def phase_batch_bytes(batches: list[PhaseBatch]) -> float:
    """Tracemalloc bytes of one decoded PhaseBatch (mean over ``batches``), as the worker holds it."""
    payloads = [b.encode() for b in batches]
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    decoded = [PhaseBatch.decode(p) for p in payloads]
    size = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    del decoded
    return size / len(payloads)


def measure_l2(topo: JobTopology, batches: list[list[PhaseBatch]], repeats: int) -> dict[str, Any]:
    flat = [b for step in batches for b in step]
    n_steps = len(batches)
    params = L2Params()
    jd = DiagnosisParams()
    table_runs, fold_runs, detect_runs = [], [], []
    found: list[L2Result] = []
    state = 0
    for _ in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        table = PhaseTable.from_batches(flat)
        table_runs.append((time.perf_counter() - t0) * 1e3)
        del table
        # The live path: each step folded once into the history, then judged.
        hist = PhaseHistory(jd.history_steps)
        gc.collect()
        t0 = time.perf_counter()
        for s, step_batches in enumerate(batches):
            hist.fold(s, step_batches)
        t1 = time.perf_counter()
        found = hist.detect(topo, params)
        t2 = time.perf_counter()
        fold_runs.append((t1 - t0) * 1e3)
        detect_runs.append((t2 - t1) * 1e3)
        state = hist.state_bytes()
        del hist
    totals = [a + b for a, b in zip(fold_runs, detect_runs, strict=True)]
    table_ms, fold_ms, detect_ms = map(statistics.median, (table_runs, fold_runs, detect_runs))
    bytes_per = phase_batch_bytes(flat[:64])
    folded_per = state / (topo.world_size * n_steps)
    want = _found(detect_l2(PhaseTable.from_batches(flat), topo, params))
    return {
        "steps": n_steps, "phases_per_batch": len(flat[0].kinds),
        "ms_per_step": _r(statistics.median(totals) / n_steps),
        "runs_ms_per_step": [_r(x / n_steps, 2) for x in totals],
        "table_ms_per_step": _r(table_ms / n_steps), "fold_ms_per_step": _r(fold_ms / n_steps),
        "detect_ms_per_run": _r(detect_ms), "detect_ms_per_step": _r(detect_ms / n_steps),
        "live_ms_per_step_est": _r(fold_ms / n_steps + detect_ms / jd.detect_every),
        "state_bytes_per_rank_step": round(bytes_per),
        "folded_state_bytes_per_rank_step": round(folded_per),
        "history_state_gib_est": _r(folded_per * topo.world_size * jd.history_steps / 2**30, 3),
        "found": _found(found), "same_as_table": _found(found) == want,
    }


def measure_l2_live(topo: JobTopology, templates: list[_Template], step_ns: int, timed_steps: int,
                    seed: int) -> dict[str, Any]:
    """``JobDiagnosis`` driven through ``history_steps`` steps (untimed warm-up to steady state: a full
    history), then ``timed_steps`` steps of decoded records and ``timed_steps`` more of the generated ones
    (shared tuples), each timed: ``add`` of every Step and PhaseBatch of the step plus ``diagnose()`` when
    due. Records are generated, encoded and decoded per step, untimed."""
    params = DiagnosisParams()
    jd = JobDiagnosis(topo.job_id, params)
    jd.add(topo)
    rng = np.random.default_rng(seed)
    runs: dict[bool, tuple[list[float], list[float], list[float]]] = {True: ([], [], []), False: ([], [], [])}
    decode_runs: list[float] = []
    decode_cpu: list[float] = []
    columnar_runs: list[float] = []
    columnar_cpu: list[float] = []
    columnar_same = False
    join = JoinBuffer()
    findings: list[str] = []
    held = params.history_steps
    for s in range(held + 2 * timed_steps):
        step_recs, batch_recs = phase_step(topo.job_id, topo, s, rng, templates, step_ns)
        timed = s >= held
        # The last diagnosis period of the warm-up decoded too: what a worker does once per process (the compiled
        # fold's specializations for the decoded records' read-only times loaded) is not a step's cost.
        decoded = held - params.detect_every <= s < held + timed_steps
        if decoded:
            # As the worker gets them: each record decoded from its own Avro bytes (fresh tuples). The decode is
            # the agent's, measured with the agent: not timed here.
            step_bytes, batch_bytes = [r.encode() for r in step_recs], [b.encode() for b in batch_recs]
            del step_recs, batch_recs
            t_dec, c_dec = time.perf_counter(), time.process_time()
            step_recs = [Step.decode(p) for p in step_bytes]
            batch_recs = [PhaseBatch.decode(p) for p in batch_bytes]
            if timed:
                decode_runs.append((time.perf_counter() - t_dec) * 1e3)
                decode_cpu.append((time.process_time() - c_dec) * 1e3)
                gc.collect()
                t_col, c_col = time.perf_counter(), time.process_time()
                cols = decode_steps(step_bytes, join), decode_phase_batches(batch_bytes, join)
                columnar_runs.append((time.perf_counter() - t_col) * 1e3)
                columnar_cpu.append((time.process_time() - c_col) * 1e3)
                if len(columnar_runs) == 1:  # the columns hold what the record-wise decode gave (untimed)
                    columnar_same = columns_equal(cols[0], cols[1], step_recs, batch_recs)
                del cols
            del step_bytes, batch_bytes
        if timed:
            gc.collect()
        t0 = time.perf_counter()
        for rec in step_recs:
            jd.add(rec)
        for b in batch_recs:
            jd.add(b)
        t1 = time.perf_counter()
        got = jd.diagnose() if jd.due() else None
        t2 = time.perf_counter()
        del step_recs, batch_recs
        if got:
            findings += [f"{f.kind.value}:{','.join(map(str, f.ranks[:8]))}" for f in got]
        if timed:
            add_runs, diag_runs, totals = runs[s < held + timed_steps]
            add_runs.append((t1 - t0) * 1e3)
            totals.append((t2 - t0) * 1e3)
            if got is not None:
                diag_runs.append((t2 - t1) * 1e3)
    state = jd.phase_state_bytes()

    def figures(decoded: bool) -> dict[str, Any]:
        add_runs, diag_runs, totals = runs[decoded]
        return {"live_ms_per_step": _r(statistics.mean(totals)), "runs_ms": [_r(x, 1) for x in totals],
                "add_ms_per_step": _r(statistics.median(add_runs)),
                "diagnose_ms_per_run": _r(statistics.median(diag_runs)) if diag_runs else None}

    return {
        "history_steps": held, "detect_every": params.detect_every, "timed_steps": timed_steps,
        "records": "decoded", **figures(True),
        "decode_ms_per_step": _r(statistics.median(decode_runs)),
        "decode_cpu_ms_per_step": _r(statistics.median(decode_cpu)),
        "columnar_decode_ms_per_step": _r(statistics.median(columnar_runs)),
        "columnar_decode_cpu_ms_per_step": _r(statistics.median(columnar_cpu)),
        "columnar_same": columnar_same,
        "shared_tuples": figures(False),
        "state_bytes_per_rank_step": round(state / (topo.world_size * held)),
        "history_state_mib": _r(state / 2**20, 1), "findings": findings,
    }


def columns_equal(steps: StepColumns, batches: PhaseColumns, step_recs: list[Step],
                  batch_recs: list[PhaseBatch]) -> bool:
    """Whether the columns hold, row by row, the records the record-wise decode gave (every message read)."""
    return (not steps.rest and not batches.rest and [steps.record(k) for k in range(len(steps))] == step_recs
            and all(batches.batch(k) == b and batches.batch(k).packed_times == b.packed_times
                    for k, b in enumerate(batch_recs)))


def measure_job_diagnosis(topo: JobTopology, steps: list[list[Step]], batches: list[list[PhaseBatch]],
                          repeats: int) -> dict[str, Any]:
    def run() -> int:
        jd = JobDiagnosis(topo.job_id)
        jd.add(topo)
        for step_recs, batch_recs in zip(steps, batches, strict=True):
            for rec in step_recs:
                jd.add(rec)
            for b in batch_recs:
                jd.add(b)
        return len(jd.diagnose())

    med, runs, n_findings = _timed(run, repeats)
    return {"ms_per_step": _r(med / len(steps)), "runs_ms_per_step": [_r(x / len(steps), 2) for x in runs],
            "findings": n_findings}


# -- L1 ----------------------------------------------------------------------------------------------------

def measure_l1(n_ranks: int, n_steps: int, seed: int, repeats: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    wall = 2e8 * np.exp(rng.normal(0.0, 0.03, n_steps))
    wall[n_steps // 2:] *= 1.10  # a 10 % regression from the middle
    step = np.repeat(np.arange(n_steps, dtype=np.int64), n_ranks)
    wall_rs = np.repeat(wall, n_ranks)  # the host step time is the same on every rank
    gpu_rs = wall_rs * 0.98 * np.exp(rng.normal(0.0, 0.005, wall_rs.size))
    reduce_ms, reduce_runs, series = _timed(lambda: IterationSeries.from_arrays(step, wall_rs, gpu_rs), repeats,
                                            warmup=True)
    detect_ms, detect_runs, found = _timed(lambda: detect_l1(series), repeats, warmup=True)
    totals = [a + b for a, b in zip(reduce_runs, detect_runs, strict=True)]
    return {
        "steps": n_steps, "ms_per_step": _r(statistics.median(totals) / n_steps, 4),
        "reduce_ms_per_step": _r(reduce_ms / n_steps, 4), "detect_ms_per_run": _r(detect_ms),
        "detect_ms_per_step": _r(detect_ms / n_steps, 4), "found": _found(found),
    }


# -- main --------------------------------------------------------------------------------------------------

def profile_l3(inputs: dict[str, list[KernelSummary]], topo: JobTopology, top: int = 15) -> None:
    """cProfile of one ``detect_l3`` call per kernel; the top functions by cumulative time, on stderr."""
    params = L3Params()
    for name, rows in inputs.items():
        detect_l3(rows, topo, params, None)  # warm
        prof = cProfile.Profile()
        prof.enable()
        detect_l3(rows, topo, params, None)
        prof.disable()
        sys.stderr.write(f"\n== cProfile: detect_l3 {name} ({rows[0].kernel[:40]}), {topo.world_size} ranks ==\n")
        pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(top)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--ranks", default="1024,4096,10240", help="comma-separated rank counts (multiples of 32)")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per measurement (L2: at most 3)")
    ap.add_argument("--l2-steps", type=int, default=10, help="steps of phase batches judged by L2")
    ap.add_argument("--l1-steps", type=int, default=200, help="steps of the L1 series")
    ap.add_argument("--live-steps", type=int, default=10,
                    help="L2 live: steps timed after the 200-step warm-up (0: no live run)")
    ap.add_argument("--quick", action="store_true", help="1,024 ranks, 3 repeats")
    ap.add_argument("--profile", action="store_true", help="cProfile detect_l3 at the largest rank count (stderr)")
    args = ap.parse_args(argv)
    ranks = [1024] if args.quick else sorted({int(x) for x in args.ranks.split(",") if x.strip()})
    repeats = 3 if args.quick else max(1, args.repeats)
    heavy = min(repeats, 3)
    if any(n < 2 * TP * PP or n % (TP * PP) for n in ranks) or args.l2_steps < 3 or args.l1_steps < 20:
        ap.error(f"ranks must be multiples of {TP * PP} and >= {2 * TP * PP} (TP {TP} x PP {PP} x DP >= 2), "
                 "--l2-steps >= 3, --l1-steps >= 20")

    load_start = [round(x, 2) for x in os.getloadavg()]
    templates, step_ns = phase_templates(SEED)
    results: dict[str, Any] = {}
    over: list[str] = []
    last_l3: tuple[dict[str, list[KernelSummary]], JobTopology] | None = None
    for n in ranks:
        t_gen = time.perf_counter()
        job_id = f"scale-{n}"
        topo = build_topology(job_id, n // (TP * PP), TP, PP)
        l3_in = l3_inputs(job_id, topo, SEED)
        steps, batches = phase_inputs(job_id, topo, args.l2_steps, SEED + 7, templates, step_ns)
        gen_s = time.perf_counter() - t_gen
        entry: dict[str, Any] = {
            "topology": f"DP {topo.dp_size} x TP {TP} x PP {PP}", "slow_rank": slow_rank_of(n),
            "input_generation_s": _r(gen_s, 2),
            "l3": {name: measure_l3(rows, topo, repeats) for name, rows in l3_in.items()},
            # Budgeted on the records as the worker holds them: each decoded from its own Avro bytes.
            "l2": measure_l2(topo, [[PhaseBatch.decode(b.encode()) for b in step] for step in batches], heavy),
            "l1": measure_l1(n, args.l1_steps, SEED + 11, repeats),
            "job_diagnosis": measure_job_diagnosis(topo, steps, batches, heavy),
        }
        in_memory = measure_l2(topo, batches, heavy)
        entry["l2"]["in_memory"] = {k: in_memory[k] for k in ("ms_per_step", "fold_ms_per_step", "detect_ms_per_run",
                                                              "same_as_table")}
        if args.live_steps > 0:
            del steps, batches
            gc.collect()
            entry["l2"]["live"] = measure_l2_live(topo, templates, step_ns, args.live_steps, SEED + 13)
            steps, batches = [], []
        del steps, batches
        gc.collect()
        entry["peak_rss_mib_after"] = _r(_rss_mib(), 1)
        results[str(n)] = entry
        for name, res in entry["l3"].items():
            if res["ms_per_window"] > BUDGET_L3_MS:
                over.append(f"L3 {name} at {n} ranks: {res['ms_per_window']} ms/window > {BUDGET_L3_MS}")
        if entry["l2"]["ms_per_step"] > BUDGET_L2_MS:
            over.append(f"L2 at {n} ranks: {entry['l2']['ms_per_step']} ms/step > {BUDGET_L2_MS}")
        live = entry["l2"].get("live", {}).get("live_ms_per_step", entry["l2"]["live_ms_per_step_est"])
        if live > BUDGET_L2_MS:
            over.append(f"L2 live at {n} ranks: {live} ms/step > {BUDGET_L2_MS}")
        decode_cpu = entry["l2"].get("live", {}).get("columnar_decode_cpu_ms_per_step")
        if decode_cpu is not None and decode_cpu > BUDGET_DECODE_MS:
            over.append(f"columnar decode at {n} ranks: {decode_cpu} CPU ms/step > {BUDGET_DECODE_MS}")
        if entry["l2"].get("live", {}).get("columnar_same") is False:
            over.append(f"columnar decode at {n} ranks differs from the record-wise decode")
        if entry["l1"]["ms_per_step"] > BUDGET_L1_MS:
            over.append(f"L1 at {n} ranks: {entry['l1']['ms_per_step']} ms/step > {BUDGET_L1_MS}")
        last_l3 = (l3_in, topo)

    result = {
        "benchmark": "scale_diagnosis",
        "ranks": ranks, "repeats": repeats, "l2_repeats": heavy, "seed": SEED,
        "l2_steps": args.l2_steps, "l1_steps": args.l1_steps, "window_ns": WINDOW_NS,
        "results": results,
        "peak_rss_mib": _r(_rss_mib(), 1),
        # Wall-clock figures grow with other work on the machine; the CPU figures much less.
        "load_average": {"start": load_start, "end": [round(x, 2) for x in os.getloadavg()]},
        "budgets": {"l3_ms_per_kernel_window": BUDGET_L3_MS, "l2_ms_per_step": BUDGET_L2_MS,
                    "columnar_decode_cpu_ms_per_step": BUDGET_DECODE_MS,
                    "l1_ms_per_step": BUDGET_L1_MS, "stated_at_ranks": 10240},
        "over_budget": over,
        "within_budget": not over,
    }
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    if args.profile and last_l3 is not None:
        profile_l3(*last_l3)
    return 0 if not over else 1


if __name__ == "__main__":
    sys.exit(main())
