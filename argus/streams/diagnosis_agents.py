"""Faust agents of the progressive diagnosis: L1/L2 per job, L3 per (job, kernel, stream).

``argus.diagnose-jobs`` reads steps, phases, topology, lifecycle records and heartbeats, all keyed by job, in
lists, and hands them to its :class:`~argus.streams.job_router.JobRouter`; ``argus.diagnose-kernels`` reads the
kernel summaries and hands each to its :class:`~argus.streams.summary_router.SummaryRouter`; an ended L3 part goes
to the :class:`~argus.streams.final_router.FinalRouter` (its final L3, rank aggregate and DIAGNOSED record). The
timers (idle jobs, hangs, L3 parts waiting for shared context) ask the routers too. The agents only decode,
call a router and carry out what it answers (:class:`~argus.streams.diagnosis_shell.DiagnosisShell`); every rule
is in the routers, unit-tested without a broker. Messages are acked only once what they caused was delivered;
findings have deterministic ids, so replays and restarts never double them. How a job is diagnosed exactly once
from at-least-once delivery, across restarts, rebalances and workers: docs/stream-agents.md.
"""

from __future__ import annotations

import functools
import time
from typing import Any, cast

import faust
from faust.types import EventT

from argus.core.settings import Settings
from argus.schemas.job_context import CONTEXT_JOB_PART, JobContext
from argus.schemas.records import KernelSummary
from argus.streams.dead_letters import DeadLetters
from argus.streams.diagnosis import DiagnosisParams, detector_version
from argus.streams.diagnosis_shell import DiagnosisShell, LifecycleScan, holds_job
from argus.streams.diagnosis_stats import DiagnosisStats
from argus.streams.final_router import FinalRouter
from argus.streams.job_context import ContextTable
from argus.streams.job_effects import JobRecord
from argus.streams.job_router import JobRouter
from argus.streams.lifecycle_scan import scan_diagnosed
from argus.streams.summary_router import SummaryRouter
from argus.topics import RECORD_OF, Topic

__all__ = ["install_diagnosis"]

#: The job agent's lists: at most this many messages, or what arrived within this many seconds. 4,096 messages
#: are ~0.2 s of the router's work at most, so the other agents of the worker wait no longer than that.
_BULK_MAX = 4096
_BULK_WITHIN_S = 0.05
#: Messages of the job topics Faust reads ahead of the agent (PhaseBatch messages are ~4 kB at 146 phases: 32 MB).
_JOB_BUFFER = 2 * _BULK_MAX
#: Seconds between two looks at the L3 parts waiting for what another worker shares.
_SHARED_TICK_S = 0.5


def install_diagnosis(app: faust.App, settings: Settings, params: DiagnosisParams | None = None,
                      max_pending: int = 200_000, max_jobs: int = 10_000, final_wait_s: float = 30.0,
                      dead: DeadLetters | None = None) -> DiagnosisStats:
    """Add the diagnosis agents to ``app``; returns their live counters.

    ``max_pending``: messages held per job (or L3 part) before the oldest half is acked. ``max_jobs``: jobs
    whose context is kept. ``final_wait_s``: how long an ended L3 part waits for an idle job agent to finish
    the job's steps (:class:`~argus.streams.final_router.FinalRouter`). ``dead``: where rejected records go
    (default: a :class:`DeadLetters` on the dead-letter topic).
    """
    params = params or DiagnosisParams(min_impact_fraction=settings.detector.min_impact_fraction)
    stats = DiagnosisStats()
    names = {t.full(settings): t for t in (Topic.STEPS, Topic.PHASES, Topic.TOPOLOGY, Topic.LIFECYCLE,
                                           Topic.HEARTBEATS)}
    # Read ahead by lists: with the app's small per-stream buffer (sized for kernel batches of tens of KB) Faust
    # pauses the job topics' fetch after every 256 messages of ~40 B-4 kB and the agent waits on the broker.
    job_input = app.topic(*names, key_type=bytes, value_type=bytes, maxsize=_JOB_BUFFER)
    summaries = app.topic(Topic.SUMMARIES.full(settings), key_type=bytes, value_type=bytes)
    if dead is None:
        dead = DeadLetters(app.topic(Topic.DEAD_LETTER.full(settings), key_type=bytes, value_type=bytes))
    # What other workers know of their jobs (and this one of its own, read back): topology, groups,
    # stragglers, steps, and every L3 part's totals (see argus.streams.job_context).
    shared = ContextTable(settings, max_jobs, stats)

    def decode_job_record(event: EventT) -> JobRecord:
        return cast(JobRecord, RECORD_OF[names[event.message.topic]].decode(event.value))

    def where(event: EventT) -> str:
        msg = event.message
        return f"{msg.topic}[{msg.partition}]@{msg.offset}"

    def remote(job_id: str) -> JobContext | None:
        return shared.get(job_id).get(CONTEXT_JOB_PART)

    jobs: JobRouter[EventT] = JobRouter(settings.worker, settings.partitions, params, stats, decode_job_record,
                                        detector_version(params, settings), remote, max_pending, max_jobs,
                                        final_wait_s, where, time.monotonic())
    # L3 per (job, summaries partition): a job's keys spread over partitions, each finishes alone.
    parts: SummaryRouter[EventT] = SummaryRouter(params, stats, lambda e: KernelSummary.decode(e.value),
                                                 settings.partitions, settings.l3_max_windows, max_pending, max_jobs)
    finals: FinalRouter[EventT] = FinalRouter(parts, jobs, jobs.ledger, shared, params, stats, settings.partitions,
                                              functools.partial(holds_job, app, settings),
                                              settings.job_idle_timeout_s, final_wait_s, time.monotonic())
    shell = DiagnosisShell(app, settings, names, jobs, parts, finals, shared, stats, dead)
    scan = LifecycleScan(functools.partial(scan_diagnosed, settings), jobs.ledger, shared.start)

    @app.agent(job_input, name="argus.diagnose-jobs")
    async def diagnose_jobs(stream: Any) -> Any:
        await scan.wait()
        # In lists, each decoded at once (argus.streams.job_intake), never acked by Faust: each message is acked
        # by the router's effects, after what it caused was delivered.
        async for events in stream.noack_take(_BULK_MAX, within=_BULK_WITHIN_S):
            await shell.take_jobs(events)
            yield None

    @app.agent(summaries, name="argus.diagnose-kernels")
    async def diagnose_kernels(stream: Any) -> Any:
        await scan.wait()
        async for event in stream.noack().events():
            await shell.take_summary(event)
            yield None

    @app.timer(interval=jobs.idle_tick_s, name="argus.idle-jobs")
    async def abandon_idle_jobs() -> None:
        await shell.idle_tick()

    @app.timer(interval=jobs.hang_tick_s, name="argus.hangs")
    async def judge_hangs() -> None:
        await shell.hang_tick()

    @app.timer(interval=_SHARED_TICK_S, name="argus.shared-context")
    async def take_shared_context() -> None:
        await shell.final_tick()

    @app.on_partitions_revoked.connect  # type: ignore[arg-type]
    async def on_revoked(sender: Any, *args: Any, **kwargs: Any) -> None:
        shell.revoked()  # un-acked messages come back from the committed offsets after the rebalance

    return stats
