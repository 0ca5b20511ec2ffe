"""``argus demo`` and ``argus simulate``: publish a simulated job and follow it through the pipeline."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any

from argus.core.errors import ArgusError
from argus.core.settings import Settings
from argus.kafka_users import Role, role_settings
from argus.producers.faults import Fault, FaultSpec
from argus.producers.publisher import Publisher
from argus.producers.seed_cases import SEED_CASES, seed_case
from argus.producers.simulator import JobSimulator, JobSpec, SimStats
from argus.producers.topology import build_topology
from argus.sinks.clickhouse import sql_string
from argus.sinks.findings_query import fetch_findings, wait_diagnosed
from argus.sinks.query_server import run_query
from argus.topics import Topic

__all__ = ["FAULTS", "build_spec", "compression_text", "run_demo", "simulate_job", "wait_processed", "worker_counter"]

#: CLI names of the faults: the paper's five cases (argus.producers.seed_cases), then the liveness faults.
FAULTS: dict[str, Fault] = {
    **{c.name: c.fault for c in SEED_CASES},
    "hang": Fault.HANG,
    "silent-rank": Fault.SILENT_RANK,
    "crash": Fault.CRASH,
}

CASE_NAMES = frozenset(c.name for c in SEED_CASES)
Progress = Callable[[str], None]


def build_spec(job_id: str, dp: int, tp: int, pp: int, steps: int, fault: str, seed: int = 0, *,
               hang_rank: int = 5, hang_step: int = 10, hang_s: float = 20.0, hang_resume: bool = True,
               heartbeat_interval_s: float = 2.0, pause_step: int = -1, pause_s: float = 0.0) -> JobSpec:
    """A job of ``dp × tp × pp`` ranks with fault ``case1`` … ``case5`` (or ``none``) at its defaults, or a
    liveness fault: ``hang`` / ``silent-rank`` (rank ``hang_rank`` from step ``hang_step``, the others
    heartbeat every ``heartbeat_interval_s`` for ``hang_s`` seconds; a hang then resumes if
    ``hang_resume``) or ``crash`` (no END). With ``pause_step`` >= 1 every rank pauses ``pause_s`` seconds
    before that step (a checkpoint: heartbeats only), then the job goes on."""
    try:
        topo = build_topology(job_id, dp, tp, pp)
    except ValueError as exc:
        raise ArgusError(f"job topology: {exc}") from exc
    spec: FaultSpec | None
    hang_ns = round(hang_s * 1e9)
    try:
        makers: dict[str, Callable[[], FaultSpec | None]] = {
            "none": lambda: None,
            **{c.name: functools.partial(c.fault_on, topo) for c in SEED_CASES},
            "hang": lambda: FaultSpec.hang(topo, hang_rank, hang_step, hang_ns, hang_resume),
            "silent-rank": lambda: FaultSpec.silent_rank(topo, hang_rank, hang_step, hang_ns),
            "crash": lambda: FaultSpec.crash(topo),
        }
        spec = makers[fault]()
    except KeyError as exc:
        raise ArgusError(f"unknown fault {fault!r}; use none, case1..case5, hang, silent-rank or crash") from exc
    except ValueError as exc:
        raise ArgusError(f"fault {fault} does not fit a {dp}x{tp}x{pp} job: {exc}") from exc
    # The case's step time (a host stall of 80 ms is a spike only against short steps: case 4's 40 ms).
    step_time_ns = seed_case(fault).step_time_ns if fault in CASE_NAMES else JobSpec.step_time_ns
    try:
        return JobSpec(job_id, dp, tp=tp, pp=pp, steps=steps, seed=seed, fault=spec, step_time_ns=step_time_ns,
                       heartbeat_interval_ns=round(heartbeat_interval_s * 1e9), pause_step=pause_step,
                       pause_ns=round(pause_s * 1e9) if pause_step >= 0 else 0)
    except ValueError as exc:
        raise ArgusError(f"job spec: {exc}") from exc


def _publish(settings: Settings, spec: JobSpec, progress: Progress,
             advance: Callable[[int, int | None], None] | None = None) -> tuple[SimStats, dict[str, int]]:
    sim = JobSimulator(spec, batch_events=settings.publisher_batch_events)

    def stepped(done: int, total: int) -> None:
        if advance is not None:
            advance(done, total)
        elif done % 10 == 0 or done == total:
            progress(f"simulated step {done}/{total}")

    # On a secure home (argus up --secure) the job is published as the ranks' user, as a real job would be.
    with Publisher(role_settings(settings, Role.RANK), lossless=True) as pub:
        # A hang's heartbeats go out at the pace of their event time, as a live job's would.
        live = (spec.fault is not None and spec.fault.liveness) or spec.pause_ns > 0
        stats = sim.run(pub, progress=stepped, realtime_heartbeats=live)
        pstats = pub.close()
    if pstats.failed or pstats.dropped:
        raise ArgusError(f"publishing failed: {pstats.failed} undelivered, {pstats.dropped} dropped")
    return stats, pstats.bytes_by_topic


def simulate_job(settings: Settings, job_id: str, dp: int, tp: int, pp: int, steps: int, fault: str,
                 seed: int = 0, progress: Progress | None = None, **liveness: Any) -> dict[str, Any]:
    """Publish a simulated job to Kafka; returns what was published. ``liveness``: the hang options of
    :func:`build_spec` (the heartbeat interval defaults to the settings')."""
    say = progress or (lambda _m: None)
    liveness.setdefault("heartbeat_interval_s", settings.heartbeat_interval_s)
    spec = build_spec(job_id, dp, tp, pp, steps, fault, seed, **liveness)
    stats, sizes = _publish(settings, spec, say)
    return {"job": job_id, "ranks": spec.world_size, "steps": steps, "fault": fault, **dataclasses.asdict(stats),
            "kernel_bytes": sizes.get(Topic.KERNELS.full(settings), 0)}


def wait_processed(settings: Settings, job_id: str, kernel_events: int, steps: int, timeout_s: float,
                   progress: Progress | None = None) -> dict[str, int]:
    """Wait until every kernel event of the job is in a summary or a dead letter, all steps are stored
    and the job's END arrived. Returns the counts; raises :class:`ArgusError` on timeout."""
    say = progress or (lambda _m: None)
    db = settings.clickhouse_database
    job = sql_string(job_id)
    sql = f"""SELECT
        (SELECT sum(n_events) FROM `{db}`.kernel_summaries FINAL WHERE job_id = {job}),
        (SELECT sum(kernel_events) FROM `{db}`.dead_letters FINAL WHERE job_id = {job}),
        (SELECT count() FROM `{db}`.steps FINAL WHERE job_id = {job}),
        (SELECT count() FROM `{db}`.jobs FINAL WHERE job_id = {job} AND event = 'END')"""
    deadline = time.monotonic() + timeout_s
    last = None
    while True:
        row = run_query(settings, sql).rows[0]
        summarized, dead, stored_steps, ended = (int(v or 0) for v in row)
        now = (summarized, dead, stored_steps, ended)
        if now != last:
            say(f"processed {summarized + dead}/{kernel_events} kernel events, {stored_steps}/{steps} steps")
            last = now
        if summarized + dead >= kernel_events and stored_steps >= steps and ended:
            return {"summarized_events": summarized, "dead_lettered_events": dead, "steps": stored_steps}
        if time.monotonic() > deadline:
            raise ArgusError(f"job {job_id} not fully processed after {timeout_s:.0f} s: "
                             f"{summarized + dead}/{kernel_events} kernel events, {stored_steps}/{steps} steps")
        time.sleep(0.5)


def worker_counter(read: Callable[[], dict[str, Any] | None], name: str, timeout_s: float,
                   poll_s: float = 0.5) -> int | None:
    """The worker's counter ``name`` (a field of its ``/stats``, e.g. ``summary_bytes_out``) as ``read`` returns
    it, asked again every ``poll_s`` seconds until ``timeout_s``: the web server shares the worker's event loop
    with the agents, which a diagnosis keeps busy for seconds, so a request that times out says nothing about
    the counter. None if the worker never answered, or answered without that counter."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = read()
        if stats is not None:
            value = stats.get(name)
            return value if isinstance(value, int) else None
        if time.monotonic() >= deadline:
            return None
        time.sleep(poll_s)


def compression_text(kernel_bytes: int, summary_bytes: int | None) -> str:
    """The demo's compression line: the kernel batches' bytes against the summaries' (both Avro, before the
    Kafka compression); ``summary_bytes`` None where the worker's counter could not be read."""
    if summary_bytes is None:
        return (f"{kernel_bytes:,} B of kernel batches -> summaries' size unknown (the worker's /stats did not "
                f"answer, or the worker restarted during the demo)")
    if summary_bytes == 0:
        return f"{kernel_bytes:,} B of kernel batches -> no summaries sent"
    return (f"{kernel_bytes:,} B of kernel batches -> {summary_bytes:,} B of summaries "
            f"= {kernel_bytes / summary_bytes:.1f}x")


def run_demo(settings: Settings, fault: str = "case1", steps: int = 40, progress: Progress | None = None,
             timeout_s: float = 300.0, advance: Callable[[int, int | None], None] | None = None) -> dict[str, Any]:
    """Start the stack, publish a 32-rank job (DP 8 × TP 2 × PP 2) with ``fault``, wait, report.
    ``advance(done, total)``: steps published (a progress bar)."""
    from argus.stack import Stack

    say = progress or (lambda _m: None)
    t0 = time.monotonic()
    stack = Stack(settings)
    stack.up(progress=say)
    before = worker_counter(stack.worker_stats, "summary_bytes_out", timeout_s)
    job_id = f"demo-{fault}-{time.strftime('%Y%m%d-%H%M%S')}"
    spec = build_spec(job_id, 8, 2, 2, steps, fault)
    say(f"publishing {job_id}: {spec.world_size} ranks x {steps} steps, fault {fault} ({FAULTS[fault].name})")
    stats, sizes = _publish(settings, spec, say, advance)
    counts = wait_processed(settings, job_id, stats.kernel_events, stats.steps, timeout_s, say)
    after = worker_counter(stack.worker_stats, "summary_bytes_out", timeout_s)
    # The counter is the worker process's, since its start: a restart between the two readings resets it.
    summary_bytes = after - before if before is not None and after is not None and after >= before else None
    say("waiting for the diagnosis (L1 iteration time, L2 phases per parallel group, L3 kernels)")
    diagnosed = wait_diagnosed(settings, job_id, timeout_s)
    findings = fetch_findings(settings, job_id)
    db = settings.clickhouse_database
    tables = {}
    for table in ("steps", "phases", "kernel_summaries", "topology", "jobs", "findings"):
        tables[table] = int(run_query(settings, f"SELECT count() FROM `{db}`.{table} FINAL "
                                                f"WHERE job_id = {sql_string(job_id)}").rows[0][0])
    kernel_bytes = sizes.get(Topic.KERNELS.full(settings), 0)
    elapsed = time.monotonic() - t0
    report: dict[str, Any] = {
        "job": job_id, "fault": fault, "ranks": spec.world_size, "steps": steps,
        "kernel_events_in": stats.kernel_events, "kernel_batches_in": stats.kernel_batches,
        **counts, "summary_rows_out": tables["kernel_summaries"], "kernel_bytes": kernel_bytes,
        "bytes_per_kernel_event": round(kernel_bytes / max(1, stats.kernel_events), 2),
        "summary_bytes": summary_bytes,
        "compression_ratio": round(kernel_bytes / summary_bytes, 1) if summary_bytes else None,
        "tables": tables, "seconds": round(elapsed, 1),
        "complete": counts["summarized_events"] + counts["dead_lettered_events"] == stats.kernel_events and diagnosed,
        "findings": findings,
    }
    lines = [
        f"argus demo — job {job_id}: {spec.world_size} ranks (DP 8 x TP 2 x PP 2), {steps} steps, "
        f"fault {fault} ({FAULTS[fault].name.lower().replace('_', ' ')})",
        f"  records in        {stats.kernel_events:,} kernel events in {stats.kernel_batches:,} batches, "
        f"{stats.steps:,} steps, {stats.phase_batches:,} phase batches",
        f"  summarized        {counts['summarized_events']:,} kernel events "
        f"(+ {counts['dead_lettered_events']:,} dead-lettered) -> {tables['kernel_summaries']:,} summary rows",
        f"  bytes on the wire {report['bytes_per_kernel_event']} B per kernel event (Avro, before zstd)",
        f"  compression       {compression_text(kernel_bytes, summary_bytes)}",
        "  tables filled     " + ", ".join(f"{t} {n:,}" for t, n in tables.items()),
        f"  diagnosis         {len(findings)} finding(s){'' if diagnosed else ' (incomplete: timed out)'}:",
        *(f"    {f['level']} {f['kind']:<18} ranks={f['ranks'] or '-'} "
          f"{f['phase'] or (f['kernel'] or '')[:48] or ''} steps={f['steps'] or '-'} score={f['score']:.1f}"
          for f in findings[:12]),
        *([f"    ... and {len(findings) - 12} more: argus findings --job {job_id}"] if len(findings) > 12 else []),
        f"  took              {elapsed:.1f} s",
        f"  try: argus sql \"SELECT rank, kernel, n_clusters, cluster_p50_ns FROM {db}.kernel_summaries FINAL "
        f"WHERE job_id = {sql_string(job_id)} AND kernel LIKE '%gemm%' ORDER BY rank LIMIT 8\"",
    ]
    report["text"] = "\n".join(lines)
    return report
