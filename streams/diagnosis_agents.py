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

The L3 agent decodes each summary and hands it to its :class:`~argus.streams.summary_router.SummaryRouter`
(what to hold, ack, dead-letter and judge; unit-tested without a broker), then carries out what it answers.

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
without acking, so the commit never passes it. L3 keeps at most ``Settings.l3_max_windows`` judged windows
per (job, kernel, stream).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections import OrderedDict, defaultdict
from typing import Any, TypeVar

import faust
from confluent_kafka import Consumer, TopicPartition
from faust.types import EventT

from argus.core.errors import DeadLetterError, RejectedRecordError, SchemaError, failure_reason
from argus.core.kafka_security import client_config
from argus.core.settings import Settings
from argus.detectors.findings import finding_json, to_finding
from argus.detectors.hangs import HangParams, HangResult
from argus.detectors.impact import Impact, StepClock
from argus.detectors.victims import straggler_ranks
from argus.schemas.job_context import CONTEXT_JOB_PART, JobContext
from argus.schemas.records import (
    DeadLetter,
    Finding,
    Heartbeat,
    JobLifecycle,
    JobTopology,
    KernelSummary,
    LifecycleEvent,
    ParallelGroup,
    PhaseBatch,
    Record,
    Step,
)
from argus.streams.diagnosis import (
    DiagnosisParams,
    JobDiagnosis,
    LinkLedger,
    RankDiagnosis,
    detector_version,
)
from argus.streams.diagnosis_stats import DiagnosisStats
from argus.streams.idle import IdleJobs, QuietClock, abandon_reason
from argus.streams.job_context import (
    ContextTable,
    context_clock,
    context_groups,
    context_key,
    context_topology,
    context_totals,
    job_context,
    totals_context,
)
from argus.streams.liveness import JobLiveness
from argus.streams.summary_pieces import (
    foreign_ranks,
)
from argus.streams.summary_router import SummaryRouter, SummaryStep
from argus.topics import RECORD_OF, Topic, job_key, key_partition

__all__ = ["DeadLetters", "install_diagnosis", "scan_diagnosed"]

log = logging.getLogger(__name__)
_V = TypeVar("_V")


#: Most jobs listed in :attr:`DiagnosisStats.jobs` (the counts cover all of them).
_LISTED_JOBS = 100


#: Largest payload kept in a dead letter (bytes): with the record around it, it must stay under the
#: producer's 8 MB request size. A longer one is cut; the original stays on its topic for the retention.
_MAX_DEAD_PAYLOAD = 7_000_000


class DeadLetters:
    """Writes the agents' dead letters to the dead-letter topic and waits for each delivery.

    Args:
        topic: the Faust dead-letter topic.
        retries: delivery attempts (0.5 s, 1 s, ... apart) before :class:`DeadLetterError` is raised.
    """

    def __init__(self, topic: Any, retries: int = 3) -> None:
        self.topic, self.retries = topic, retries
        self.sent = 0

    async def send(self, event: EventT, stage: str, reason: str, payload: bytes | None = None, job: str = "",
                   rank: int | None = None) -> None:
        """Dead-letter ``event`` (or ``payload``, e.g. the part of it that was rejected) with ``reason``.

        Raises:
            DeadLetterError: the broker did not take it; the caller must not ack ``event``.
        """
        msg = event.message
        log.warning("dead-letter stage=%s job=%s rank=%s %s[%d]@%d: %s", stage, job or "?",
                    "?" if rank is None else rank, msg.topic, msg.partition, msg.offset, reason)
        body = bytes(event.value) if payload is None else payload
        if len(body) > _MAX_DEAD_PAYLOAD:
            reason += (f" (payload cut from {len(body)} to {_MAX_DEAD_PAYLOAD} bytes; the message stays on "
                       f"{msg.topic} for its retention)")
            body = body[:_MAX_DEAD_PAYLOAD]
        value = DeadLetter(topic=msg.topic, partition=msg.partition, offset=msg.offset, payload=body,
                           reason=reason, stage=stage, time_ns=time.time_ns(), key=msg.key).encode()
        for attempt in range(self.retries + 1):
            try:
                fut = await self.topic.send(key=msg.key, value=value, force=True)
                await fut
            except Exception as exc:
                if attempt == self.retries:
                    raise DeadLetterError(f"dead letter of {msg.topic}[{msg.partition}]@{msg.offset} not "
                                          f"delivered: {failure_reason(exc)}") from exc
                await asyncio.sleep(0.5 * 2**attempt)
            else:
                self.sent += 1
                return


#: Heartbeat intervals without a heartbeat after which a job is no longer judged for hangs (see
#: :meth:`argus.streams.liveness.JobLiveness.alive`).
_ALIVE_HEARTBEATS = 3.0

class _Recent(OrderedDict[str, _V]):
    """A dict of the ``limit`` most recently written jobs."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def __setitem__(self, key: str, value: _V) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.limit:
            self.popitem(last=False)


def scan_diagnosed(settings: Settings, timeout_s: float = 30.0) -> dict[str, set[str]]:
    """The DIAGNOSED parts per job on the lifecycle topic, read from its start to its end at call time.

    A broker that does not answer within ``timeout_s`` gives what was read so far (logged): the agents then
    fall back to what they see live.
    """
    topic = Topic.LIFECYCLE.full(settings)
    out: dict[str, set[str]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        consumer = Consumer(client_config(settings.kafka, {"group.id": f"{settings.app_id}-scan",
                                                     "enable.auto.commit": False, "auto.offset.reset": "earliest"}))
    except Exception as exc:  # as below: never fatal
        log.warning("lifecycle scan for DIAGNOSED jobs not started: %s", exc)
        return out
    try:
        meta = consumer.list_topics(topic, timeout=timeout_s)
        ends: dict[int, int] = {}
        assign = []
        for p in meta.topics[topic].partitions:
            lo, hi = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout_s)
            if hi > lo:
                ends[p] = hi
                assign.append(TopicPartition(topic, p, lo))
        consumer.assign(assign)
        while ends and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None or msg.error() is not None:
                continue
            try:
                rec = JobLifecycle.decode(msg.value() or b"")
            except SchemaError:
                rec = None
            if rec is not None and rec.event is LifecycleEvent.DIAGNOSED:
                out.setdefault(rec.job_id, set()).add(rec.part)
            part, offset = msg.partition() or 0, msg.offset() or 0
            if offset >= ends.get(part, 0) - 1:
                ends.pop(part, None)
        if ends:
            log.warning("lifecycle scan for DIAGNOSED jobs incomplete after %.0f s (partitions %s)", timeout_s,
                        sorted(ends))
    except Exception as exc:  # the scan only narrows re-diagnosis; a failure must never stop the worker
        log.warning("lifecycle scan for DIAGNOSED jobs failed (%s: %s); relying on what is read live",
                    type(exc).__name__, exc)
    finally:
        consumer.close()
    return out


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
    job_input = app.topic(*names, key_type=bytes, value_type=bytes)
    summaries = app.topic(Topic.SUMMARIES.full(settings), key_type=bytes, value_type=bytes)
    findings_topic = app.topic(Topic.FINDINGS.full(settings), key_type=bytes, value_type=bytes)
    findings_json_topic = app.topic(Topic.FINDINGS_JSON.full(settings), key_type=bytes, value_type=bytes)
    version = detector_version(params, settings)
    lifecycle = app.topic(Topic.LIFECYCLE.full(settings), key_type=bytes, value_type=bytes)
    if dead is None:
        dead = DeadLetters(app.topic(Topic.DEAD_LETTER.full(settings), key_type=bytes, value_type=bytes))
    jobs: dict[str, JobDiagnosis] = {}
    job_events: defaultdict[str, list[EventT]] = defaultdict(list)
    # Per-job context shared with L3, kept for the most recent jobs only (bounded memory in a long-lived worker).
    topologies: _Recent[JobTopology] = _Recent(max_jobs)
    stream_groups: _Recent[dict[int, ParallelGroup]] = _Recent(max_jobs)
    # Ranks L2 named compute stragglers, per job: their blocking-group peers are victims for L3.
    stragglers: _Recent[set[int]] = _Recent(max_jobs)
    # The job's steps as L1/L2 know them (impacts are judged against the step time); final once finished.
    clocks: _Recent[StepClock] = _Recent(max_jobs)
    final_clocks: _Recent[StepClock] = _Recent(max_jobs)
    # What other workers know of their jobs (and this one of its own, read back): topology, groups,
    # stragglers, steps, and every L3 part's totals (see argus.streams.job_context).
    shared = ContextTable(settings, max_jobs)
    context_topic = app.topic(Topic.CONTEXT.full(settings), key_type=bytes, value_type=bytes)
    shared_sent: _Recent[tuple[Any, ...]] = _Recent(max_jobs)  # what the job context last written here held
    # Part 0 of a job waiting for the other parts' totals before its rank aggregate: (part, event, failures, since).
    pending_ranks: dict[str, tuple[tuple[str, int], EventT, list[str], float]] = {}
    tombstones: set[asyncio.Future[Any]] = set()
    parts_done: _Recent[set[int]] = _Recent(max_jobs)
    links: _Recent[LinkLedger] = _Recent(max_jobs)
    # Ids of the findings published per job: a state rebuilt after a failure finds them again.
    published: _Recent[set[str]] = _Recent(max_jobs)
    # Worker-clock time each job's END was read here, until every part of it is DIAGNOSED (diagnosis latency).
    end_read: _Recent[float] = _Recent(max_jobs)
    # DIAGNOSED parts per job (read at start, then live): what a restart must not diagnose live again.
    diagnosed_parts: _Recent[set[str]] = _Recent(max_jobs)
    # (kind, rank, step) of the Step/PhaseBatch records taken per running job (copies are acked, not added),
    # and the jobs finished here (their later copies are acked too).
    taken: dict[str, set[tuple[str, int, int]]] = {}
    finished_here: _Recent[int] = _Recent(max_jobs)  # job -> its world size (0: unknown), for late records
    # Finished jobs whose records are held until all their L3 parts are diagnosed (worker-clock finish time),
    # and the final L3 parts waiting for their job's final steps (with the worker-clock time they began to).
    finished_at: dict[str, float] = {}
    opened_at: dict[str, float] = {}  # worker-clock time of each held job's first record here
    pending_finals: dict[str, list[tuple[KernelSummary, tuple[str, int], EventT]]] = {}
    pending_since: dict[str, float] = {}
    # Worker-clock time the job agent last took a record: while it reads, a job it holds may still finish.
    job_agent_read = [time.monotonic()]
    # Jobs that never end: the worker-clock time of each open job's last record, the jobs whose ABANDONED
    # was written and not yet read back, and the last step seen per open job (the record's ``last_step``).
    activity = IdleJobs()
    abandoning: set[str] = set()
    last_steps: dict[str, int] = {}
    # Liveness per job (last step, phase, collective per rank; the hang episode), judged on a worker timer.
    hang_tick_s = min(max(settings.heartbeat_interval_s / 4, 0.1), 1.0)
    # A blocked event loop counts as at most one tick of silence, and a stall needs at least two ticks: a
    # worker busy with another job's diagnosis never makes a job look stalled.
    quiet = QuietClock(hang_tick_s, time.monotonic())
    hang_params = HangParams(heartbeat_interval_ns=int(settings.heartbeat_interval_s * 1e9),
                             stall_floor_ns=max(HangParams.stall_floor_ns, int(2e9 * hang_tick_s)))
    liveness: _Recent[JobLiveness] = _Recent(settings.max_open_jobs)

    def liveness_of(job_id: str) -> JobLiveness:
        live = liveness.get(job_id)
        if live is None:
            live = liveness[job_id] = JobLiveness(job_id, hang_params)
        return live

    async def publish_hangs(job_id: str, results: list[HangResult], time_ns: int, world_size: int) -> None:
        # GPU time lost: every rank of the job idles while it is stalled (or waits for a silent rank).
        found = []
        for r in results:
            idle_ns = 1e9 * float(r.evidence.get("seconds_stalled", r.evidence.get("seconds_silent", 0.0)))
            impact = Impact(idle_ns, 1, idle_ns * world_size, idle_ns * world_size) if idle_ns > 0 else None
            found.append(to_finding(job_id, r, max(time_ns, 0), impact))
        before = stats.findings
        await publish(found)
        stats.hang_findings += stats.findings - before
    scan: list[asyncio.Future[dict[str, set[str]]]] = []

    async def read_diagnosed() -> None:
        """Once per worker, before the first record: the DIAGNOSED parts already on the lifecycle topic."""
        if not scan:
            shared.start()
            scan.append(asyncio.ensure_future(asyncio.get_running_loop().run_in_executor(
                None, scan_diagnosed, settings)))
            for job_id, parts in (await scan[0]).items():
                diagnosed_parts[job_id] = diagnosed_parts.get(job_id, set()) | parts
            log.info("%d jobs already (partly) diagnosed on the lifecycle topic", len(await scan[0]))
        else:
            await scan[0]

    def is_diagnosed(job_id: str, part: str) -> bool:
        return part in diagnosed_parts.get(job_id, set())

    async def publish(findings: list[Finding]) -> None:
        if findings:  # one job's findings per call
            job_id = findings[0].job_id
            if job_id not in links:
                links[job_id] = LinkLedger()
            findings = links[job_id].filter(findings)
            stragglers[job_id] = stragglers.get(job_id, set()) | straggler_ranks(findings)
            seen = published.get(job_id) or set()
            findings = [dataclasses.replace(f, detector_version=version) for f in findings
                        if f.finding_id not in seen]
            published[job_id] = seen | {f.finding_id for f in findings}
        futs = [await findings_topic.send(key=job_key(f.job_id), value=f.encode(), force=True) for f in findings]
        futs += [await findings_json_topic.send(key=job_key(f.job_id), force=True,
                                                value=json.dumps(finding_json(f), sort_keys=True).encode())
                 for f in findings]
        for fut in futs:
            await fut
        if findings:
            stats.findings += len(findings)
            stats.last_finding_ns = time.time_ns()
            for f in findings:
                by_kind = stats.findings_by_kind.setdefault(f.level.value, {})
                by_kind[f.kind.value] = by_kind.get(f.kind.value, 0) + 1
                if f.time_ns > 0:
                    stats.finding_delay_s.observe(max(0.0, (stats.last_finding_ns - f.time_ns) / 1e9))
                log.info("finding %s %s job=%s ranks=%s phase=%s kernel=%s steps=%s score=%.2f", f.level.value,
                         f.kind.value, f.job_id, list(f.ranks), f.phase, f.kernel, list(f.steps), f.score)

    async def diagnosed(job_id: str, part: str, time_ns: int, world_size: int) -> None:
        ids = tuple(sorted(published.get(job_id) or set()))
        rec = JobLifecycle(job_id, LifecycleEvent.DIAGNOSED, time_ns, world_size, source="streams", part=part,
                           finding_ids=ids)
        fut = await lifecycle.send(key=job_key(job_id), value=rec.encode(), force=True)
        await fut
        diagnosed_parts[job_id] = diagnosed_parts.get(job_id, set()) | {part}
        if part == "l1l2" and job_id in end_read:
            stats.diagnosis_latency_s["l1l2"].observe(time.monotonic() - end_read[job_id])
        maybe_release(job_id)

    def remote(job_id: str) -> JobContext | None:
        return shared.get(job_id).get(CONTEXT_JOB_PART)

    def topology_of(job_id: str) -> JobTopology | None:
        """The job's topology: from its records here, else as its holder shared it."""
        return topologies.get(job_id) or context_topology(remote(job_id))

    def groups_of(job_id: str) -> dict[int, ParallelGroup]:
        return stream_groups.get(job_id) or context_groups(remote(job_id))

    def stragglers_of(job_id: str) -> set[int]:
        ctx = remote(job_id)
        return stragglers.get(job_id, set()) | set(ctx.stragglers if ctx is not None else ())

    def clock_of(job_id: str) -> StepClock | None:
        return final_clocks.get(job_id) or clocks.get(job_id) or context_clock(remote(job_id))

    def steps_final(job_id: str) -> bool:
        ctx = remote(job_id)
        return job_id in final_clocks or (ctx is not None and ctx.final)

    async def share_context(job_id: str, final: bool = False) -> None:
        """Write what this worker (the job's holder) knows of the job for the L3 parts on other workers,
        when it changed since the last time."""
        job = jobs.get(job_id)
        topo = topologies.get(job_id) or (job.topology if job is not None else None)
        groups, straggling = stream_groups.get(job_id, {}), stragglers.get(job_id, set())
        clock = final_clocks.get(job_id) or clocks.get(job_id)
        # Cheap to compare on every record; the record itself (a 10k-rank topology) only when it changed.
        sig = (topo is not None, tuple(sorted(groups.items(), key=lambda kv: kv[0])), frozenset(straggling),
               (len(clock.starts_ns), clock.median_step_ns) if clock is not None else None, final)
        if shared_sent.get(job_id) == sig:
            return
        ctx = job_context(job_id, job.last_time_ns if job is not None else 0, topo, groups, straggling, clock, final)
        fut = await context_topic.send(key=context_key(job_id, CONTEXT_JOB_PART), value=ctx.encode(), force=True)
        await fut
        shared_sent[job_id] = sig
        shared.put(ctx)

    def forget_context(job_id: str) -> None:
        """Tombstones for the job's context parts: a diagnosed job leaves nothing on the compacted topic."""
        for part in (CONTEXT_JOB_PART, *(f"l3/{p}" for p in range(settings.partitions))):
            task = asyncio.ensure_future(context_topic.send(key=context_key(job_id, part), value=None, force=True))
            tombstones.add(task)
            task.add_done_callback(tombstones.discard)
            shared.forget(job_id, part)

    async def reject(event: EventT, stage: str, reason: str, job_id: str, rank: int | None = None,
                     payload: bytes | None = None) -> None:
        await dead.send(event, stage, reason, payload=payload, job=job_id, rank=rank)
        stats.dead_letters += 1

    def hold(held: list[EventT], event: EventT) -> None:
        held.append(event)
        if len(held) > max_pending:  # bounded memory for endless jobs: older state is already in findings
            for e in held[: len(held) // 2]:
                e.ack()
            del held[: len(held) // 2]

    def release(job_id: str) -> None:
        finished_at.pop(job_id, None)
        opened_at.pop(job_id, None)
        for e in job_events.pop(job_id, []):
            e.ack()

    def maybe_release(job_id: str) -> None:
        """Ack a finished job's records once every L3 part of it is diagnosed too: a restart before then
        re-reads them, so the final L3 judged after it has the job's final steps, groups and stragglers. Once
        every part (L1/L2 and L3) is diagnosed and the job is not open here, its context is dropped."""
        if not all(is_diagnosed(job_id, f"l3/{p}") for p in range(settings.partitions)):
            return
        if job_id in finished_at:
            release(job_id)
        if job_id not in jobs and is_diagnosed(job_id, "l1l2"):
            started = end_read.pop(job_id, None)
            if started is not None:
                stats.diagnosis_latency_s["job"].observe(time.monotonic() - started)
            # Every part is diagnosed: nothing judges the job again here (copies are acked by finished_here and
            # the DIAGNOSED parts), so its context goes too -- a long-lived worker keeps no state per past job.
            for d in (topologies, stream_groups, stragglers, clocks, final_clocks, links, published, parts_done):
                d.pop(job_id, None)
            router.forget_job(job_id)
            if shared_sent.pop(job_id, None) is not None:  # its writer forgets the job on the context topic too
                forget_context(job_id)

    def decode_job_record(event: EventT) -> Any:
        return RECORD_OF[names[event.message.topic]].decode(event.value)

    def admit_job_record(rec: Record, world: int | None) -> None:
        if isinstance(rec, Step | PhaseBatch):
            if rec.rank >= settings.max_ranks_per_job:  # bounded state per rank, whatever the topology says
                raise RejectedRecordError(f"rank {rec.rank} of job {rec.job_id} is beyond max_ranks_per_job = "
                                          f"{settings.max_ranks_per_job}")
            if foreign_ranks([rec.rank], topologies.get(rec.job_id), world):
                raise RejectedRecordError(f"rank {rec.rank} is not in job {rec.job_id} (world size {world}, topology "
                                     f"{'known' if rec.job_id in topologies else 'unknown'})")

    async def finish(job_id: str, end_ns: int) -> None:
        """The job's final diagnosis on what arrived, DIAGNOSED ``l1l2``, its state dropped, its records acked."""
        job = jobs[job_id]
        await publish(job.diagnose())
        clocks[job_id] = final_clocks[job_id] = job.clock()
        await share_context(job_id, final=True)
        await diagnosed(job_id, "l1l2", end_ns, job.world_size or 0)
        stats.jobs_diagnosed += 1
        del jobs[job_id]
        taken.pop(job_id, None)
        finished_here[job_id] = job.world_size or 0
        activity.forget(job_id)
        abandoning.discard(job_id)
        liveness.pop(job_id, None)
        last_steps.pop(job_id, None)
        finished_at[job_id] = time.monotonic()
        pending_since.pop(job_id, None)
        for args in pending_finals.pop(job_id, []):
            await finish_part(*args)
        maybe_release(job_id)

    async def advance(job_id: str) -> None:
        job = jobs[job_id]
        if job.finished():
            end = job.end
            await finish(job_id, end.time_ns if end else job.last_time_ns)
        elif job.due() and not is_diagnosed(job_id, "l1l2"):
            # A job diagnosed before a restart is only re-read for its final diagnosis (same ids): live runs
            # on part of its records could raise what the final run did not.
            await publish(job.diagnose())
            clocks[job_id] = job.clock()
        if job_id in jobs:
            await share_context(job_id)

    async def take_job_record(rec: Any, event: EventT) -> None:
        if isinstance(rec, JobTopology):
            topologies[rec.job_id] = rec
        if isinstance(rec, JobLifecycle) and rec.event is LifecycleEvent.DIAGNOSED:
            diagnosed_parts[rec.job_id] = diagnosed_parts.get(rec.job_id, set()) | {rec.part}
            event.ack()
            maybe_release(rec.job_id)
            return
        job = jobs.get(rec.job_id)
        if job is None and rec.job_id in finished_here:
            # A record of a job already finished here: a copy (replay), or one read after the job's counts were
            # complete without it -- either way not diagnosed, but an inadmissible one is still dead-lettered
            # (against the world size kept for the job once its topology is dropped).
            admit_job_record(rec, finished_here[rec.job_id] or None)
            stats.replayed += 1
            event.ack()
            return
        if isinstance(rec, JobLifecycle) and rec.event is LifecycleEvent.ABANDONED:
            # Read back from the log (so a replay closes the job at the same point): the job ends here on
            # what arrived. The compressor turns the same record into job-end markers for the kernels.
            if job is None:
                event.ack()  # never open here (or closed): nothing to drop
                if rec.job_id not in finished_here:  # e.g. a job of kernels only (abandoned by the compressor)
                    finished_here[rec.job_id] = rec.world_size
                    if not is_diagnosed(rec.job_id, "l1l2"):  # no steps to judge: findings --wait returns
                        await share_context(rec.job_id, final=True)  # L3 parts elsewhere wait no longer
                        await diagnosed(rec.job_id, "l1l2", rec.time_ns, rec.world_size)
                    pending_since.pop(rec.job_id, None)
                    for args in pending_finals.pop(rec.job_id, []):
                        await finish_part(*args)
                return
            hold(job_events[rec.job_id], event)
            job.add(rec)
            stats.jobs_closed_abandoned += 1
            log.warning("job %s abandoned (%s; last step %d): final diagnosis on %d steps", rec.job_id, rec.reason,
                        rec.last_step, job.complete_steps)
            await finish(rec.job_id, rec.time_ns)
            return
        admit_job_record(rec, job.world_size if job is not None else None)
        if (isinstance(rec, JobLifecycle) and rec.event is LifecycleEvent.END and rec.job_id not in end_read
                and not is_diagnosed(rec.job_id, "l1l2")):
            end_read[rec.job_id] = time.monotonic()
        activity.touch(rec.job_id, quiet.read(time.monotonic()))
        if isinstance(rec, Step | PhaseBatch):
            last_steps[rec.job_id] = max(last_steps.get(rec.job_id, -1), rec.step)
            if not is_diagnosed(rec.job_id, "l1l2"):  # a replayed finished job is not judged live again
                resumed = liveness_of(rec.job_id).observe(rec, quiet.read(time.monotonic()))
                if resumed:
                    await publish_hangs(rec.job_id, resumed, liveness_of(rec.job_id).newest_ns,
                                        (job.world_size if job else None) or len(liveness_of(rec.job_id).ranks))
        copy = (type(rec).__name__, rec.rank, rec.step) if isinstance(rec, Step | PhaseBatch) else None
        if copy is not None and copy in taken.get(rec.job_id, ()):
            stats.duplicates += 1  # delivered twice (a re-send or a replay): counted once
            event.ack()
            return
        if job is None:
            job = jobs[rec.job_id] = JobDiagnosis(rec.job_id, params)
            stream_groups[rec.job_id] = job.collective_groups
            opened_at.setdefault(rec.job_id, time.monotonic())
        hold(job_events[rec.job_id], event)
        job.add(rec)
        if copy is not None:
            taken.setdefault(rec.job_id, set()).add(copy)
        if isinstance(rec, JobTopology) and foreign_ranks({r for _, r, _ in taken.get(rec.job_id, ())}, rec, None):
            # Records of ranks outside the job read before its topology (the topics are read independently):
            # rebuilt without them, each dead-lettered (rebuild_job).
            kept, ok = await rebuild_job(rec.job_id, job_events.pop(rec.job_id, []))
            members = set(rec.rank)
            taken[rec.job_id] = {t for t in taken.get(rec.job_id, ()) if t[1] in members}
            if not ok:  # repaired as any failing record (job_failed): without the topology, or given up
                job_events[rec.job_id] = [e for e in kept if e is not event]
                raise RuntimeError(f"job {rec.job_id}'s state fails with its topology")
        await advance(rec.job_id)

    async def rebuild_job(job_id: str, events: list[EventT]) -> tuple[list[EventT], bool]:
        """A fresh state of ``job_id`` from ``events`` (inadmissible ones dead-lettered and acked): the events
        kept, and whether the rebuilt state works (only then is it installed)."""
        jobs.pop(job_id, None)
        fresh = JobDiagnosis(job_id, params)
        kept = []
        for e in events:
            rec = decode_job_record(e)
            try:
                admit_job_record(rec, fresh.world_size)
            except RejectedRecordError as why:
                await reject(e, "diagnose-jobs", failure_reason(why), job_id, getattr(rec, "rank", None))
                e.ack()
                continue
            fresh.add(rec)
            kept.append(e)
        try:
            found = fresh.diagnose()  # the probe: does the repaired state work?
        except Exception as exc:
            log.warning("job %s: state rebuilt from %d records still fails: %s", job_id, len(kept),
                        failure_reason(exc))
            return kept, False
        jobs[job_id] = fresh
        stream_groups[job_id] = fresh.collective_groups
        job_events[job_id] = kept
        await publish(found)
        return kept, True

    async def job_failed(rec: Any, event: EventT, exc: Exception) -> None:
        job_id, rank = rec.job_id, getattr(rec, "rank", None)
        if isinstance(exc, RejectedRecordError):  # rejected before it touched the job's state
            await reject(event, "diagnose-jobs", failure_reason(exc), job_id, rank)
            event.ack()
            return
        msg = event.message
        log.error("job %s: record of rank %s at %s[%d]@%d raised %s; repairing the job's state", job_id, rank,
                  msg.topic, msg.partition, msg.offset, failure_reason(exc))
        held = [e for e in job_events.pop(job_id, []) if e is not event]
        # First with the record (the fault may lie in an earlier record the topology now rejects), then without.
        kept, ok = await rebuild_job(job_id, [*held, event])
        if not ok and any(e is event for e in kept):
            await reject(event, "diagnose-jobs", failure_reason(exc), job_id, rank)
            event.ack()
            kept, ok = await rebuild_job(job_id, [e for e in kept if e is not event])
        if ok:
            stats.states_repaired += 1
            await advance(job_id)
            return
        # Still failing: give the job up here. Its records are stored by the sink; later ones start afresh.
        stats.states_discarded += 1
        log.error("job %s: state discarded; %d held records acked without diagnosis", job_id, len(kept))
        opened_at.pop(job_id, None)
        for e in kept:
            e.ack()

    async def abandon(job_id: str, reason: str) -> None:
        """Write the job's ABANDONED record (keyed by job: only the worker holding the job's partition of the
        job topics writes it); the job is closed when the record is read back."""
        job = jobs[job_id]
        world = job.world_size or max((r for _, r, _ in taken.get(job_id, ())), default=0) + 1
        rec = JobLifecycle(job_id, LifecycleEvent.ABANDONED, job.last_time_ns or time.time_ns(), world,
                           source="streams", reason=reason, last_step=last_steps.get(job_id, -1))
        fut = await lifecycle.send(key=job_key(job_id), value=rec.encode(), force=True)
        await fut
        abandoning.add(job_id)
        stats.jobs_abandoned += 1
        log.warning("job %s: ABANDONED written (%s; last step %d, %d messages held)", job_id, reason,
                    rec.last_step, len(job_events.get(job_id, ())))

    # Often enough that a job is abandoned within about a quarter of the timeout after it passes.
    tick_s = min(max(settings.job_idle_timeout_s / 4, 0.05), 10.0)

    @app.timer(interval=tick_s, name="argus.idle-jobs")
    async def abandon_idle_jobs() -> None:
        now = quiet.read(time.monotonic())  # a busy worker has not seen what may have arrived
        over = set(activity.beyond(settings.max_open_jobs))
        for job_id in [*over, *activity.idle(now, settings.job_idle_timeout_s)]:
            if job_id not in jobs or job_id in abandoning:
                continue
            await abandon(job_id, abandon_reason(activity.age(job_id, now), settings.job_idle_timeout_s,
                                                 job_id in over))
        for job_id, at in list(finished_at.items()):
            if time.monotonic() - at > settings.job_idle_timeout_s + 4 * final_wait_s:
                log.warning("job %s: L3 parts %s not diagnosed %.0f s after its end; its records are acked", job_id,
                            sorted(set(range(settings.partitions)) - {int(p[3:]) for p in diagnosed_parts.get(
                                job_id, set()) if p.startswith("l3/")}), time.monotonic() - at)
                release(job_id)
        stats.open_jobs = len(jobs)
        stats.held_messages = sum(len(v) for v in job_events.values()) + router.held_messages
        stats.jobs = list_jobs(time.monotonic())
        stats.context_jobs = len({*topologies, *stream_groups, *stragglers, *clocks, *final_clocks, *links,
                                  *published, *parts_done, *router.jobs()})

    def list_jobs(now: float) -> list[dict[str, Any]]:
        held = router.held_by_job()
        listed = []
        for job_id in sorted({*jobs, *finished_at}, key=lambda j: opened_at.get(j, now))[:_LISTED_JOBS]:
            state = "awaiting L3" if job_id in finished_at else "abandoning" if job_id in abandoning else "open"
            idle = activity.age(job_id, quiet.read(now))
            listed.append({"job": job_id, "state": state, "age_s": round(now - opened_at.get(job_id, now), 1),
                           "idle_s": round(idle, 1) if idle is not None else None,
                           "last_step": last_steps.get(job_id, -1),
                           "held_messages": len(job_events.get(job_id, ())) + held.get(job_id, 0)})
        return listed

    def take_heartbeat(hb: Heartbeat) -> None:
        """Liveness only: heartbeats are acked at once (a restart re-learns liveness from newer ones)."""
        stats.heartbeats += 1
        if hb.job_id in finished_here or is_diagnosed(hb.job_id, "l1l2"):
            return
        if hb.rank >= settings.max_ranks_per_job:
            return  # bounded state per rank
        live = liveness_of(hb.job_id)
        live.observe(hb, quiet.read(time.monotonic()))
        live.heartbeat_at = quiet.read(time.monotonic())
        if hb.job_id in jobs:
            activity.touch(hb.job_id, quiet.read(time.monotonic()))  # a hung job still heartbeats: it is not abandoned

    @app.timer(interval=hang_tick_s, name="argus.hangs")
    async def judge_hangs() -> None:
        now = quiet.read(time.monotonic())
        for job_id, job in list(jobs.items()):
            live, topo = liveness.get(job_id), job.topology or topologies.get(job_id)
            if (live is None or topo is None or job_id in abandoning or is_diagnosed(job_id, "l1l2")
                    or not live.alive(now, _ALIVE_HEARTBEATS * settings.heartbeat_interval_s)):
                continue
            try:
                median = job.clock().median_step_ns
                found = live.judge(topo, median, now)
                await publish_hangs(job_id, found, live.now_ns(now, live.pace(median)), topo.world_size)
            except DeadLetterError:
                raise
            except Exception as exc:  # liveness of one job must not stop the others' (nor the agent)
                log.error("hang judgement of job %s failed: %s", job_id, failure_reason(exc))

    @app.agent(job_input, name="argus.diagnose-jobs")
    async def diagnose_jobs(stream: Any) -> Any:
        await read_diagnosed()
        async for event in stream.noack().events():
            try:
                rec: Any = decode_job_record(event)
            except SchemaError:
                stats.undecodable += 1  # the sink dead-letters it with the reason
                event.ack()
                continue
            stats.records += 1
            job_agent_read[0] = time.monotonic()
            if isinstance(rec, Heartbeat):
                take_heartbeat(rec)
                event.ack()
                yield None
                continue
            try:
                await take_job_record(rec, event)
            except DeadLetterError:
                raise
            except Exception as exc:
                await job_failed(rec, event, exc)
            yield None

    # L3 per (job, summaries partition): a job's keys spread over partitions, each finishes alone.
    router: SummaryRouter[EventT] = SummaryRouter(params, stats, lambda e: KernelSummary.decode(e.value),
                                                  settings.partitions, settings.l3_max_windows, max_pending,
                                                  max_jobs)

    class View:
        """The L3 router's view of a job: this worker's state, else what the job's holder shared."""

        def is_diagnosed(self, job_id: str, part: str) -> bool:
            return is_diagnosed(job_id, part)

        def topology_of(self, job_id: str) -> JobTopology | None:
            return topology_of(job_id)

        def groups_of(self, job_id: str) -> dict[int, ParallelGroup]:
            return groups_of(job_id)

        def stragglers_of(self, job_id: str) -> set[int]:
            return stragglers_of(job_id)

        def clock_of(self, job_id: str) -> StepClock | None:
            return clock_of(job_id)

    view = View()

    def holds_job(job_id: str) -> bool:
        """Whether this worker's job agent reads ``job_id``'s records (its partition of the job topics)."""
        tp = (Topic.STEPS.full(settings), key_partition(job_key(job_id), settings.partitions))
        return any((t.topic, t.partition) == tp for t in app.consumer.assignment())

    async def carry_out(step: SummaryStep[EventT], s: KernelSummary, event: EventT) -> None:
        """Do what the router said, in its order: dead letters, findings, acks; then end the part."""
        for r in step.rejected:
            await reject(event, "diagnose-kernels", r.reason, s.job_id, r.rank)
        await publish(step.findings)
        for e in step.ack:
            e.ack()
        if step.ended is not None:
            await end_part(s, step.ended, event)

    async def end_part(s: KernelSummary, part: tuple[str, int], event: EventT) -> None:
        """All of the part's summaries of the job are in: its final L3 now, or, while the job agent here has
        not finished the job's steps yet (after a restart it re-reads them), once it has (:func:`finish`).
        Waiting never blocks this agent: the job agent may need the fetcher this agent would hold up."""
        job_id = s.job_id
        if job_id in final_clocks or job_id in finished_here or is_diagnosed(job_id, f"l3/{part[1]}") \
                or steps_final(job_id):
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
            idle = job_id not in jobs and holds_job(job_id) and now - max(since, job_agent_read[0]) > final_wait_s
            if not steps_final(job_id) and not idle and now - since <= cap:
                continue
            del pending_since[job_id]
            waiting = pending_finals.pop(job_id, [])
            log.warning("job %s: final L3 of %d parts without the job's final steps (waited %.0f s)", job_id,
                        len(waiting), now - since)
            stats.finals_without_steps += len(waiting)
            for args in waiting:
                await finish_part(*args)

    async def finish_part(s: KernelSummary, part: tuple[str, int], event: EventT) -> None:
        found, failures = router.final(part, view)
        for findings in found:
            await publish(findings)
        parts_done[s.job_id] = parts_done.get(s.job_id, set()) | {part[1]}
        totals = totals_context(s.job_id, part[1], *router.rank_totals(s.job_id, part[1]))
        fut = await context_topic.send(key=context_key(s.job_id, totals.part), value=totals.encode(), force=True)
        await fut
        shared.put(totals)
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
            log.warning("job %s: rank aggregate without the totals of L3 parts %s", job_id, missing)
        merged = RankDiagnosis(job_id, params)
        for p in range(settings.partitions):
            ctx = parts.get(f"l3/{p}")
            if ctx is not None:
                merged.add_totals(context_totals(ctx), ctx.time_ns)
        try:
            await publish(merged.diagnose(topology_of(job_id), clock_of(job_id)))
        except DeadLetterError:
            raise
        except Exception as exc:
            failures.append(f"rank aggregate of job {job_id}: {failure_reason(exc)}")
        return True

    async def close_part(job_id: str, part: tuple[str, int], event: EventT, failures: list[str]) -> None:
        if failures:
            stats.states_discarded += len(failures)
            await reject(event, "diagnose-kernels", "; ".join(failures), job_id)
        topo = topology_of(job_id)
        last_ns, held = router.close(part)
        await diagnosed(job_id, f"l3/{part[1]}", last_ns, topo.world_size if topo else 0)
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
        await carry_out(router.take(s, event, part[1], view), s, event)

    async def summary_failed(s: KernelSummary, event: EventT, part: tuple[str, int], exc: Exception) -> None:
        msg = event.message
        log.error("job %s: summary of %r stream %s at %s[%d]@%d raised %s; repairing its L3 state", s.job_id,
                  s.kernel, s.stream, msg.topic, msg.partition, msg.offset, failure_reason(exc))
        await carry_out(router.failed(s, event, part[1], exc, view), s, event)

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
        router.revoked()
        for d in (jobs, job_events, stream_groups, stragglers, parts_done, links, taken, finished_here, last_steps,
                  finished_at, pending_finals, pending_since, opened_at, pending_ranks, shared_sent):
            d.clear()
        abandoning.clear()
        activity.clear()
        liveness.clear()

    return stats
