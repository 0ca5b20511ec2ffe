"""A job's context shared between stream workers: one answer whatever the number of workers.

The worker holding a job's steps (its partition of the job topics) knows the job's topology, the parallel
group of each collective stream, the ranks named stragglers and the job's steps; the L3 parts of the job
(one per summaries partition) may run on other workers, and the job's rank aggregate needs every part's
per-rank kernel totals. Both travel as :class:`~argus.schemas.job_context.JobContext` records on the compacted
``context`` topic, which every worker reads in full from its start (:class:`ContextTable`, a global table):

* part ``job``, written by the job's holder whenever what it knows changes (and ``final`` once the job
  ended), read by the L3 parts elsewhere;
* part ``l3/<p>``, written by L3 part ``p`` at its end: its kernels' per-rank totals, merged by part 0 into
  the job's rank aggregate (:meth:`argus.streams.diagnosis.RankDiagnosis.add_totals`).

The conversions here are pure; the table is the only thread.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterable

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, TopicPartition

from argus.core.errors import SchemaError
from argus.core.kafka_security import client_config
from argus.core.settings import Settings
from argus.detectors.impact import StepClock
from argus.detectors.l3_ranks import KernelTotals
from argus.schemas.job_context import CONTEXT_JOB_PART, JobContext
from argus.schemas.records import JobTopology, ParallelGroup
from argus.topics import Topic

__all__ = ["ContextTable", "context_clock", "context_groups", "context_key",
           "context_topology", "context_totals", "job_context", "totals_context"]

log = logging.getLogger(__name__)


def context_key(job_id: str, part: str) -> bytes:
    return f"{job_id}/{part}".encode()


def job_context(job_id: str, time_ns: int, topology: JobTopology | None, groups: dict[int, ParallelGroup],
                stragglers: Iterable[int], clock: StepClock | None, final: bool) -> JobContext:
    """The job agent's context of ``job_id`` (part ``job``)."""
    streams = sorted(groups)
    clock = clock or StepClock()
    return JobContext(job_id=job_id, part=CONTEXT_JOB_PART, time_ns=max(time_ns, 0),
                      topology=topology.encode() if topology is not None else None,
                      group_streams=tuple(streams), group_kinds=tuple(groups[s] for s in streams),
                      stragglers=tuple(sorted(stragglers)), step_starts_ns=clock.starts_ns,
                      median_step_ns=float(clock.median_step_ns), final=final,
                      onset_rank=tuple(r for r, _ in clock.onsets), onset_ns=tuple(t for _, t in clock.onsets),
                      token_rank=tuple(r for r, _ in clock.expert_tokens),
                      tokens=tuple(n for _, n in clock.expert_tokens))


def context_topology(ctx: JobContext | None) -> JobTopology | None:
    """The topology in ``ctx`` (``None`` without one, or when it does not decode: logged)."""
    if ctx is None or ctx.topology is None:
        return None
    try:
        return JobTopology.decode(ctx.topology)
    except SchemaError as exc:
        log.warning("job %s: the shared topology does not decode: %s", ctx.job_id, exc)
        return None


def context_groups(ctx: JobContext | None) -> dict[int, ParallelGroup]:
    return {} if ctx is None else dict(zip(ctx.group_streams, ctx.group_kinds, strict=True))


def context_clock(ctx: JobContext | None) -> StepClock | None:
    if ctx is None or not (ctx.step_starts_ns or ctx.median_step_ns):
        return None
    return StepClock(tuple(ctx.step_starts_ns), ctx.median_step_ns,
                     tuple(zip(ctx.onset_rank, ctx.onset_ns, strict=True)),
                     tuple(zip(ctx.token_rank, ctx.tokens, strict=True)))


def totals_context(job_id: str, part: int, time_ns: int, totals: Iterable[KernelTotals]) -> JobContext:
    """L3 part ``part``'s per-rank kernel totals of ``job_id`` (part ``l3/<part>``). A rank whose median
    time is unknown has NaN in ``totals_median_ns`` (empty when no rank's is known)."""
    kernels, streams, rows, ranks, ns, calls, medians = [], [], [], [], [], [], []
    for t in sorted(totals, key=lambda t: (t.kernel, t.stream)):
        kernels.append(t.kernel)
        streams.append(t.stream)
        rows.append(len(t.total_ns))
        for r in sorted(t.total_ns):
            ranks.append(r)
            ns.append(t.total_ns[r])
            calls.append(t.calls.get(r, 0.0))
            medians.append(t.median_ns.get(r, math.nan))
    known = any(not math.isnan(m) for m in medians)
    return JobContext(job_id=job_id, part=f"l3/{part}", time_ns=max(time_ns, 0), totals_kernel=tuple(kernels),
                      totals_stream=tuple(streams), totals_rows=tuple(rows), totals_rank=tuple(ranks),
                      totals_ns=tuple(ns), totals_calls=tuple(calls),
                      totals_median_ns=tuple(medians) if known else ())


def context_totals(ctx: JobContext) -> list[KernelTotals]:
    out, at = [], 0
    for kernel, stream, n in zip(ctx.totals_kernel, ctx.totals_stream, ctx.totals_rows, strict=True):
        sl = slice(at, at + n)
        medians = ({r: m for r, m in zip(ctx.totals_rank[sl], ctx.totals_median_ns[sl], strict=True)
                    if not math.isnan(m)} if ctx.totals_median_ns else {})
        out.append(KernelTotals(kernel, stream, dict(zip(ctx.totals_rank[sl], ctx.totals_ns[sl], strict=True)),
                                dict(zip(ctx.totals_rank[sl], ctx.totals_calls[sl], strict=True)), medians))
        at += n
    return out


class ContextTable:
    """Every :class:`JobContext` on the context topic, per job and part, read in full by a daemon thread from
    the topic's start (no consumer group commits: each worker has the whole table). At most ``max_jobs``
    jobs are kept (the least recently updated go first); a tombstone forgets a job's part."""

    def __init__(self, settings: Settings, max_jobs: int) -> None:
        self.settings = settings
        self.max_jobs = max_jobs
        self._jobs: OrderedDict[str, dict[str, JobContext]] = OrderedDict()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.updates = 0

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="argus-context", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def get(self, job_id: str) -> dict[str, JobContext]:
        """The parts known of ``job_id`` (a copy)."""
        with self._lock:
            return dict(self._jobs.get(job_id, {}))

    def put(self, ctx: JobContext) -> None:
        """Take ``ctx`` (as read from the topic; also what this worker wrote, before it is read back)."""
        with self._lock:
            parts = self._jobs.setdefault(ctx.job_id, {})
            parts[ctx.part] = ctx
            self._jobs.move_to_end(ctx.job_id)
            while len(self._jobs) > self.max_jobs:
                self._jobs.popitem(last=False)
            self.updates += 1

    def forget(self, job_id: str, part: str) -> None:
        with self._lock:
            parts = self._jobs.get(job_id)
            if parts is not None:
                parts.pop(part, None)
                if not parts:
                    del self._jobs[job_id]

    def _run(self) -> None:
        topic = Topic.CONTEXT.full(self.settings)
        consumer = Consumer(client_config(self.settings.kafka, {
            "group.id": f"{self.settings.app_id}-context-{uuid.uuid4().hex[:8]}", "enable.auto.commit": False,
            "auto.offset.reset": "earliest"}))
        try:
            while not self._stop.is_set():  # the topic may not exist yet
                try:
                    meta = consumer.list_topics(topic, timeout=5.0).topics.get(topic)
                except KafkaException as exc:
                    log.warning("context topic %s not readable yet: %s", topic, exc)
                    meta = None
                if meta is not None and meta.partitions and meta.error is None:
                    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in sorted(meta.partitions)])
                    break
                time.sleep(1.0)
            while not self._stop.is_set():
                msg = consumer.poll(1.0)  # returns at once when a record comes; the timeout only paces the stop check
                if msg is None or msg.error() is not None:
                    continue
                self._take(msg.key() or b"", msg.value())
        except Exception:  # a dead reader must be seen: the L3 parts then wait up to their cap
            log.exception("context reader of %s stopped", topic)
        finally:
            consumer.close()

    def _take(self, key: bytes, value: bytes | None) -> None:
        job_id, _, part = key.decode("utf-8", "replace").rpartition("/")
        if part.isdigit() and job_id.endswith("/l3"):  # 'job/l3/<p>'
            job_id, part = job_id[: -len("/l3")], f"l3/{part}"
        if not value:  # a tombstone
            self.forget(job_id, part)
            return
        try:
            self.put(JobContext.decode(value))
        except SchemaError as exc:
            log.warning("context record %r ignored: %s", key, exc)
