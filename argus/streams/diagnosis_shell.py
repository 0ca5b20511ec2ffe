"""What the diagnosis agents do on Kafka: the routers' answers carried out, in their order.

:class:`DiagnosisShell` decodes what the agents of :mod:`argus.streams.diagnosis_agents` read, hands it to the
job router, the L3 router and the final router (:mod:`argus.streams.final_router`), and carries out their
effects: findings published, context and lifecycle records written, dead letters, acks. It holds only I/O state:
the tombstones in flight, the rebalances seen, the one scan of the lifecycle topic (:class:`LifecycleScan`).
A dead letter that cannot be delivered raises :class:`~argus.core.errors.DeadLetterError` without acking.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import faust
from faust.types import EventT

from argus.core.errors import DeadLetterError, SchemaError, failure_reason
from argus.core.settings import Settings
from argus.detectors.findings import finding_json
from argus.schemas.records import Finding, KernelSummary
from argus.streams.dead_letters import DeadLetters
from argus.streams.diagnosis_stats import DiagnosisStats
from argus.streams.final_router import Discard, FinalEffect, FinalRouter, ShareTotals, Tombstone
from argus.streams.job_context import ContextTable, send_context
from argus.streams.job_effects import (
    Abandon,
    Ack,
    Effect,
    FinishParts,
    Forget,
    JobRecord,
    Mark,
    Publish,
    Reject,
    Release,
    Share,
)
from argus.streams.job_intake import JobIntake
from argus.streams.job_ledger import JobLedger
from argus.streams.job_router import JobRouter
from argus.streams.summary_router import SummaryRouter, SummaryStep
from argus.topics import Topic, job_key, key_partition

__all__ = ["DiagnosisShell", "LifecycleScan", "holds_job"]

log = logging.getLogger(__name__)


def holds_job(app: faust.App, settings: Settings, job_id: str) -> bool:
    """Whether this worker's job agent reads ``job_id``'s records (its partition of the job topics)."""
    tp = (Topic.STEPS.full(settings), key_partition(job_key(job_id), settings.partitions))
    return any((t.topic, t.partition) == tp for t in app.consumer.assignment())


class LifecycleScan:
    """The DIAGNOSED parts already on the lifecycle topic, read once (``read``, in a thread) into ``known``
    before either agent's first record; ``start``: called once as the scan begins (the context table's reader).
    Every caller of :meth:`wait` returns once they are in ``known``; a failed scan raises in each."""

    def __init__(self, read: Callable[[], Mapping[str, set[str]]], known: JobLedger,
                 start: Callable[[], None] = lambda: None) -> None:
        self._read, self._known, self._start = read, known, start
        self._scan: asyncio.Future[None] | None = None

    async def wait(self) -> None:
        if self._scan is None:
            self._start()
            self._scan = asyncio.ensure_future(self._run())
        await self._scan

    async def _run(self) -> None:
        found = await asyncio.get_running_loop().run_in_executor(None, self._read)
        for job_id, parts in found.items():
            self._known.add_diagnosed(job_id, parts)
        log.info("%d jobs already (partly) diagnosed on the lifecycle topic", len(found))


class DiagnosisShell:
    """The diagnosis agents' I/O (see the module's docstring). ``names``: the job topics' full names."""

    def __init__(self, app: faust.App, settings: Settings, names: Mapping[str, Topic], jobs: JobRouter[EventT],
                 summaries: SummaryRouter[EventT], finals: FinalRouter[EventT], shared: ContextTable,
                 stats: DiagnosisStats, dead: DeadLetters) -> None:
        self.app, self.settings, self.names, self.jobs, self.summaries = app, settings, names, jobs, summaries
        self.finals = finals
        self.known, self.shared, self.stats, self.dead = jobs.ledger, shared, stats, dead
        topic = {t: app.topic(t.full(settings), key_type=bytes, value_type=bytes)
                 for t in (Topic.FINDINGS, Topic.FINDINGS_JSON, Topic.LIFECYCLE, Topic.CONTEXT)}
        self._findings, self._findings_json = topic[Topic.FINDINGS], topic[Topic.FINDINGS_JSON]
        self._lifecycle, self._context = topic[Topic.LIFECYCLE], topic[Topic.CONTEXT]
        self.intake = JobIntake()
        self.revocations = 0  # partitions revoked so far: a list taken across a rebalance stops there
        self._tombstones: set[asyncio.Future[Any]] = set()

    # -- what the agents and timers call -----------------------------------------------------------------------

    async def take_jobs(self, events: Sequence[EventT]) -> None:
        """A list of the job topics' messages, decoded at once; each acked by the router's effects."""
        revoked = self.revocations
        assigned = self.app.consumer.assignment()
        # Messages buffered before a rebalance took their partition away are re-delivered to the new holder.
        taken = [e for e in events if e.message.tp in assigned]
        records = self.intake.decode([(self.names[e.message.topic], e.value) for e in taken])
        for rec, event in zip(records, taken, strict=True):
            if self.revocations != revoked:  # revoked meanwhile: the rest comes back from the committed offsets
                break
            await self._take_job_record(rec, event)

    async def take_summary(self, event: EventT) -> None:
        try:
            s = KernelSummary.decode(event.value)
        except SchemaError:
            self.stats.undecodable += 1  # the sink dead-letters it with the reason
            event.ack()
            return
        partition = event.message.partition
        try:
            await self._carry_out_l3(self.summaries.take(s, event, partition, self.known), s, event)
        except DeadLetterError:
            raise
        except Exception as exc:
            msg = event.message
            log.error("job %s: summary of %r stream %s at %s[%d]@%d raised %s; repairing its L3 state", s.job_id,
                      s.kernel, s.stream, msg.topic, msg.partition, msg.offset, failure_reason(exc))
            await self._carry_out_l3(self.summaries.failed(s, event, partition, exc, self.known), s, event)

    async def idle_tick(self) -> None:
        await self.carry_out(self.jobs.idle_jobs(time.monotonic(), time.time_ns()).effects)
        self.jobs.refresh_stats(time.monotonic(), self.summaries.held_by_job(), self.summaries.jobs())

    async def hang_tick(self) -> None:
        for effect in self.jobs.judge_hangs(time.monotonic()).effects:
            try:
                await self.carry_out((effect,))
            except DeadLetterError:
                raise
            except Exception as exc:  # liveness of one job must not stop the others' (nor the agent)
                log.error("hang findings not published: %s", failure_reason(exc))

    async def final_tick(self) -> None:
        """L3 parts waiting for what another worker shares: the job's final steps, the other parts' totals."""
        try:
            await self.carry_out(self.finals.tick(time.monotonic()))
        except DeadLetterError:
            raise
        except Exception:  # a timer that raises is not run again: log it and go on at the next tick
            log.exception("judging the L3 parts that wait for shared context failed")

    def revoked(self) -> None:
        """Partitions were revoked: every router forgets; un-acked messages come back from the committed offsets."""
        self.revocations += 1
        self.summaries.revoked()
        self.jobs.revoked()
        self.finals.revoked()

    # -- carrying out ------------------------------------------------------------------------------------------

    async def carry_out(self, effects: Iterable[Effect[EventT] | FinalEffect[EventT]]) -> None:
        """Do what a router said, in its order, each effect delivered before the next."""
        most = self.settings.worker.context_max_bytes  # each context goes in pieces of at most this many bytes
        for e in effects:
            if isinstance(e, Publish):
                await self.publish(e.findings, e.hangs)
            elif isinstance(e, Share):  # once sent, it is known here
                self.shared.put(await send_context(self._context, e.context, most, self.settings.partitions))
            elif isinstance(e, ShareTotals):  # the final router has put them in the table already
                await send_context(self._context, e.context, most, self.settings.partitions)
            elif isinstance(e, Mark):
                await self._send(self._lifecycle, job_key(e.record.job_id), e.record.encode())
                await self.carry_out(self.jobs.marked(e.record, time.monotonic(), e.release).effects)
            elif isinstance(e, Abandon):
                await self._send(self._lifecycle, job_key(e.record.job_id), e.record.encode())
            elif isinstance(e, Reject):
                await self._reject(e.handle, "diagnose-jobs", e.reason, e.job, e.rank)
            elif isinstance(e, Discard):
                await self._reject(e.handle, "diagnose-kernels", e.reason, e.job)
            elif isinstance(e, Ack):
                for h in e.handles:
                    h.ack()
            elif isinstance(e, FinishParts):
                await self.carry_out(self.finals.finish_waiting(e.job_id, time.monotonic()))
            elif isinstance(e, Release):
                await self.carry_out(self.jobs.release(e.job_id, time.monotonic()).effects)
            elif isinstance(e, Forget):
                await self.carry_out(self.finals.forget(e.job_id, e.tombstones))
            elif isinstance(e, Tombstone):
                self._tombstone(e)

    async def publish(self, findings: Sequence[Finding], hangs: bool = False) -> None:
        """Send findings the ledger stamped and filtered (:meth:`JobLedger.publishable`); all delivered."""
        futs = [await self._findings.send(key=job_key(f.job_id), value=f.encode(), force=True) for f in findings]
        futs += [await self._findings_json.send(key=job_key(f.job_id), force=True,
                                                value=json.dumps(finding_json(f), sort_keys=True).encode())
                 for f in findings]
        for fut in futs:
            await fut
        if findings:
            self._count(findings, hangs)

    async def _take_job_record(self, rec: JobRecord | SchemaError, event: EventT) -> None:
        if isinstance(rec, SchemaError):
            self.stats.undecodable += 1  # the sink dead-letters it with the reason
            event.ack()
            return
        self.stats.records += 1
        now = time.monotonic()
        self.finals.job_read(now)
        step = self.jobs.take(rec, event, now)
        try:
            await self.carry_out(step.effects)
        except DeadLetterError:
            raise
        except Exception as exc:  # a send failed: repaired as a record whose processing raised
            await self.carry_out(self.jobs.failed(rec, event, exc, time.monotonic()).effects)

    async def _carry_out_l3(self, step: SummaryStep[EventT], s: KernelSummary, event: EventT) -> None:
        """Do what the L3 router said, in its order: dead letters, findings, acks; then end the part."""
        for r in step.rejected:
            await self._reject(event, "diagnose-kernels", r.reason, s.job_id, r.rank)
        await self.publish(self.known.publishable(step.findings))
        for e in step.ack:
            e.ack()
        if step.ended is not None:
            await self.carry_out(self.finals.ended(step.ended, event, time.monotonic()))

    async def _send(self, topic: Any, key: bytes, value: bytes) -> None:
        fut = await topic.send(key=key, value=value, force=True)
        await fut

    async def _reject(self, event: EventT, stage: str, reason: str, job_id: str, rank: int | None = None) -> None:
        await self.dead.send(event, stage, reason, job=job_id, rank=rank)
        self.stats.dead_letters += 1

    def _tombstone(self, e: Tombstone) -> None:
        """Written without waiting: nothing waits for a diagnosed job's context to go."""
        for key, partition in self.shared.tombstones(e.job_id, [e.part]):  # every piece written
            task = asyncio.ensure_future(self._context.send(key=key, value=None, partition=partition, force=True))
            self._tombstones.add(task)
            task.add_done_callback(self._tombstones.discard)

    def _count(self, findings: Sequence[Finding], hangs: bool) -> None:
        st = self.stats
        st.findings += len(findings)
        if hangs:
            st.hang_findings += len(findings)
        st.last_finding_ns = time.time_ns()
        for f in findings:
            by_kind = st.findings_by_kind.setdefault(f.level.value, {})
            by_kind[f.kind.value] = by_kind.get(f.kind.value, 0) + 1
            st.observe_impact(f.kind.value, f.impact_ns_per_step)
            if f.time_ns > 0:
                st.finding_delay_s.observe(max(0.0, (st.last_finding_ns - f.time_ns) / 1e9))
            log.info("finding %s %s job=%s ranks=%s phase=%s kernel=%s steps=%s score=%.2f", f.level.value,
                     f.kind.value, f.job_id, list(f.ranks), f.phase, f.kernel, list(f.steps), f.score)
