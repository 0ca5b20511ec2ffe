"""The :class:`JobContext` record: what one stream worker knows of a job that others need (see
``schemas/job_context.v6.avsc``; v1-v5 still read), and its split into bounded messages.

A part can outgrow a Kafka message (a 102,400-rank job's L3 totals are ~8 MB, its topology ~2.3 MB), so a write
of a part is sent as ``pieces`` messages of one ``generation`` (:func:`split_context`), each a valid
:class:`JobContext` of at most a given number of bytes, and read back by :func:`merge_context` once every
piece is in."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from argus.core.errors import SchemaError
from argus.schemas.records import ParallelGroup, Record, _bounded, _same_length, _times

__all__ = ["CONTEXT_JOB_PART", "MAX_PIECES", "JobContext", "merge_context", "split_context"]

#: The part of the job agent's context; L3 parts are ``l3/<p>``.
CONTEXT_JOB_PART = "job"
#: Most pieces one write of a part may be split into (a 102,400-rank job's totals take 9 of 1 MB).
MAX_PIECES = 65_536


@dataclass(frozen=True)
class JobContext(Record):
    """One part of a job's shared context. Times in integer nanoseconds since the Unix epoch."""

    SCHEMA: ClassVar[str] = "job_context"

    job_id: str
    part: str
    time_ns: int
    topology: bytes | None = None
    group_streams: tuple[int, ...] = ()
    group_kinds: tuple[ParallelGroup, ...] = ()
    stragglers: tuple[int, ...] = ()
    step_starts_ns: tuple[int, ...] = ()
    median_step_ns: float = 0.0
    final: bool = False
    totals_kernel: tuple[str, ...] = ()
    totals_stream: tuple[int, ...] = ()
    totals_rows: tuple[int, ...] = ()
    totals_rank: tuple[int, ...] = ()
    totals_ns: tuple[float, ...] = ()
    totals_calls: tuple[float, ...] = ()
    totals_median_ns: tuple[float, ...] = ()
    totals_peak_ns: tuple[float, ...] = ()
    totals_moved_calls: tuple[float, ...] = ()
    totals_moved_of: tuple[float, ...] = ()
    onset_rank: tuple[int, ...] = ()
    onset_ns: tuple[int, ...] = ()
    token_rank: tuple[int, ...] = ()
    tokens: tuple[int, ...] = ()
    generation: int = 0
    piece: int = 0
    pieces: int = 1
    totals_continued: bool = False

    @classmethod
    def _enum_fields(cls) -> dict[str, type[enum.Enum]]:
        return {"group_kinds": ParallelGroup}

    def check(self) -> None:
        what = f"job context {self.job_id}/{self.part}"
        if not self.job_id or not (self.part == CONTEXT_JOB_PART or self.part.startswith("l3/")):
            raise SchemaError(f"{what}: invalid job_id or part")
        _times(what, "time_ns", self.time_ns)
        _times(what, "step_starts_ns", self.step_starts_ns)
        _same_length(what, self, ("group_kinds",), len(self.group_streams), "the number of group_streams")
        _same_length(what, self, ("totals_stream", "totals_rows"), len(self.totals_kernel),
                     "the number of totals_kernel")
        _bounded(what, "totals_rows", self.totals_rows, 0, 2**31 - 1)
        _same_length(what, self, ("totals_ns", "totals_calls"), len(self.totals_rank), "the number of totals_rank")
        for name in _OPTIONAL_ROW_FIELDS:
            values = getattr(self, name)
            if values and len(values) != len(self.totals_rank):
                raise SchemaError(f"{what}: {name} has {len(values)} entries, not one per totals_rank "
                                  f"({len(self.totals_rank)}) or none")
        if sum(self.totals_rows) != len(self.totals_rank):
            raise SchemaError(f"{what}: totals_rows add up to {sum(self.totals_rows)}, not {len(self.totals_rank)}")
        _bounded(what, "stragglers", self.stragglers, 0, 2**31 - 1)
        _same_length(what, self, ("onset_ns",), len(self.onset_rank), "the number of onset_rank")
        _same_length(what, self, ("tokens",), len(self.token_rank), "the number of token_rank")
        _times(what, "onset_ns", self.onset_ns)
        _bounded(what, "onset_rank", self.onset_rank, 0, 2**31 - 1)
        _bounded(what, "token_rank", self.token_rank, 0, 2**31 - 1)
        _bounded(what, "tokens", self.tokens, 0, 2**63 - 1)
        _bounded(what, "totals_rank", self.totals_rank, 0, 2**31 - 1)
        if not (1 <= self.pieces <= MAX_PIECES and 0 <= self.piece < self.pieces and 0 <= self.generation < 2**63):
            raise SchemaError(f"{what}: piece {self.piece} of {self.pieces} (generation {self.generation}) invalid")
        if self.totals_continued and not (self.piece > 0 and self.totals_kernel):
            raise SchemaError(f"{what}: totals_continued on piece {self.piece} with {len(self.totals_kernel)} "
                              "totals entries")


# Upper bounds of the Avro encoding, bytes: a zigzag varint long / int, a double, an enum index (< 64 symbols),
# an array's block header and end marker, a boolean, a null-or-bytes union's branch and length.
_LONG, _INT, _DOUBLE, _ENUM, _BOOL = 10, 5, 8, 1, 1
_ARRAY, _UNION = _LONG + 1, 1 + _INT
#: The sequence sections split outside the totals: parallel fields and the bytes one item of them takes.
_SECTIONS: tuple[tuple[tuple[str, ...], int], ...] = (
    (("group_streams", "group_kinds"), _LONG + _ENUM),
    (("stragglers",), _INT),
    (("step_starts_ns",), _LONG),
    (("onset_rank", "onset_ns"), _INT + _LONG),
    (("token_rank", "tokens"), _INT + _LONG),
)
_ENTRY_FIELDS = ("totals_kernel", "totals_stream", "totals_rows")
#: Row fields a context may leave empty (unknown): written by later versions, or unknown to the writer.
_OPTIONAL_ROW_FIELDS = ("totals_median_ns", "totals_peak_ns", "totals_moved_calls", "totals_moved_of")
_ROW_FIELDS = ("totals_rank", "totals_ns", "totals_calls", *_OPTIONAL_ROW_FIELDS)
_ARRAYS = 22  # more than the schema's array fields


def _string_bytes(text: str) -> int:
    return _INT + len(text.encode("utf-8"))


def _fixed_bytes(ctx: JobContext) -> int:
    """Most bytes a piece of ``ctx`` takes without its sequences' items: the wire header, the scalars, every
    array's framing."""
    return (2 + _string_bytes(ctx.job_id) + _string_bytes(ctx.part) + _LONG + _UNION + _DOUBLE + _BOOL
            + _LONG + 2 * _INT + _BOOL + _ARRAYS * _ARRAY)


class _Pieces:
    """The pieces being filled by :func:`split_context`: per piece, its slices of every sequence field."""

    def __init__(self, room: int, what: str) -> None:
        self.room, self.what = room, what
        self.parts: list[dict[str, list[Any]]] = []
        self.topology: list[bytes | None] = []
        self.continued: list[bool] = []
        self.left = 0
        self.new()

    def new(self) -> None:
        self.parts.append({})
        self.topology.append(None)
        self.continued.append(False)
        self.left = self.room

    def take(self, cost: int, wanted: int) -> int:
        """How many of ``wanted`` items of ``cost`` bytes the current piece takes, at least one: a new piece is
        started when none fits. Raises :class:`SchemaError` when one item does not fit an empty piece."""
        if cost > self.room:
            raise SchemaError(f"{self.what}: an item of {cost} bytes does not fit a piece ({self.room} bytes of room)")
        if self.left < cost:
            self.new()
        return self.fit(cost, wanted)

    def fit(self, cost: int, wanted: int) -> int:
        """How many of ``wanted`` items of ``cost`` bytes the current piece takes (maybe none)."""
        n = min(wanted, self.left // cost)
        self.left -= n * cost
        return n

    def extend(self, name: str, values: Sequence[object]) -> None:
        self.parts[-1].setdefault(name, []).extend(values)


def split_context(ctx: JobContext, max_bytes: int, generation: int) -> list[JobContext]:
    """``ctx`` as the pieces of one write (``generation``), each at most ``max_bytes`` bytes encoded, every
    sequence cut into contiguous slices in field order (a kernel's rank rows may span pieces:
    ``totals_continued``); scalars are repeated in every piece. :func:`merge_context` of the pieces in any
    order is ``ctx`` with ``generation``.

    Raises:
        SchemaError: ``max_bytes`` leaves no room for one item, or more than :data:`MAX_PIECES` pieces.
    """
    what = f"job context {ctx.job_id}/{ctx.part}"
    room = max_bytes - _fixed_bytes(ctx)
    if room <= 0:
        raise SchemaError(f"{what}: {max_bytes} bytes do not hold one piece's fixed fields")
    out = _Pieces(room, what)
    if ctx.topology is not None:
        out.topology[0] = ctx.topology[:0]
        at = 0
        while at < len(ctx.topology):
            n = out.take(1, len(ctx.topology) - at)
            out.topology[-1] = (out.topology[-1] or b"") + ctx.topology[at:at + n]
            at += n
    for names, cost in _SECTIONS:
        columns = [getattr(ctx, f) for f in names]
        at = 0
        while at < len(columns[0]):
            n = out.take(cost, len(columns[0]) - at)
            for f, col in zip(names, columns, strict=True):
                out.extend(f, col[at:at + n])
            at += n
    _split_totals(ctx, out)
    if len(out.parts) > MAX_PIECES:
        raise SchemaError(f"{what}: {len(out.parts)} pieces of {max_bytes} bytes, more than {MAX_PIECES}")
    return [replace(ctx, generation=generation, piece=i, pieces=len(out.parts), topology=out.topology[i],
                    totals_continued=out.continued[i], **_columns(out.parts[i]))
            for i in range(len(out.parts))]


def _columns(slices: dict[str, list[Any]]) -> dict[str, Any]:
    """Every sequence field's value from ``slices`` (absent: empty)."""
    return {f: tuple(slices.get(f, ())) for f in (*(f for names, _ in _SECTIONS for f in names), *_ENTRY_FIELDS,
                                                   *_ROW_FIELDS)}


def _split_totals(ctx: JobContext, out: _Pieces) -> None:
    row_fields = [f for f in _ROW_FIELDS if f not in _OPTIONAL_ROW_FIELDS or getattr(ctx, f)]
    row_cost = _INT + (len(row_fields) - 1) * _DOUBLE
    at = 0
    for kernel, stream, rows in zip(*(getattr(ctx, f) for f in _ENTRY_FIELDS), strict=True):
        entry_cost = _string_bytes(kernel) + _LONG + _INT
        done = 0
        while True:
            if done:  # the piece is full: the kernel's further rows open the next one
                out.new()
                out.continued[-1] = True
            # The entry goes with its first row (alone only when it has none).
            out.take(entry_cost + (row_cost if rows else 0), 1)
            n = 1 + out.fit(row_cost, rows - done - 1) if rows else 0
            out.extend("totals_kernel", (kernel,))
            out.extend("totals_stream", (stream,))
            out.extend("totals_rows", (n,))
            for f in row_fields:
                out.extend(f, getattr(ctx, f)[at + done:at + done + n])
            done += n
            if done >= rows:
                break
        at += rows


def merge_context(pieces: Sequence[JobContext]) -> JobContext:
    """The part that ``pieces`` (every piece of one generation, each once, any order) were split from.

    Raises:
        SchemaError: the pieces are not exactly one generation's 0..pieces-1 of one part.
    """
    if not pieces:
        raise SchemaError("no job context pieces to merge")
    ordered = sorted(pieces, key=lambda p: p.piece)
    head = ordered[0]
    what = f"job context {head.job_id}/{head.part} generation {head.generation}"
    if ([p.piece for p in ordered] != list(range(head.pieces))
            or any((p.job_id, p.part, p.generation, p.pieces) != (head.job_id, head.part, head.generation,
                                                                  head.pieces) for p in ordered)):
        raise SchemaError(f"{what}: pieces {[p.piece for p in ordered]} are not 0..{head.pieces - 1} of one part")
    if head.pieces == 1:
        return head
    chunks = [p.topology for p in ordered if p.topology is not None]
    joined: dict[str, list[Any]] = {f: [] for names, _ in _SECTIONS for f in names}
    joined.update({f: [] for f in (*_ENTRY_FIELDS, *_ROW_FIELDS)})
    for p in ordered:
        skip = 0
        if p.totals_continued:  # its first entry is more rows of the last one so far
            if not joined["totals_kernel"] or (joined["totals_kernel"][-1], joined["totals_stream"][-1]) != (
                    p.totals_kernel[0], p.totals_stream[0]):
                raise SchemaError(f"{what}: piece {p.piece} continues another kernel's totals")
            joined["totals_rows"][-1] += p.totals_rows[0]
            skip = 1
        for f, values in joined.items():
            values.extend(getattr(p, f)[skip:] if f in _ENTRY_FIELDS else getattr(p, f))
    return replace(head, piece=0, pieces=1, totals_continued=False,
                   topology=b"".join(chunks) if chunks else None, **_columns(joined))
