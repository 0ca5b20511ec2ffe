"""Faust agents of the progressive diagnosis: L1/L2 per job, L3 per (job, kernel, stream).

* ``argus.diagnose-jobs`` reads steps, phases, topology and lifecycle records, all keyed by job (so one
  job's records meet on one worker), feeds :class:`argus.streams.diagnosis.JobDiagnosis`, publishes findings
  as they appear (live, every few complete steps) and, once the END's record counts have all arrived, the
  final ones followed by a ``DIAGNOSED`` lifecycle record with part ``l1l2``.
* ``argus.diagnose-kernels`` reads kernel summaries keyed by (job, kernel, stream), feeds
  :class:`argus.streams.diagnosis.KernelDiagnosis` and judges each window once the next one begins. Every
  compressor partition ends a job with a marker on every summaries partition; when one partition has the
  markers of all kernel partitions, all of the job's summaries there have arrived: final L3, then
  ``DIAGNOSED`` with part ``l3/<partition>``. When this worker holds the job's partition of the job topics,
  the final L3 waits (without blocking the agent) until the job agent has the job's final steps, groups and
  stragglers, so impacts are judged against the final step time and victims are known; it gives up when the
  job is not open there and the job agent read nothing for ``final_wait_s``. The summaries also feed the job's
  :class:`argus.streams.diagnosis.RankDiagnosis`, judged before the DIAGNOSED of the last partition this worker
  finishes the job on, when this worker has held all partitions of the job.

Both agents are thin shells: the job agent takes its messages in lists, decodes each list at once
(:class:`~argus.streams.job_intake.JobIntake`: steps and phases by columns) and hands the records, in their
order, to its :class:`~argus.streams.job_router.JobRouter`, the L3 agent each summary to its
:class:`~argus.streams.summary_router.SummaryRouter` (what to hold, ack, dead-letter, publish and judge;
unit-tested without a broker), and each carries out what its router answers, in order; the timers (idle jobs,
hangs) ask the job router too.

Each DIAGNOSED record lists the ids of the job's findings published before it, so ``argus findings --wait``
can wait for those findings (and the job's records) to be stored, not only for the markers.

**Exactly once from at-least-once.** A Step or PhaseBatch delivered twice (a producer re-send, a replay)
counts once: the job agent keeps the (rank, step) pairs it took per job and acks copies without adding them.
Kernel summaries come in pieces (:mod:`argus.streams.windows`): a copy of a piece already taken is dropped, a
larger copy replaces it, and different pieces of one (rank, window) are merged into one row (clusters
concatenated) before L3 judges the window, again if a piece arrives after its judgement. At start the agents
read the lifecycle topic for DIAGNOSED records (and keep reading them live): a job whose L1/L2 part was
diagnosed is not diagnosed live again when a restart re-reads it (only its final diagnosis is recomputed, for
L3's step times and straggler ranks, and republished under the same ids; a finished job's records stay un-acked
until all its L3 parts are DIAGNOSED, so a restart before then can recompute it), and a diagnosed L3 part re-read
feeds only the job's rank aggregate, so a finished job never gets new findings.

``argus findings --wait`` waits for all those DIAGNOSED parts. Messages are acked once their job is
finished here (or, for very long jobs, once ``max_pending`` messages of the job are held), so a restarted
worker rebuilds live state from the log. Findings have deterministic ids, so re-runs never double them.
The topology used by L3 is the one this worker has read (the topology topic is keyed by job); with several
workers a job's topology may be read by another worker, and L3 then compares ranks job-wide.

**Jobs that never end.** A job with no record for ``Settings.job_idle_timeout_s`` (the worker's clock: the
only thing event time cannot tell is that nothing arrived), or the longest idle one beyond
``Settings.max_open_jobs``, is abandoned by the job agent that holds it: it writes a lifecycle record
``ABANDONED`` (reason, last step), keyed by job, so exactly one worker writes it. Read back from the log, the
record closes the job like an END: final L1/L2 on what arrived, DIAGNOSED ``l1l2``, state dropped, held
messages acked; the compressor turns the same record into job-end markers, so the job's open windows are
summarized and every L3 part finishes. A replay closes the job at the same record.

**Liveness.** The job agent also reads heartbeats (acked at once) and keeps per job and rank the last step,
phase and collective seen (:class:`argus.streams.liveness.JobLiveness`); a worker timer judges running jobs with
:mod:`argus.detectors.hangs` and publishes ``job_stalled``, ``rank_silent``, ``hang_wavefront`` and, at the next
completed step, ``job_resumed`` like every other finding.

**One record never stops an agent.** A record of a rank outside its job (not in the topology, or not below
the job's world size) is dead-lettered on arrival (stage ``diagnose-jobs`` / ``diagnose-kernels``; of a
summary only such rows are dropped). A record whose processing raises anything else is dead-lettered with the
exception, acked, and its job's state is repaired: rebuilt from the job's held records without the rejected
ones (the record itself is kept if the rebuilt state then works), or, if it still fails, discarded (its held
records acked undiagnosed; they stay in ClickHouse). Undecodable records are acked and counted here; the sink
dead-letters them. A dead letter that cannot be delivered raises :class:`~argus.core.errors.DeadLetterError`
without acking, so the commit never passes it. L3 keeps the rows of at most ``Settings.l3_max_windows`` judged windows
per (job, kernel, stream), and of older windows what their judgement found.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence
from typing import Any, cast

import faust
from faust.types import EventT

from argus.core.errors import DeadLetterError, SchemaError, failure_reason
from argus.core.settings import Settings
from argus.detectors.findings import finding_json
from argus.schemas.job_context import CONTEXT_JOB_PART, JobContext
from argus.schemas.records import Finding, JobLifecycle, KernelSummary
from argus.streams.dead_letters import DeadLetters
from argus.streams.diagnosis import DiagnosisParams, RankDiagnosis, detector_version
from argus.streams.diagnosis_stats import DiagnosisStats
from argus.streams.job_context import ContextTable, context_totals, send_context, totals_context
from argus.streams.job_intake import JobIntake
from argus.streams.job_router import (
    Abandon,
    Ack,
    FinishParts,
    Forget,
    JobRecord,
    JobRouter,
    JobStep,
    Mark,
    Publish,
    Reject,
    Release,
    Share,
)
from argus.streams.lifecycle_scan import scan_diagnosed
from argus.streams.summary_router import SummaryRouter, SummaryStep
from argus.topics import RECORD_OF, Topic, job_key, key_partition

__all__ = ["install_diagnosis"]

log = logging.getLogger(__name__)

#: The job agent's lists: at most this many messages, or what arrived within this many seconds. 4,096 messages
#: are ~0.2 s of the router's work at most, so the other agents of the worker wait no longer than that.
_BULK_MAX = 4096
_BULK_WITHIN_S = 0.05
#: Messages of the job topics Faust reads ahead of the agent (PhaseBatch messages are ~4 kB at 146 phases: 32 MB).
_JOB_BUFFER = 2 * _BULK_MAX


def install_diagnosis(app: faust.App, settings: Settings, params: DiagnosisParams | None = None,
                      max_pending: int = 200_000, max_jobs: int = 10_000, final_wait_s: float = 30.0,
                      dead: DeadLetters | None = None) -> DiagnosisStats:
    """Add the diagnosis agents to ``app``; returns their live counters.

    ``dead``: where rejected records go (default: a :class:`DeadLetters` on the dead-letter topic).
    """
    params = params or DiagnosisParams(min_impact_fraction=settings.detector.min_impact_fraction)
    stats = DiagnosisStats()
    names = {t.full(settings): t for t in (Topic.STEPS, Topic.PHASES, Topic.TOPOLOGY, Topic.LIFECYCLE,
                                           Topic.HEARTBEATS)}
    # Read ahead by lists: with the app's small per-stream buffer (sized for kernel batches of tens of KB) Faust
    # pauses the job topics' fetch after every 256 messages of ~40 B-4 kB and the agent waits on the broker.
    job_input = app.topic(*names, key_type=bytes, value_type=bytes, maxsize=_JOB_BUFFER)
    summaries = app.topic(Topic.SUMMARIES.full(settings), key_type=bytes, value_type=bytes)
    findings_topic = app.topic(Topic.FINDINGS.full(settings), key_type=bytes, value_type=bytes)
    findings_json_topic = app.topic(Topic.FINDINGS_JSON.full(settings), key_type=bytes, value_type=bytes)
    lifecycle = app.topic(Topic.LIFECYCLE.full(settings), key_type=bytes, value_type=bytes)
    context_topic = app.topic(Topic.CONTEXT.full(settings), key_type=bytes, value_type=bytes)
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

    intake = JobIntake()
    revocations = [0]  # partitions revoked so far: a list taken across a rebalance stops there
    jobs: JobRouter[EventT] = JobRouter(settings.worker, settings.partitions, params, stats, decode_job_record,
                                        detector_version(params, settings), remote, max_pending, max_jobs,
                                        final_wait_s, where, time.monotonic())
    known = jobs.ledger  # the jobs' context, published ids and DIAGNOSED parts: the L3 router's view
    # L3 per (job, summaries partition): a job's keys spread over partitions, each finishes alone.
    router: SummaryRouter[EventT] = SummaryRouter(params, stats, lambda e: KernelSummary.decode(e.value),
                                                  settings.partitions, settings.l3_max_windows, max_pending,
                                                  max_jobs)
    # Part 0 of a job waiting for the other parts' totals before its rank aggregate: (part, event, failures, since);
    # the final L3 parts waiting for their job's final steps, and the worker-clock time they began to.
    pending_ranks: dict[str, tuple[tuple[str, int], EventT, list[str], float]] = {}
    pending_finals: dict[str, list[tuple[KernelSummary, tuple[str, int], EventT]]] = {}
    pending_since: dict[str, float] = {}
    tombstones: set[asyncio.Future[Any]] = set()
    # Worker-clock time the job agent last took a record: while it reads, a job it holds may still finish.
    job_agent_read = [time.monotonic()]
    scan: list[asyncio.Future[dict[str, set[str]]]] = []

    async def read_diagnosed() -> None:
        """Once per worker, before the first record: the DIAGNOSED parts already on the lifecycle topic."""
        if not scan:
            shared.start()
            scan.append(asyncio.ensure_future(asyncio.get_running_loop().run_in_executor(
                None, scan_diagnosed, settings)))
            for job_id, parts in (await scan[0]).items():
                known.add_diagnosed(job_id, parts)
            log.info("%d jobs already (partly) diagnosed on the lifecycle topic", len(await scan[0]))
        else:
            await scan[0]

    async def publish(findings: Sequence[Finding], hangs: bool = False) -> None:
        """Send findings the ledger stamped and filtered (:meth:`JobLedger.publishable`); all delivered."""
        futs = [await findings_topic.send(key=job_key(f.job_id), value=f.encode(), force=True) for f in findings]
        futs += [await findings_json_topic.send(key=job_key(f.job_id), force=True,
                                                value=json.dumps(finding_json(f), sort_keys=True).encode())
                 for f in findings]
        for fut in futs:
            await fut
        if not findings:
            return
        stats.findings += len(findings)
        if hangs:
            stats.hang_findings += len(findings)
        stats.last_finding_ns = time.time_ns()
        for f in findings:
            by_kind = stats.findings_by_kind.setdefault(f.level.value, {})
            by_kind[f.kind.value] = by_kind.get(f.kind.value, 0) + 1
            stats.observe_impact(f.kind.value, f.impact_ns_per_step)
            if f.time_ns > 0:
                stats.finding_delay_s.observe(max(0.0, (stats.last_finding_ns - f.time_ns) / 1e9))
            log.info("finding %s %s job=%s ranks=%s phase=%s kernel=%s steps=%s score=%.2f", f.level.value,
                     f.kind.value, f.job_id, list(f.ranks), f.phase, f.kernel, list(f.steps), f.score)

    async def send(topic: Any, key: bytes, value: bytes) -> None:
        fut = await topic.send(key=key, value=value, force=True)
        await fut

    async def share(ctx: JobContext) -> None:
        """Write a part of a job's context in pieces of at most ``context_max_bytes``; then it is known here."""
        shared.put(await send_context(context_topic, ctx, settings.context_max_bytes, settings.partitions))

    async def reject(event: EventT, stage: str, reason: str, job_id: str, rank: int | None = None) -> None:
        await dead.send(event, stage, reason, job=job_id, rank=rank)
        stats.dead_letters += 1

    def forget_context(job_id: str) -> None:
        """Tombstones for the job's context parts: a diagnosed job leaves nothing on the compacted topic."""
        parts = (CONTEXT_JOB_PART, *(f"l3/{p}" for p in range(settings.partitions)))
        for key, partition in shared.tombstones(job_id, parts):
            task = asyncio.ensure_future(context_topic.send(key=key, value=None, partition=partition, force=True))
            tombstones.add(task)
            task.add_done_callback(tombstones.discard)
        for part in parts:
            shared.forget(job_id, part)

    async def carry_out(step: JobStep[EventT]) -> None:
        """Do what the job router said, in its order, each effect delivered before the next."""
        for e in step.effects:
            if isinstance(e, Publish):
                await publish(e.findings, e.hangs)
            elif isinstance(e, Share):
                await share(e.context)
            elif isinstance(e, Mark):
                await mark(e.record, e.release)
            elif isinstance(e, Abandon):
                await send(lifecycle, job_key(e.record.job_id), e.record.encode())
            elif isinstance(e, Reject):
                await reject(e.handle, "diagnose-jobs", e.reason, e.job, e.rank)
            elif isinstance(e, Ack):
                for h in e.handles:
                    h.ack()
            elif isinstance(e, FinishParts):
                pending_since.pop(e.job_id, None)
                for args in pending_finals.pop(e.job_id, []):
                    await finish_part(*args)
            elif isinstance(e, Release):
                await carry_out(jobs.release(e.job_id, time.monotonic()))
            elif isinstance(e, Forget):
                router.forget_job(e.job_id)
                if e.tombstones:  # its writer forgets the job on the context topic too
                    forget_context(e.job_id)

    async def mark(rec: JobLifecycle, release: bool = True) -> None:
        """Write a DIAGNOSED record; once delivered, what it frees (held records, the job's context)."""
        await send(lifecycle, job_key(rec.job_id), rec.encode())
        await carry_out(jobs.marked(rec, time.monotonic(), release))

    @app.timer(interval=jobs.idle_tick_s, name="argus.idle-jobs")
    async def abandon_idle_jobs() -> None:
        await carry_out(jobs.idle_jobs(time.monotonic(), time.time_ns()))
        jobs.refresh_stats(time.monotonic(), router.held_by_job(), router.jobs())

    @app.timer(interval=jobs.hang_tick_s, name="argus.hangs")
    async def judge_hangs() -> None:
        for effect in jobs.judge_hangs(time.monotonic()).effects:
            try:
                await carry_out(JobStep((effect,)))
            except DeadLetterError:
                raise
            except Exception as exc:  # liveness of one job must not stop the others' (nor the agent)
                log.error("hang findings not published: %s", failure_reason(exc))

    async def take_job_record(rec: JobRecord | SchemaError, event: EventT) -> None:
        if isinstance(rec, SchemaError):
            stats.undecodable += 1  # the sink dead-letters it with the reason
            event.ack()
            return
        stats.records += 1
        job_agent_read[0] = time.monotonic()
        step = jobs.take(rec, event, time.monotonic())
        try:
            await carry_out(step)
        except DeadLetterError:
            raise
        except Exception as exc:  # a send failed: repaired as a record whose processing raised
            await carry_out(jobs.failed(rec, event, exc, time.monotonic()))

    @app.agent(job_input, name="argus.diagnose-jobs")
    async def diagnose_jobs(stream: Any) -> Any:
        await read_diagnosed()
        # In lists, each decoded at once (argus.streams.job_intake), never acked by Faust: each message is acked
        # by the router's effects, after what it caused was delivered.
        async for events in stream.noack_take(_BULK_MAX, within=_BULK_WITHIN_S):
            revoked = revocations[0]
            assigned = app.consumer.assignment()
            # Messages buffered before a rebalance took their partition away are re-delivered to the new holder.
            taken = [e for e in events if e.message.tp in assigned]
            records = intake.decode([(names[e.message.topic], e.value) for e in taken])
            for rec, event in zip(records, taken, strict=True):
                if revocations[0] != revoked:  # revoked meanwhile: the rest comes back from the committed offsets
                    break
                await take_job_record(rec, event)
            yield None

    def holds_job(job_id: str) -> bool:
        """Whether this worker's job agent reads ``job_id``'s records (its partition of the job topics)."""
        tp = (Topic.STEPS.full(settings), key_partition(job_key(job_id), settings.partitions))
        return any((t.topic, t.partition) == tp for t in app.consumer.assignment())

    async def carry_out_l3(step: SummaryStep[EventT], s: KernelSummary, event: EventT) -> None:
        """Do what the L3 router said, in its order: dead letters, findings, acks; then end the part."""
        for r in step.rejected:
            await reject(event, "diagnose-kernels", r.reason, s.job_id, r.rank)
        await publish(known.publishable(step.findings))
        for e in step.ack:
            e.ack()
        if step.ended is not None:
            await end_part(s, step.ended, event)

    async def end_part(s: KernelSummary, part: tuple[str, int], event: EventT) -> None:
        """All of the part's summaries of the job are in: its final L3 now, or, while the job agent here has
        not finished the job's steps yet (after a restart it re-reads them), once it has (:class:`FinishParts`).
        Waiting never blocks this agent: the job agent may need the fetcher this agent would hold up."""
        job_id = s.job_id
        if jobs.ready_for_final(job_id, part[1]):
            await finish_part(s, part, event)
            return
        stats.finals_deferred += 1
        pending_finals.setdefault(job_id, []).append((s, part, event))
        pending_since.setdefault(job_id, time.monotonic())

    async def give_up_finals(now: float) -> None:
        """Judge the final L3 parts whose job's final steps are known now (shared by the job's holder), or will
        not come: the job is held here, not open in the job agent, and the agent read nothing for
        ``final_wait_s``; or the parts waited past the idle timeout."""
        cap = settings.job_idle_timeout_s + 4 * final_wait_s
        for job_id, since in list(pending_since.items()):
            idle = not jobs.is_open(job_id) and holds_job(job_id) and now - max(since, job_agent_read[0]) > final_wait_s
            if not known.steps_final(job_id) and not idle and now - since <= cap:
                continue
            del pending_since[job_id]
            waiting = pending_finals.pop(job_id, [])
            log.warning("job %s: final L3 of %d parts without the job's final steps (waited %.0f s)", job_id,
                        len(waiting), now - since)
            stats.finals_without_steps += len(waiting)
            for args in waiting:
                await finish_part(*args)

    async def finish_part(s: KernelSummary, part: tuple[str, int], event: EventT) -> None:
        found, failures = router.final(part, known)
        for findings in found:
            await publish(known.publishable(findings))
        known.part_done(s.job_id, part[1])
        totals = totals_context(s.job_id, part[1], *router.rank_totals(s.job_id, part[1]))
        await share(totals)
        if part[1] == 0 and not await judge_ranks(s.job_id, failures, final=False):
            # Part 0 judges the job's rank aggregate once every part's totals are in (other parts may run on
            # other workers): its DIAGNOSED waits, so `findings --wait` includes the aggregate's findings.
            pending_ranks[s.job_id] = (part, event, failures, time.monotonic())
            return
        await close_part(s.job_id, part, event, failures)
        if s.job_id in pending_ranks:  # part 0 waits here for this part's totals
            await judge_pending_ranks(time.monotonic())

    async def judge_ranks(job_id: str, failures: list[str], final: bool) -> bool:
        """The job's rank aggregate from every L3 part's totals (published); ``False`` while a part's are
        missing, unless ``final`` (then judged on those that came)."""
        parts = shared.get(job_id)
        missing = [p for p in range(settings.partitions) if f"l3/{p}" not in parts]
        if missing and not final:
            return False
        if missing:
            log.warning("job %s: rank aggregate without the totals of L3 parts %s (pieces read, of: %s)", job_id,
                        missing, shared.incomplete(job_id))
        merged = RankDiagnosis(job_id, params)
        for p in range(settings.partitions):
            ctx = parts.get(f"l3/{p}")
            if ctx is not None:
                merged.add_totals(context_totals(ctx), ctx.time_ns)
        try:
            await publish(known.publishable(merged.diagnose(known.topology_of(job_id), known.clock_of(job_id))))
        except DeadLetterError:
            raise
        except Exception as exc:
            failures.append(f"rank aggregate of job {job_id}: {failure_reason(exc)}")
        return True

    async def close_part(job_id: str, part: tuple[str, int], event: EventT, failures: list[str]) -> None:
        if failures:
            stats.states_discarded += len(failures)
            await reject(event, "diagnose-kernels", "; ".join(failures), job_id)
        topo = known.topology_of(job_id)
        last_ns, held = router.close(part)
        await mark(known.diagnosed_record(job_id, f"l3/{part[1]}", last_ns, topo.world_size if topo else 0))
        stats.l3_parts_diagnosed += 1
        for e in held:
            e.ack()

    async def judge_pending_ranks(now: float) -> None:
        """Part 0s whose job's totals are all in now, or that waited past the cap: their rank aggregate."""
        cap = settings.job_idle_timeout_s + 4 * final_wait_s
        for job_id in list(pending_ranks):
            # Taken out before judging: the timer and a part's end may both get here for one job.
            entry = pending_ranks.pop(job_id, None)
            if entry is None:
                continue
            part, event, failures, since = entry
            if await judge_ranks(job_id, failures, final=now - since > cap):
                await close_part(job_id, part, event, failures)
            else:
                pending_ranks.setdefault(job_id, entry)

    async def take_summary(s: KernelSummary, event: EventT, part: tuple[str, int]) -> None:
        await carry_out_l3(router.take(s, event, part[1], known), s, event)

    async def summary_failed(s: KernelSummary, event: EventT, part: tuple[str, int], exc: Exception) -> None:
        msg = event.message
        log.error("job %s: summary of %r stream %s at %s[%d]@%d raised %s; repairing its L3 state", s.job_id,
                  s.kernel, s.stream, msg.topic, msg.partition, msg.offset, failure_reason(exc))
        await carry_out_l3(router.failed(s, event, part[1], exc, known), s, event)

    @app.timer(interval=0.5, name="argus.shared-context")
    async def take_shared_context() -> None:
        """L3 parts waiting for what another worker shares: the job's final steps, the other parts' totals."""
        now = time.monotonic()
        try:
            await give_up_finals(now)
            await judge_pending_ranks(now)
        except DeadLetterError:
            raise
        except Exception:  # a timer that raises is not run again: log it and go on at the next tick
            log.exception("judging the L3 parts that wait for shared context failed")

    @app.agent(summaries, name="argus.diagnose-kernels")
    async def diagnose_kernels(stream: Any) -> Any:
        await read_diagnosed()
        async for event in stream.noack().events():
            try:
                s = KernelSummary.decode(event.value)
            except SchemaError:
                stats.undecodable += 1
                event.ack()
                continue
            part = (s.job_id, event.message.partition)
            try:
                await take_summary(s, event, part)
            except DeadLetterError:
                raise
            except Exception as exc:
                await summary_failed(s, event, part, exc)
            yield None

    @app.on_partitions_revoked.connect  # type: ignore[arg-type]
    async def on_revoked(sender: Any, *args: Any, **kwargs: Any) -> None:
        # Un-acked messages come back from the committed offsets after the rebalance.
        revocations[0] += 1
        router.revoked()
        jobs.revoked()
        for d in (pending_finals, pending_since, pending_ranks):
            d.clear()

    return stats
