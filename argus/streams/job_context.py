"""A job's context shared between stream workers: one answer whatever the number of workers.

The job's holder writes part ``job`` (topology, collective groups, stragglers, steps); each L3 part ``l3/<p>``
writes its per-rank kernel totals at its end, merged by part 0 into the job's rank aggregate. Both travel as
:class:`~argus.schemas.job_context.JobContext` records on the compacted ``context`` topic, which every worker
reads in full (:class:`ContextTable`). A write is one *generation* in pieces of at most
``ARGUS_CONTEXT_MAX_BYTES`` (:func:`context_messages`), joined at-least-once by :class:`ContextPieces`: a part
is known only once every piece of a generation is in, the newest generation wins. The conversions here are
pure; the table is the only thread. Details: docs/internals/streams.md.
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, TopicPartition

from argus.core.errors import SchemaError
from argus.core.kafka_security import client_config
from argus.core.settings import Settings
from argus.detectors.impact import StepClock
from argus.detectors.l3_ranks import KernelTotals
from argus.schemas.job_context import CONTEXT_JOB_PART, JobContext, merge_context, split_context
from argus.schemas.records import JobTopology, ParallelGroup
from argus.streams.diagnosis_stats import DiagnosisStats
from argus.topics import Topic, key_partition

__all__ = ["ContextPieces", "ContextTable", "context_clock", "context_groups", "context_key", "context_messages",
           "context_tombstones", "context_topology", "context_totals", "job_context", "send_context",
           "totals_context"]

log = logging.getLogger(__name__)


#: Generations of one part kept while incomplete (older ones are dropped: a write that never completed).
_BUILDING = 4
#: Generations of one part remembered as taken: their pieces read again (the writer's own, read back) are ignored.
_TAKEN = 256


def context_key(job_id: str, part: str, piece: int = 0) -> bytes:
    """The Kafka key of ``piece`` of a part (piece 0's is the part's own: ``<job>/<part>``)."""
    return f"{job_id}/{part}".encode() if piece == 0 else f"{job_id}/{part}#{piece}".encode()


def context_messages(ctx: JobContext, max_bytes: int,
                     partitions: int) -> tuple[JobContext, list[tuple[bytes, bytes, int]]]:
    """``ctx`` stamped with a new generation, and its pieces as (key, value, partition) messages of at most
    ``max_bytes`` bytes each, all on the partition (of ``partitions``) of the part's key.

    Raises:
        SchemaError: ``max_bytes`` too small for one piece.
    """
    ctx = replace(ctx, generation=secrets.randbits(63), piece=0, pieces=1, totals_continued=False)
    partition = key_partition(context_key(ctx.job_id, ctx.part), partitions)
    pieces = split_context(ctx, max_bytes, ctx.generation)
    out = []
    for p in pieces:
        value = p.encode()
        if len(value) > max_bytes:  # split_context bounds the encoding from above: a bug if seen
            raise SchemaError(f"job context {ctx.job_id}/{ctx.part}: piece {p.piece} is {len(value)} bytes, "
                              f"over {max_bytes}")
        out.append((context_key(ctx.job_id, ctx.part, p.piece), value, partition))
    return ctx, out


async def send_context(topic: Any, ctx: JobContext, max_bytes: int, partitions: int) -> JobContext:
    """Send ``ctx`` on the Faust context ``topic`` in pieces of at most ``max_bytes`` (:func:`context_messages`),
    each delivered before the next; returns it as stamped (what the writer's own table should keep)."""
    ctx, pieces = context_messages(ctx, max_bytes, partitions)
    for key, value, partition in pieces:
        fut = await topic.send(key=key, value=value, partition=partition, force=True)
        await fut
    return ctx


def context_tombstones(job_id: str, part: str, pieces: int, partitions: int) -> list[tuple[bytes, int]]:
    """The (key, partition) of every piece of a part that ``pieces`` pieces were written of: tombstones there
    leave nothing of the part on the compacted topic."""
    partition = key_partition(context_key(job_id, part), partitions)
    return [(context_key(job_id, part, i), partition) for i in range(max(pieces, 1))]


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
    time or longest call is unknown has NaN in ``totals_median_ns`` or ``totals_peak_ns`` (empty when no
    rank's is known); the calls each rank moved out of its modes (:meth:`KernelTotals.moved_calls`) travel as
    ``totals_moved_calls`` and ``totals_moved_of`` (0 where it moved none)."""
    kernels, streams, rows, ranks, ns, calls, medians, peaks = [], [], [], [], [], [], [], []
    moved: list[float] = []
    of: list[float] = []
    for t in sorted(totals, key=lambda t: (t.kernel, t.stream)):
        kernels.append(t.kernel)
        streams.append(t.stream)
        rows.append(len(t.total_ns))
        moves = t.moved_calls()
        for r in sorted(t.total_ns):
            ranks.append(r)
            ns.append(t.total_ns[r])
            calls.append(t.calls.get(r, 0.0))
            medians.append(t.median_ns.get(r, math.nan))
            peaks.append(t.peak_ns.get(r, math.nan))
            a, b = moves.get(r, (0.0, 0.0))
            moved.append(a)
            of.append(b)
    return JobContext(job_id=job_id, part=f"l3/{part}", time_ns=max(time_ns, 0), totals_kernel=tuple(kernels),
                      totals_stream=tuple(streams), totals_rows=tuple(rows), totals_rank=tuple(ranks),
                      totals_ns=tuple(ns), totals_calls=tuple(calls), totals_median_ns=_known(medians),
                      totals_peak_ns=_known(peaks), totals_moved_calls=tuple(moved), totals_moved_of=tuple(of))


def _known(values: list[float]) -> tuple[float, ...]:
    """``values``, or none where none is known."""
    return tuple(values) if any(not math.isnan(v) for v in values) else ()


def context_totals(ctx: JobContext) -> list[KernelTotals]:
    out, at = [], 0
    for kernel, stream, n in zip(ctx.totals_kernel, ctx.totals_stream, ctx.totals_rows, strict=True):
        sl = slice(at, at + n)
        ranks = ctx.totals_rank[sl]
        moved = {r: (a, b) for r, a, b in zip(ranks, ctx.totals_moved_calls[sl], ctx.totals_moved_of[sl],
                                              strict=True) if b > 0.0} if ctx.totals_moved_of else {}
        out.append(KernelTotals(kernel, stream, dict(zip(ranks, ctx.totals_ns[sl], strict=True)),
                                dict(zip(ranks, ctx.totals_calls[sl], strict=True)),
                                _by_rank(ranks, ctx.totals_median_ns[sl]), _by_rank(ranks, ctx.totals_peak_ns[sl]),
                                moved, census=None))
        at += n
    return out


def _by_rank(ranks: Sequence[int], values: Sequence[float]) -> dict[int, float]:
    """The known ``values`` by rank (none when the context has none)."""
    return {r: v for r, v in zip(ranks, values, strict=True) if not math.isnan(v)} if values else {}


@dataclass
class _Part:
    """One part's generations: the newest complete one, those being assembled, those already taken."""

    complete: JobContext | None = None
    complete_seq: int = -1
    #: generation -> (sequence number of its first piece read, pieces read by index)
    building: dict[int, tuple[int, dict[int, JobContext]]] = field(default_factory=dict)
    taken: OrderedDict[int, None] = field(default_factory=OrderedDict)
    most_pieces: int = 1


class ContextPieces:
    """Joins the pieces of every job's parts (not thread-safe: :class:`ContextTable` locks around it).

    ``stats``: where the gauge of parts being assembled and the count of generations dropped incomplete go
    (``context_parts_incomplete``, ``context_generations_dropped``)."""

    def __init__(self, stats: DiagnosisStats | None = None) -> None:
        self.stats = stats or DiagnosisStats()
        self._jobs: dict[str, dict[str, _Part]] = {}
        self._seq = 0

    def take(self, piece: JobContext) -> JobContext | None:
        """Take one piece (or a whole part); the part, when this completes a generation newer than the one
        it has, else ``None``. A part of generation 0 (written before v4) is whole and always taken."""
        self._seq += 1
        part = self._jobs.setdefault(piece.job_id, {}).setdefault(piece.part, _Part())
        part.most_pieces = max(part.most_pieces, piece.pieces)
        if piece.generation in part.taken:
            return None  # a duplicate of a generation already taken, or this writer's own read back
        if piece.pieces == 1:  # a whole part: a one-message write, or the writer's own (then its pieces read
            # so far are the same write) -- taken as it is; a generation 0 (before v4) is taken every time
            if part.building.pop(piece.generation, None) is not None:
                self._count()
            if piece.generation:
                self._taken(part, piece.generation)
            part.complete, part.complete_seq = piece, self._seq
            return piece
        seq, got = part.building.setdefault(piece.generation, (self._seq, {}))
        got[piece.piece] = piece
        if len(got) < piece.pieces:
            self._bound(piece, part)
            self._count()
            return None
        del part.building[piece.generation]
        self._taken(part, piece.generation)
        # Generations begun before this one are superseded (a write that never completed).
        for g in [g for g, (s, _) in part.building.items() if s < seq]:
            self._drop(piece, part, g, "superseded")
        try:
            whole = merge_context(list(got.values()))
        except SchemaError as exc:  # pieces that claim one generation but do not join: a corrupt write
            log.warning("job %s part %s: generation %d dropped: %s", piece.job_id, piece.part, piece.generation, exc)
            self.stats.context_generations_dropped += 1
            whole = None
        self._count()
        if whole is None or seq < part.complete_seq:
            return None  # (or an older write completed after a newer one: the newer stays)
        part.complete, part.complete_seq = whole, seq
        return whole

    def incomplete(self, job_id: str) -> dict[str, tuple[int, int]]:
        """The parts of ``job_id`` being assembled: part -> (pieces read, pieces) of its newest generation."""
        out = {}
        for name, part in self._jobs.get(job_id, {}).items():
            if part.building:
                _, got = max(part.building.values(), key=lambda b: b[0])
                out[name] = (len(got), next(iter(got.values())).pieces)
        return out

    def most_pieces(self, job_id: str, part: str) -> int:
        """The most pieces a generation of the part was written in (1 when none was read)."""
        found = self._jobs.get(job_id, {}).get(part)
        return found.most_pieces if found is not None else 1

    def forget(self, job_id: str, part: str | None = None) -> None:
        """Drop what is held of a part (every part of the job when ``part`` is None)."""
        parts = self._jobs.get(job_id)
        if parts is not None:
            if part is None:
                parts.clear()
            else:
                parts.pop(part, None)
            if not parts:
                del self._jobs[job_id]
        self._count()

    @staticmethod
    def _taken(part: _Part, generation: int) -> None:
        part.taken[generation] = None
        while len(part.taken) > _TAKEN:
            part.taken.popitem(last=False)

    def _bound(self, piece: JobContext, part: _Part) -> None:
        while len(part.building) > _BUILDING:
            oldest = min(part.building, key=lambda g: part.building[g][0])
            self._drop(piece, part, oldest, f"more than {_BUILDING} generations open")

    def _drop(self, piece: JobContext, part: _Part, generation: int, why: str) -> None:
        _, got = part.building.pop(generation)
        log.warning("job %s part %s: generation %d dropped with %d of %d pieces (%s)", piece.job_id, piece.part,
                    generation, len(got), next(iter(got.values())).pieces, why)
        self.stats.context_generations_dropped += 1

    def _count(self) -> None:
        self.stats.context_parts_incomplete = sum(1 for parts in self._jobs.values() for p in parts.values()
                                                  if p.building)


class ContextTable:
    """Every :class:`JobContext` on the context topic, per job and part, read in full by a daemon thread from
    the topic's start (no consumer group commits: each worker has the whole table) and joined from its pieces
    (:class:`ContextPieces`). At most ``max_jobs`` jobs are kept (the least recently updated go first); a
    tombstone forgets a job's part. ``stats``: where the pieces' gauge and counter go."""

    def __init__(self, settings: Settings, max_jobs: int, stats: DiagnosisStats | None = None) -> None:
        self.settings = settings
        self.max_jobs = max_jobs
        self._jobs: OrderedDict[str, dict[str, JobContext]] = OrderedDict()
        self._pieces = ContextPieces(stats)
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
        """The parts known of ``job_id`` (a copy): complete ones only."""
        with self._lock:
            return dict(self._jobs.get(job_id, {}))

    def incomplete(self, job_id: str) -> dict[str, tuple[int, int]]:
        """The parts of ``job_id`` being assembled: part -> (pieces read, pieces)."""
        with self._lock:
            return self._pieces.incomplete(job_id)

    def tombstones(self, job_id: str, parts: Iterable[str]) -> list[tuple[bytes, int]]:
        """(key, partition) of every piece of ``parts`` of the job written as far as this table read."""
        with self._lock:
            return [t for part in parts for t in context_tombstones(
                job_id, part, self._pieces.most_pieces(job_id, part), self.settings.partitions)]

    def put(self, ctx: JobContext) -> None:
        """Take ``ctx``, a whole part or one piece of one (as read from the topic; also what this worker wrote,
        stamped by :func:`context_messages`, before it is read back)."""
        with self._lock:
            parts = self._jobs.setdefault(ctx.job_id, {})
            whole = self._pieces.take(ctx)
            if whole is not None:
                parts[ctx.part] = whole
            self._jobs.move_to_end(ctx.job_id)
            while len(self._jobs) > self.max_jobs:
                gone, _ = self._jobs.popitem(last=False)
                self._pieces.forget(gone)
            self.updates += 1

    def forget(self, job_id: str, part: str) -> None:
        with self._lock:
            self._pieces.forget(job_id, part)
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
        text = key.decode("utf-8", "replace")
        base, hash_, piece = text.rpartition("#")
        if hash_ and piece.isdigit():  # a piece's key: '<job>/<part>#<i>'
            text = base
        job_id, _, part = text.rpartition("/")
        if part.isdigit() and job_id.endswith("/l3"):  # 'job/l3/<p>'
            job_id, part = job_id[: -len("/l3")], f"l3/{part}"
        if not value:  # a tombstone
            self.forget(job_id, part)
            return
        try:
            self.put(JobContext.decode(value))
        except SchemaError as exc:
            log.warning("context record %r ignored: %s", key, exc)
