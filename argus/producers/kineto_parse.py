"""Streaming parse of one torch.profiler / Kineto Chrome-trace file (``.json`` or ``.json.gz``) of one rank.

Memory stays bounded whatever the file size: the file is never loaded whole. One pass with ``ijson`` (its C
backend ``yajl2_c``) walks ``traceEvents`` event by event:

* GPU activities (``cat`` ``kernel``, ``gpu_memcpy``, ``gpu_memset``, case-insensitive) go as fixed-size binary
  rows (name id, stream, start, duration) to a spill file on disk; only the distinct names stay in memory;
* ``ProfilerStep#N`` annotations (CPU ``user_annotation``, GPU ``gpu_user_annotation``) become steps, other
  annotations phases: few per step, kept in memory;
* everything else (CPU ops, runtime calls, flows) is passed over.

Details and reasoning: docs/internals/producers.md.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
import re
import shutil
import tempfile
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from decimal import ROUND_HALF_EVEN, Decimal
from pathlib import Path
from types import ModuleType
from typing import IO, Any, cast

import ijson
import numpy as np
import numpy.typing as npt

from argus.core.errors import ProducerError
from argus.schemas.records import PhaseKind

__all__ = ["GPU_CATEGORIES", "MAX_DEPTH", "MAX_EXPONENT_DIGITS", "MAX_FILE_BYTES", "MAX_KEPT_BYTES",
           "MAX_NUMBER_DIGITS", "MAX_STRING_BYTES", "MAX_WORLD_SIZE", "MemoryBudget", "Phase", "RankTrace", "StepSpan",
           "StreamPG", "classify_phase", "parse_rank", "rank_from_name", "stream_pg", "to_ns"]

#: Event categories imported as kernel events (compared lower-case).
GPU_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
#: Names of the host ops (``cpu_op``) of a forward grouped GEMM, whose first input is ``[routed tokens, hidden]``
#: (``Input Dims``, traces recorded with ``record_shapes``): the ``grouped_gemm`` package's autograd function,
#: PyTorch's grouped matmul and Transformer Engine's grouped linear. Their backward ops are not counted.
GROUPED_GEMM_OPS = ("GroupedGemm", "aten::_grouped_mm", "_GroupedLinear")
_GROUPED_OPS = frozenset(GROUPED_GEMM_OPS)
_ANNOTATIONS = {"user_annotation": False, "gpu_user_annotation": True}  # category -> on the GPU timeline
_STEP_RE = re.compile(r"ProfilerStep#(\d+)")
_MAX_STEP_DIGITS = 10  # steps are int32; int() of a longer run is wasted work (or a ValueError)
_RANK_RE = re.compile(r"(?:rank|worker)[-_]?(\d+)", re.IGNORECASE)
#: A kernel row: name id, stream, start, duration; its CUDA graph and node (Kineto's ``graph id`` / ``graph node
#: id`` args, 0 when absent) and its launch's correlation id (-1 when absent), for kernels of a cudaGraphLaunch.
_SPILL = np.dtype([("name", "<u4"), ("stream", "<u4"), ("start", "<i8"), ("dur", "<i8"), ("graph", "<i8"),
                   ("node", "<i8"), ("corr", "<i8")])
#: Runtime/driver calls that replay a CUDA graph: the kernels they launch share their correlation id.
_GRAPH_LAUNCHES = ("cudaGraphLaunch", "cuGraphLaunch")
_RUNTIME_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver", "runtime"})
#: Most cudaGraphLaunch correlation ids kept per file (a launch per captured step: far more than any trace holds).
_MAX_GRAPH_LAUNCHES = 1 << 20
_SPILL_ROWS = 16_384
#: Streams per file whose process group is kept, and the longest ``Process Group Ranks`` text read.
_MAX_PG_STREAMS = 1024
_MAX_INTERNED = 1 << 16  # distinct phase names shared as one string each
_MAX_PG_TEXT = 1 << 20
_CHUNK = 256 * 1024
_TAIL = 1024 * 1024
_MAX_NS = 2**62
_OPEN_END = np.iinfo(np.int64).max
# The events array ends after its last event object (or is empty): the leftmost such "]" whose remainder is
# one JSON object reaching the end of the file. A "]" inside an event leaves unbalanced closers behind it.
_TAIL_CANDIDATE = re.compile(r"[}\[]\s*\]\s*[,}]")
_WS = re.compile(r"\s*")
_READ_ERRORS = (ijson.JSONError, OSError, EOFError, zlib.error, UnicodeDecodeError)
# What the parser's number conversion or a decoder may still raise on input the guard let through.
_VALUE_ERRORS = (ArithmeticError, ValueError, RecursionError)

#: Largest world size accepted from ``distributedInfo.world_size``; ranks (also from file names) must be below.
MAX_WORLD_SIZE = 1 << 20
#: Default bound on one rank's file, counted after decompression (``max_file_bytes`` overrides it).
MAX_FILE_BYTES = 2 << 30
#: Deepest nesting of arrays and objects (a Kineto trace needs about 6).
MAX_DEPTH = 64
#: Most digits in a row in a number (its integer part or its fraction).
MAX_NUMBER_DIGITS = 100
#: Most digits of a number's exponent (``1e9999`` passes, then is out of range like any other bad time).
MAX_EXPONENT_DIGITS = 4
#: Longest string, in bytes as written (escapes included).
MAX_STRING_BYTES = 16 << 20
#: Default of what one import keeps in memory (see :class:`MemoryBudget`), bytes: 4 GiB.
MAX_KEPT_BYTES = 4 << 30
# Byte classes for the guard's scan: quote, backslash, opening and closing bracket; everything else 0.
_CLASS = bytes(1 if b == 0x22 else 2 if b == 0x5C else 3 if b in b"[{" else 4 if b in b"]}" else 0 for b in range(256))
_DELTA = np.array([0, 0, 0, 1, -1], dtype=np.int64)
# Number characters as '0' (digits), 'e' (exponent), 's' (signs) and '.'; anything else 'x'.
_NUMERIC = bytes(0x30 if 0x30 <= b <= 0x39 else 0x65 if b in b"eE" else 0x73 if b in b"+-" else 0x2E if b == 0x2E
                 else 0x78 for b in range(256))
_NUMBER_CHARS = b"0es."
_NUMBER_LIMITS = (
    (b"0" * (MAX_NUMBER_DIGITS + 1), f"a number with more than {MAX_NUMBER_DIGITS} digits in a row", False),
    (b"e" + b"0" * (MAX_EXPONENT_DIGITS + 1), f"a number with more than {MAX_EXPONENT_DIGITS} exponent digits", True),
    (b"es" + b"0" * (MAX_EXPONENT_DIGITS + 1), f"a number with more than {MAX_EXPONENT_DIGITS} exponent digits", True),
)
_KEY_BEFORE = re.compile(rb'"((?:[^"\\]|\\.){0,200})"\s*:\s*\Z')
_NAME = re.compile(rb'"name"\s*:\s*"((?:[^"\\]|\\.){0,200})')
# Ordered: collectives first (so 'alltoall_bwd' is ALL_TO_ALL), then compute, then data loading.
_PHASE_RULES: tuple[tuple[tuple[str, ...], PhaseKind], ...] = (
    (("reduce_scatter", "reducescatter"), PhaseKind.REDUCE_SCATTER),
    (("all_gather", "allgather"), PhaseKind.ALL_GATHER),
    (("all_reduce", "allreduce"), PhaseKind.ALL_REDUCE),
    (("all_to_all", "alltoall", "all2all"), PhaseKind.ALL_TO_ALL),
    (("broadcast",), PhaseKind.BROADCAST),
    (("send", "recv"), PhaseKind.SEND_RECV),
    (("backward", "bwd"), PhaseKind.BACKWARD),
    (("forward", "fwd"), PhaseKind.FORWARD),
    (("optimizer", "optim", "step"), PhaseKind.OPTIMIZER),
    (("dataloader", "data_load", "load_batch"), PhaseKind.DATA_LOADER),
)


def _backend() -> ModuleType:
    try:
        return ijson.get_backend("yajl2_c")
    except ImportError:  # pragma: no cover - the C backend ships in ijson's wheels
        return ijson


_IJSON = _backend()
Intervals = tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int32]]


def classify_phase(name: str) -> PhaseKind:
    """The phase kind of an annotation name (case-insensitive substring rules, collectives first)."""
    low = name.lower()
    for needles, kind in _PHASE_RULES:
        if any(n in low for n in needles):
            return kind
    return PhaseKind.OTHER


def to_ns(value: Any) -> int | None:
    """Microseconds (int, Decimal or float) to integer nanoseconds, rounded half-even; None if not a number."""
    t = type(value)
    if t is int:
        return int(value) * 1000
    if t is float:
        if not math.isfinite(value):
            return None
        value = Decimal(repr(value))  # the shortest repr is the number as written: exact ns digits
    elif t is not Decimal or not value.is_finite():
        return None
    if value.adjusted() > 30:  # beyond any time in ns: no million-digit int (or decimal.Overflow) to build
        return None
    try:
        return int((value * 1000).to_integral_value(rounding=ROUND_HALF_EVEN))
    except (ArithmeticError, ValueError):  # decimal's signals (Overflow, InvalidOperation) are ArithmeticErrors
        return None


def rank_from_name(path: Path) -> int | None:
    """A rank number in a file name (``rank-1``, ``rank1``, ``rank_1``, ``worker3``), else None."""
    m = _RANK_RE.search(path.name)
    return int(m.group(1)) if m else None


class MemoryBudget:
    """What an import may keep in memory across its files, estimated as they are read: phases, distinct
    names, process-group members (kernels go to a spill file and are not counted).

    Args:
        limit_bytes: the most it may keep (``ARGUS_IMPORT_MAX_MEMORY_MB`` for ``argus import-kineto``).

    :meth:`charge` raises :class:`ProducerError` once the estimate passes the limit, so a hostile or oversized
    set of traces is refused while it is read, not after it took the machine's memory.
    """

    #: Bytes one kept phase takes (a slotted Phase, its two ints, the list's pointer), measured.
    PHASE_BYTES = 220
    #: Bytes one kept process-group member takes (an int and the tuple's pointer).
    MEMBER_BYTES = 40

    def __init__(self, limit_bytes: int) -> None:
        if limit_bytes <= 0:
            raise ValueError(f"limit_bytes must be > 0, got {limit_bytes}")
        self.limit_bytes = limit_bytes
        self.used_bytes = 0
        self.path: Path | None = None  # the file being read, for the refusal's message

    def charge(self, nbytes: int) -> None:
        self.used_bytes += nbytes
        if self.used_bytes > self.limit_bytes:
            where = f"{self.path.name}: " if self.path is not None else ""
            raise ProducerError(f"{where}refused: the traces' annotations, names and process groups would keep "
                                f"more than {self.limit_bytes / 2**20:,.0f} MiB in memory "
                                "(ARGUS_IMPORT_MAX_MEMORY_MB)")


@dataclass(frozen=True)
class StepSpan:
    """One ``ProfilerStep#N`` of a rank; absolute ns on the rank's clock."""

    step: int
    start_ns: int
    dur_ns: int
    #: GPU-timeline span (union over streams) when the trace has GPU step annotations.
    gpu_start_ns: int | None = None
    gpu_end_ns: int | None = None
    #: First kernel start and last kernel end of the kernels assigned to the step.
    kernel_start_ns: int | None = None
    kernel_end_ns: int | None = None
    #: Tokens routed to the rank's experts in the step: the first input's rows of its forward grouped-GEMM ops
    #: (``cpu_op`` named in :data:`GROUPED_GEMM_OPS`, with ``Input Dims``); None
    #: where the trace records no such op.
    expert_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class Phase:
    """One annotation kept as a phase (slots: a trace may hold millions)."""

    kind: PhaseKind
    name: str
    stream: int
    start_ns: int
    dur_ns: int
    on_gpu: bool


@dataclass(frozen=True)
class StreamPG:
    """The process group a stream's collectives ran in, as the trace's kernel args name it."""

    name: str
    desc: str
    #: Global ranks of the group; empty where the trace does not list them.
    ranks: tuple[int, ...]


def stream_pg(args: dict[str, Any]) -> StreamPG | None:
    """The :class:`StreamPG` in a kernel's ``args``, or None where there is none (or it does not parse)."""
    name, desc, ranks = args.get("Process Group Name"), args.get("Process Group Description"), \
        args.get("Process Group Ranks")
    if not isinstance(name, str | int) and not isinstance(desc, str):
        return None
    members: tuple[int, ...] = ()
    if isinstance(ranks, str) and len(ranks) <= _MAX_PG_TEXT:
        items = ranks.strip().strip("[]").split(",")
        if all(x.strip().isdigit() and len(x.strip()) < 10 for x in items if x.strip()):
            members = tuple(int(x) for x in items if x.strip())
    elif isinstance(ranks, list) and len(ranks) <= MAX_WORLD_SIZE and all(type(x) is int for x in ranks):
        members = tuple(ranks)
    return StreamPG(str(name)[:64] if name is not None else "", desc[:128] if isinstance(desc, str) else "", members)


@dataclass
class RankTrace:
    """What :func:`parse_rank` read from one file (absolute ns times); kernels wait in a spill file.

    :meth:`rows` reads them back; close it (or use it as a context manager) to delete the spill file.
    """

    path: Path
    rank: int
    world_size: int | None
    base_ns: int
    pg_config: list[dict[str, Any]]
    device: str | None
    host: str | None
    steps: list[StepSpan]
    phases: list[Phase]
    kernel_events: int
    names: list[str]
    streams: dict[int, int]
    skipped: Counter[str]
    first_kernel_ns: int | None = None
    last_kernel_end_ns: int | None = None
    #: Largest lag of a kernel start behind an earlier kernel start, in file order.
    max_lag_ns: int = 0
    #: Per CUDA stream: the process group its first NCCL kernel named in its args (PyTorch 2.3+ traces:
    #: ``Process Group Name``, ``Process Group Description``, ``Process Group Ranks``), if any.
    stream_pgs: dict[int, StreamPG] = field(default_factory=dict)
    #: Correlation ids of the file's ``cudaGraphLaunch`` calls: the kernels with one of them were graph-launched.
    graph_launches: frozenset[int] = frozenset()
    #: The CUDA device index on its host that its kernels ran on (their ``args.device``), if any says.
    gpu_index: int | None = None
    spill: Path | None = field(default=None, repr=False)
    owned_dir: Path | None = field(default=None, repr=False)

    def rows(self, n: int) -> Iterator[npt.NDArray[Any]]:
        """The kernels in file order, ``n`` per array (fields name, stream, start, dur, absolute ns; graph, node,
        corr: see ``_SPILL``)."""
        if self.spill is None or not self.kernel_events:
            return
        with self.spill.open("rb") as fh:
            while (rows := np.fromfile(fh, dtype=_SPILL, count=n)).shape[0]:
                rows["start"] += self.base_ns
                yield rows

    def intervals(self, gpu: bool) -> Intervals:
        """Sorted step spans ``(starts, ends, steps)`` for :func:`assign_steps` (see the module docstring)."""
        spans: list[tuple[int, int, int]] = []
        steps = sorted(self.steps, key=lambda s: s.start_ns)
        for i, s in enumerate(steps):
            if gpu and s.gpu_start_ns is not None and s.gpu_end_ns is not None:
                spans.append((s.gpu_start_ns, s.gpu_end_ns, s.step))
            else:
                end = steps[i + 1].start_ns if i + 1 < len(steps) else _OPEN_END
                spans.append((s.start_ns, max(end, s.start_ns + s.dur_ns), s.step))
        spans.sort()
        cols = list(zip(*spans, strict=True)) or [(), (), ()]
        return np.array(cols[0], np.int64), np.array(cols[1], np.int64), np.array(cols[2], np.int32)

    def close(self) -> None:
        if self.owned_dir is not None:
            shutil.rmtree(self.owned_dir, ignore_errors=True)
        elif self.spill is not None:
            self.spill.unlink(missing_ok=True)
        self.spill = self.owned_dir = None

    def __enter__(self) -> RankTrace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def assign_steps(iv: Intervals, t: npt.NDArray[np.int64]) -> npt.NDArray[np.int32]:
    """Per time in ``t``: the step of the span containing it, else -1."""
    starts, ends, steps = iv
    if not starts.shape[0]:
        return np.full(t.shape[0], -1, dtype=np.int32)
    idx = np.searchsorted(starts, t, side="right") - 1
    safe = np.clip(idx, 0, None)
    return np.where((idx >= 0) & (t < ends[safe]), steps[safe], -1).astype(np.int32)


# -- hostile input ---------------------------------------------------------------------------------------


class _Guard:
    """The file as the JSON parser reads it, checked before the parser sees a byte.

    ``ijson``'s C backend crashes the interpreter on an integer over Python's 4,300-digit conversion limit,
    raises ``decimal`` errors on huge exponents and keeps one prefix string per nesting level (a 60 KB file of
    nested brackets took 2.2 GiB); the JSON decoder of :func:`_tail_keys` recurses per level. So each chunk is
    scanned first, vectorized (strings and escapes, depth, digit runs, exponents, string lengths, size), and
    cut before the first byte over a limit; the next read raises a :class:`ProducerError` naming the file and
    where: the event's index (from ``events``, the events the parser has returned) and name, or the top-level
    key. Also keeps the last :data:`_TAIL` bytes read (for :func:`_tail_keys`) and counts all.
    """

    def __init__(self, fh: IO[bytes], path: Path, max_bytes: int, events: Callable[[], int] | None = None) -> None:
        self.fh, self.path, self.max_bytes, self.events = fh, path, max_bytes, events
        self.tail, self.total = bytearray(), 0
        self.depth, self.in_str, self.str_start, self.odd_backslashes = 0, False, 0, False
        self.number = b""  # the number characters (translated) ending the last chunk, outside a string
        self.bare: bool | None = None  # the top level is an array of events, not an object
        self.top_key, self.event_start = "", 0
        # (reason, offset, where): raised on the next read, once the parser has returned the events before it.
        self.pending: tuple[str, int, str] | None = None

    def read(self, n: int = -1) -> bytes:
        if self.pending is not None:
            raise self._refusal(self.pending)
        data = self.fh.read(n)
        if not data:
            return data
        base = self.total
        self.total += len(data)
        self.tail += data
        if len(self.tail) > 2 * _TAIL:
            del self.tail[:-_TAIL]
        cut = self._scan(data, base)
        if cut is None:
            return data
        if cut <= base and self.pending is not None:  # nothing before it (b"" would read as the end of file)
            raise self._refusal(self.pending)
        return data[:cut - base]

    def _refusal(self, pending: tuple[str, int, str]) -> ProducerError:
        """The error of a violation, once the parser has returned every event before it."""
        reason, at, where = pending
        if where.startswith("in traceEvents") and self.events is not None:
            where = f"in traceEvents[{self.events()}]" + where.removeprefix("in traceEvents")
        return ProducerError(f"{self.path.name}: refused: {reason}, {where}, at byte {at:,}")

    def _scan(self, data: bytes, base: int) -> int | None:
        """Advance the state over ``data`` (at offset ``base``); the offset of the first violation, if any."""
        cls = np.frombuffer(data.translate(_CLASS), np.uint8)
        pos = np.flatnonzero(cls)
        kind = cls[pos]
        if self.odd_backslashes or b"\\" in data:
            pos, kind = self._unescape(pos, kind, len(data))
        quote = kind == 1
        inside = ((np.cumsum(quote) + self.in_str) & 1).astype(bool)  # after each special byte
        delta = _DELTA[kind]
        delta[inside] = 0  # brackets in strings
        depth = np.cumsum(delta) + self.depth
        qpos = pos[quote]
        if self.bare is None and (opens := np.flatnonzero(delta > 0)).size:
            self.bare = data[pos[opens[0]]] == 0x5B
        found: list[tuple[int, str]] = []
        if depth.size and int(depth.max()) > MAX_DEPTH:
            found.append((base + int(pos[np.argmax(depth > MAX_DEPTH)]), f"nesting deeper than {MAX_DEPTH} levels"))
        found += self._strings(qpos + base, base + len(data))
        text = self.number + data.translate(_NUMERIC)
        found += self._numbers(text, base - len(self.number), qpos)
        if base + len(data) > self.max_bytes:
            found.append((self.max_bytes, f"more than max_file_bytes={self.max_bytes:,} bytes (after decompression; "
                                          f"raise it to import this file)"))
        if found:
            at, reason = min(found)
            self.pending = (reason, at, self._where(at, base, pos, depth, delta))
            return at
        self._containers(base, pos, depth, delta, pos.size)
        self.depth = int(depth[-1]) if depth.size else self.depth
        if qpos.size:
            self.in_str = bool((qpos.size + self.in_str) & 1)
            self.str_start = base + int(qpos[-1])
        # A longer run already broke a limit: this is enough to find one that goes on in the next chunk.
        run = text[-(2 * MAX_NUMBER_DIGITS + 2 * MAX_EXPONENT_DIGITS + 8):]
        self.number = b"" if self.in_str else run[len(run.rstrip(_NUMBER_CHARS)):]
        return None

    def _unescape(self, pos: npt.NDArray[np.intp], kind: npt.NDArray[np.uint8],
                  size: int) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.uint8]]:
        """Drop backslashes and the bytes they escape (a run of backslashes of odd length escapes the next)."""
        if self.odd_backslashes:  # the last chunk ended in an odd run: one backslash before this chunk
            pos, kind = np.concatenate(([-1], pos)), np.concatenate(([2], kind)).astype(np.uint8)
        slash = kind == 2
        adjacent = np.concatenate(([False], np.diff(pos) == 1))
        starts = slash & ~(adjacent & np.concatenate(([False], slash[:-1])))
        first = np.flatnonzero(starts)
        run = np.arange(pos.size) - first[np.maximum(np.cumsum(starts) - 1, 0)] + 1  # backslashes so far in a run
        odd = slash & (run & 1).astype(bool)
        escaped = np.concatenate(([False], odd[:-1] & adjacent[1:]))
        self.odd_backslashes = bool(odd[-1] and pos[-1] == size - 1)
        keep = ~slash & ~escaped
        return pos[keep], kind[keep]

    def _strings(self, quotes: npt.NDArray[np.intp], end: int) -> list[tuple[int, str]]:
        """A string over :data:`MAX_STRING_BYTES` (``quotes``: this chunk's, absolute; ``end``: its end)."""
        if self.in_str:
            quotes = np.concatenate(([self.str_start], quotes))
        opens, closes = quotes[0::2], quotes[1::2]
        long = np.flatnonzero(closes - opens[:closes.size] > MAX_STRING_BYTES + 1)
        if long.size:
            start = int(opens[long[0]])
        elif opens.size > closes.size and end - int(opens[-1]) > MAX_STRING_BYTES + 1:
            start = int(opens[-1])
        else:
            return []
        return [(start + MAX_STRING_BYTES + 1, f"a string longer than {MAX_STRING_BYTES:,} bytes")]

    def _numbers(self, text: bytes, base: int, qpos: npt.NDArray[np.intp]) -> list[tuple[int, str]]:
        """Digit runs and exponents over the limits outside strings: found in ``text`` (the carried number and
        the chunk, translated; it starts at offset ``base``), then each match checked against the chunk's
        quotes (inside a string, the search goes on after it)."""
        shift = len(self.number)
        out = []
        for pattern, reason, exponent in _NUMBER_LIMITS:
            at = text.find(pattern)
            while at >= 0:
                rel = at - shift
                before = int(np.searchsorted(qpos, rel)) if rel >= 0 else 0
                if rel < 0 or not (before + self.in_str) & 1:  # outside a string (a carried run always is)
                    start = len(text[:at].rstrip(_NUMBER_CHARS))
                    if not exponent or start < at:  # an exponent follows digits
                        out.append((base + start, reason))
                        break
                    at = text.find(pattern, at + 1)
                elif before < qpos.size:
                    at = text.find(pattern, int(qpos[before]) + shift)
                else:
                    break
        return out

    def _containers(self, base: int, pos: npt.NDArray[np.intp], depth: npt.NDArray[np.int64],
                    delta: npt.NDArray[np.int64], end: int) -> None:
        """The top-level key and the start of the event of the opens among the first ``end`` special bytes."""
        opened = delta[:end] > 0
        if not self.bare and (top := np.flatnonzero(opened & (depth[:end] == 2))).size:
            self.top_key = self._key_before(base + int(pos[top[-1]]))
        if (event := np.flatnonzero(opened & (depth[:end] == (2 if self.bare else 3)))).size:
            self.event_start = base + int(pos[event[-1]])

    def _kept(self, start: int, end: int) -> bytes:
        """The kept bytes from offset ``start`` (or the oldest kept) to ``end``."""
        first = self.total - len(self.tail)
        return bytes(self.tail[max(start - first, 0):max(end - first, 0)])

    def _key_before(self, at: int) -> str:
        """The object key written just before offset ``at`` ('' if none)."""
        m = _KEY_BEFORE.search(self._kept(at - 512, at))
        return m.group(1).decode("utf-8", "replace") if m else ""

    def _where(self, at: int, base: int, pos: npt.NDArray[np.intp], depth: npt.NDArray[np.int64],
               delta: npt.NDArray[np.int64]) -> str:
        """Where offset ``at`` is: in traceEvents (with the event's name), a top-level key, the top level."""
        before = int(np.searchsorted(pos, at - base))
        self._containers(base, pos, depth, delta, before)
        level = int(depth[before - 1]) if before else self.depth
        if self.bare is None or level == 0:
            where = "at the top level"
        elif self.bare or (self.top_key == "traceEvents" and level >= 2):
            where = "in traceEvents"
            if level >= (2 if self.bare else 3):
                m = _NAME.search(self._kept(self.event_start, at)) or _NAME.search(self._kept(at, at + 4096))
                where += f" (name {m.group(1).decode('utf-8', 'replace')[:120]!r})" if m else ""
        else:
            where = f"in top-level key {self.top_key if level >= 2 else self._key_before(at)!r}"
        return where


# -- reading -------------------------------------------------------------------------------------------


def _open(path: Path) -> IO[bytes]:
    with path.open("rb") as fh:
        gz = fh.read(2) == b"\x1f\x8b"
    return cast(IO[bytes], gzip.open(path, "rb")) if gz else path.open("rb")


def _fail(path: Path, reason: str, exc: BaseException | None = None) -> ProducerError:
    return ProducerError(f"{path.name}: not a Kineto trace: {reason}" + (f" ({exc})" if exc else ""))


def _head(path: Path, max_bytes: int) -> tuple[dict[str, Any], str]:
    """Top-level keys before ``traceEvents`` and the prefix of the events (``traceEvents.item`` or ``item``)."""
    state: dict[str, str] = {}

    def until_events(events: Iterator[tuple[str, str, Any]]) -> Iterator[tuple[str, str, Any]]:
        for prefix, event, value in events:
            if prefix == "" and event == "start_array":  # a bare array of events ("JSON Array Format")
                state["events"] = "item"
                return
            if prefix == "traceEvents":  # the first event of its value
                state["events"] = "traceEvents.item" if event == "start_array" else ""
                return
            if prefix == "" and event not in ("start_map", "map_key", "end_map"):
                raise _fail(path, "the top level is not a JSON object")
            yield prefix, event, value

    try:
        with _open(path) as fh:
            meta = dict(_IJSON.kvitems(until_events(_IJSON.parse(_Guard(fh, path, max_bytes))), ""))
    except _READ_ERRORS as exc:
        raise _fail(path, "invalid JSON or compression", exc) from exc
    except _VALUE_ERRORS as exc:
        raise _fail(path, "unreadable value before traceEvents", exc) from exc
    if "events" not in state:
        raise _fail(path, "no traceEvents array")
    if not state["events"]:
        raise _fail(path, "traceEvents is not an array")
    return meta, state["events"]


def _tail_keys(data: bytes) -> dict[str, Any]:
    """The top-level members written after the ``traceEvents`` array, from the file's last bytes."""
    text, decoder = data.decode("utf-8", errors="replace"), json.JSONDecoder()
    # When the whole file is in the tail, members before the array also end in "}]": start at its key. The
    # array's end is among the last candidates (few top-level arrays follow it); the leftmost valid one wins.
    best: dict[str, Any] = {}
    for m in reversed(list(_TAIL_CANDIDATE.finditer(text, max(0, text.rfind('"traceEvents"'))))[-64:]):
        found = _members(text, m.end() - 1, decoder)
        if found is not None and "traceEvents" not in found:
            best = found
    return best


def _members(text: str, pos: int, decoder: json.JSONDecoder) -> dict[str, Any] | None:
    """``, "k": v, ... }`` from ``pos`` to the end of ``text`` as a dict; None if it is not exactly that.
    Parsed in place, member by member, so a wrong candidate fails after one member."""
    out: dict[str, Any] = {}
    while True:
        pos = _skip(text, pos)
        if text.startswith("}", pos):
            return out if _skip(text, pos + 1) == len(text) else None
        if not text.startswith(",", pos):
            return None
        try:
            key, pos = decoder.raw_decode(text, _skip(text, pos + 1))
            pos = _skip(text, pos)
            if not isinstance(key, str) or not text.startswith(":", pos):
                return None
            out[key], pos = decoder.raw_decode(text, _skip(text, pos + 1))
        except (ValueError, RecursionError):
            return None


def _skip(text: str, pos: int) -> int:
    return _WS.match(text, pos).end()  # type: ignore[union-attr]  # "\s*" always matches


class _Collector:
    """Per-event state of the pass over ``traceEvents``; times on the trace's clock (ts * 1000)."""

    def __init__(self, spill: Path, budget: MemoryBudget) -> None:
        self.spill = spill
        self.budget = budget
        self.cats: dict[str, tuple[str, bool]] = {}
        self.names: list[str] = []
        self.name_ids: dict[str, int] = {}
        self.streams: Counter[int] = Counter()
        self.skipped: Counter[str] = Counter()
        self.cpu_steps: dict[int, tuple[int, int]] = {}
        self.gpu_steps: dict[int, tuple[int, int]] = {}
        self.phases: list[Phase] = []
        self.phase_names: dict[str, tuple[str, PhaseKind]] = {}
        self.buf: list[tuple[int, int, int, int, int, int, int]] = []
        self.graph_launches: set[int] = set()
        self.n = self.max_lag = 0
        self.seen = 0  # items of traceEvents so far
        self.first: int | None = None
        self.last_end: int | None = None
        self.watermark: int | None = None
        self.stream_pgs: dict[int, StreamPG] = {}
        #: The device index of the rank's kernels (``args.device`` of the first kernel that has one).
        self.gpu_index: int | None = None
        #: (start ns, routed tokens) of the forward grouped-GEMM ops seen.
        self.routed: list[tuple[int, int]] = []

    def event(self, e: Any) -> None:
        self.seen += 1
        if type(e) is not dict:
            self.skipped["not_an_object"] += 1
            return
        cat = e.get("cat")
        if type(cat) is not str:
            return
        hit = self.cats.get(cat)
        if hit is None:
            low = cat.lower()
            hit = (("gpu", True) if low in GPU_CATEGORIES else ("ann", _ANNOTATIONS[low]) if low in _ANNOTATIONS
                   else ("op", False) if low == "cpu_op" else ("", False))
            if len(self.cats) < 1024:
                self.cats[cat] = hit
        kind, on_gpu = hit
        if kind == "op":
            if e.get("name") in _GROUPED_OPS:
                self._routed(e)
            return
        if not kind:
            if cat.lower() in _RUNTIME_CATEGORIES:
                self._runtime(e)
            return
        if e.get("ph", "X") != "X":
            return
        name = e.get("name")
        name = name.strip() if isinstance(name, str) else ""
        reason, start, dur = self._check(name, e.get("ts"), e.get("dur"))
        args = e.get("args")
        stream = args.get("stream") if type(args) is dict else None
        if type(stream) is not int or not 0 <= stream < 2**32:
            tid = e.get("tid")  # Kineto's GPU rows: tid = stream
            stream = tid if type(tid) is int and 0 <= tid < 2**32 else None
        if not reason and kind == "gpu" and stream is None:
            reason = "missing_stream"
        if reason:
            self.skipped[reason] += 1
        elif kind == "gpu":
            self._kernel(name, stream or 0, start, dur, args if type(args) is dict else None)
            if self.gpu_index is None and type(args) is dict:  # the rank's GPU: its first kernel's device
                dev = args.get("device")
                self.gpu_index = dev if type(dev) is int and 0 <= dev < 2**16 else None
            if stream is not None and stream not in self.stream_pgs and len(self.stream_pgs) < _MAX_PG_STREAMS \
                    and type(args) is dict and "Process Group Name" in args:
                pg = stream_pg(args)
                if pg is not None:
                    self.budget.charge(len(pg.ranks) * MemoryBudget.MEMBER_BYTES + len(pg.name) + len(pg.desc))
                    self.stream_pgs[stream] = pg
        else:
            self._annotation(name, on_gpu, stream if on_gpu and stream is not None else -1, start, dur)

    def _routed(self, e: dict[str, Any]) -> None:
        """A forward grouped-GEMM op: its first input's rows are the tokens routed to the rank's experts."""
        args = e.get("args")
        dims = args.get("Input Dims") if type(args) is dict else None
        first = dims[0] if type(dims) is list and dims else None
        tokens = first[0] if type(first) is list and first else None
        ts = to_ns(e.get("ts"))
        if type(tokens) is not int or not 0 <= tokens < 2**53 or ts is None or not -_MAX_NS < ts < _MAX_NS:
            self.skipped["invalid_routed_tokens"] += 1
            return
        self.budget.charge(MemoryBudget.PHASE_BYTES)
        self.routed.append((ts, tokens))

    @staticmethod
    def _check(name: str, ts: Any, dur: Any) -> tuple[str, int, int]:
        """('' or the reason to skip, start ns, duration ns)."""
        if not name:
            return "missing_name", 0, 0
        if ts is None or dur is None:
            return "missing_ts" if ts is None else "missing_dur", 0, 0
        t, d = to_ns(ts), to_ns(dur)
        if t is None or not -_MAX_NS < t < _MAX_NS:
            return "invalid_ts", 0, 0
        if d is None or d >= _MAX_NS:
            return "invalid_dur", 0, 0
        return ("negative_dur" if d < 0 else ""), t, d

    def _runtime(self, e: dict[str, Any]) -> None:
        """A runtime call: the correlation id of a CUDA graph launch is kept (see ``graph_launches``)."""
        name, args = e.get("name"), e.get("args")
        if not (isinstance(name, str) and name.startswith(_GRAPH_LAUNCHES) and type(args) is dict):
            return
        corr = args.get("correlation")
        if type(corr) is int and 0 <= corr < 2**63 and len(self.graph_launches) < _MAX_GRAPH_LAUNCHES:
            self.budget.charge(MemoryBudget.MEMBER_BYTES)
            self.graph_launches.add(corr)

    def _kernel(self, name: str, stream: int, start: int, dur: int, args: dict[str, Any] | None = None) -> None:
        idx = self.name_ids.get(name)
        if idx is None:
            self.budget.charge(2 * len(name) + 100)  # kept twice (list and dict) with the dict's entry
            idx = self.name_ids[name] = len(self.names)
            self.names.append(name)
        graph, node, corr = 0, 0, -1
        if args is not None:
            g, n, c = args.get("graph id"), args.get("graph node id"), args.get("correlation")
            graph = g if type(g) is int and 0 < g < 2**32 - 1 else 0
            node = n if type(n) is int and graph and 0 <= n < 2**64 else 0
            node = node - 2**64 if node >= 2**63 else node  # a 64-bit id as its int64 bit pattern
            corr = c if type(c) is int and 0 <= c < 2**63 else -1
        self.buf.append((idx, stream, start, dur, graph, node, corr))
        if len(self.buf) >= _SPILL_ROWS:
            self.flush()

    def _annotation(self, name: str, on_gpu: bool, stream: int, start: int, dur: int) -> None:
        m = _STEP_RE.fullmatch(name)
        if m is None:
            known = self.phase_names.get(name)
            if known is None:  # one string and one classification per distinct name, however often it repeats
                known = (name, classify_phase(name))
                self.budget.charge(len(name))
                if len(self.phase_names) < _MAX_INTERNED:
                    self.phase_names[name] = known
            self.budget.charge(MemoryBudget.PHASE_BYTES)
            self.phases.append(Phase(known[1], known[0], stream, start, dur, on_gpu))
            return
        digits = m.group(1)
        if len(digits) > _MAX_STEP_DIGITS or int(digits) >= 2**31:
            self.skipped["invalid_step"] += 1
            return
        step = int(digits)
        if on_gpu:
            old = self.gpu_steps.get(step, (start, start + dur))
            self.gpu_steps[step] = (min(old[0], start), max(old[1], start + dur))
        elif step in self.cpu_steps:
            self.skipped["duplicate_step"] += 1
        else:
            self.cpu_steps[step] = (start, dur)

    def flush(self) -> None:
        """Spill the buffered kernels; their statistics are taken here, vectorized."""
        if not self.buf:
            return
        cols = np.array(self.buf, dtype=np.int64)
        self.buf.clear()
        rows = np.empty(cols.shape[0], dtype=_SPILL)
        for i, f in enumerate(_SPILL.names or ()):
            rows[f] = cols[:, i]
        with self.spill.open("ab") as fh:
            rows.tofile(fh)
        start, end = cols[:, 2], cols[:, 2] + cols[:, 3]
        # No kernel before this chunk: the first start is its own reference (an open-ended sentinel would
        # overflow int64 in the subtraction below).
        prior = int(start[0]) if self.watermark is None else self.watermark
        seen = np.maximum.accumulate(np.concatenate(([prior], start)))[:-1]
        self.max_lag = max(self.max_lag, int((seen - start).max()))
        self.watermark = max(prior, int(start.max()))
        self.first = min(int(start.min()), _OPEN_END if self.first is None else self.first)
        self.last_end = max(int(end.max()), -_OPEN_END if self.last_end is None else self.last_end)
        self.n += cols.shape[0]
        for st, c in zip(*np.unique(cols[:, 1], return_counts=True), strict=True):
            self.streams[int(st)] += int(c)

    def latest_ns(self) -> int | None:
        """The latest time of anything kept (a kernel's, step's or phase's end), on the trace's clock."""
        ends = [end for _, end in self.gpu_steps.values()]
        ends += [start + dur for start, dur in self.cpu_steps.values()]
        ends += [p.start_ns + p.dur_ns for p in self.phases]
        if self.last_end is not None:
            ends.append(self.last_end)
        return max(ends, default=None)

    def step_spans(self, base: int) -> list[StepSpan]:
        out = []
        routed = np.array(sorted(self.routed), dtype=np.int64).reshape(-1, 2)
        cum = np.concatenate([[0], np.cumsum(routed[:, 1])])
        for step in set(self.cpu_steps) | set(self.gpu_steps):
            g = self.gpu_steps.get(step)
            start, dur = self.cpu_steps.get(step) or (g[0], g[1] - g[0])  # type: ignore[index]
            tokens = None
            if routed.size and step in self.cpu_steps:  # host ops belong to the host's step span
                lo, hi = np.searchsorted(routed[:, 0], [start, start + dur])
                tokens = int(cum[hi] - cum[lo])
            out.append(StepSpan(step, start + base, dur, g and g[0] + base, g and g[1] + base,
                                expert_tokens=tokens))
        return sorted(out, key=lambda s: s.start_ns)


def parse_rank(path: Path, spill_dir: Path | None = None, *, max_file_bytes: int = MAX_FILE_BYTES,
               budget: MemoryBudget | None = None) -> RankTrace:
    """Read one rank's trace file in one streaming pass (see the module docstring).

    Hostile or broken input is refused before the JSON parser sees it (see :class:`_Guard`): nesting deeper
    than :data:`MAX_DEPTH`, more than :data:`MAX_NUMBER_DIGITS` digits in a row or :data:`MAX_EXPONENT_DIGITS`
    exponent digits in a number, a string over :data:`MAX_STRING_BYTES`, more than ``max_file_bytes`` bytes
    after decompression, a world size over :data:`MAX_WORLD_SIZE`, a rank not below it or not below the file's
    ``distributedInfo.world_size``. Memory stays proportional to what is kept (distinct kernel names, steps,
    phases), never to nesting or number size.

    Args:
        path: a Kineto ``.json`` or ``.json.gz`` file (gzip is detected by content).
        spill_dir: where to put the kernel spill file; default: a private temporary directory.
        max_file_bytes: the most bytes the file may hold after decompression (default :data:`MAX_FILE_BYTES`).
        budget: what the import may keep in memory, shared by its files (default: :data:`MAX_KEPT_BYTES`
            for this file alone).

    Raises:
        ProducerError: the file is not a trace (bad JSON or gzip, no ``traceEvents`` array), breaks one of the
            limits above (the message names the file and the event: its index in ``traceEvents`` and its name,
            or the top-level key), or its rank is unknown (neither ``distributedInfo.rank`` nor a number in the
            file name).
    """
    path = Path(path)
    meta, prefix = _head(path, max_file_bytes)
    owned = Path(tempfile.mkdtemp(prefix="argus-kineto-")) if spill_dir is None else None
    with tempfile.NamedTemporaryFile("wb", dir=owned or spill_dir, suffix=".kernels", delete=False) as sp:
        spill = Path(sp.name)
    try:
        budget = budget if budget is not None else MemoryBudget(MAX_KEPT_BYTES)
        budget.path = path
        col = _Collector(spill, budget)
        try:
            with _open(path) as fh:
                reader = _Guard(fh, path, max_file_bytes, lambda: col.seen)
                for e in _IJSON.items(reader, prefix, buf_size=_CHUNK):
                    col.event(e)
            col.flush()
        except _READ_ERRORS as exc:
            raise _fail(path, "invalid JSON or compression", exc) from exc
        except _VALUE_ERRORS as exc:
            raise _fail(path, f"unreadable value at traceEvents[{col.seen}]", exc) from exc
        if prefix != "item":
            for key, value in _tail_keys(bytes(reader.tail[-_TAIL:])).items():
                meta.setdefault(key, value)
            if "distributedInfo" not in meta and reader.total > _TAIL:
                with _open(path) as fh:  # written before the last bytes: one more (C-level) scan
                    found = _IJSON.items(_Guard(fh, path, max_file_bytes), "distributedInfo")
                    meta["distributedInfo"] = next(iter(found), None)
        trace = _build(path, meta, col, spill, owned)
        _kernel_spans(trace)
        return trace
    except BaseException:
        spill.unlink(missing_ok=True)
        if owned is not None:
            shutil.rmtree(owned, ignore_errors=True)
        raise


def _build(path: Path, meta: dict[str, Any], col: _Collector, spill: Path, owned: Path | None) -> RankTrace:
    info = meta.get("distributedInfo")
    info = info if isinstance(info, dict) else {}
    rank, source = info.get("rank"), "distributedInfo.rank"
    if type(rank) is not int or rank < 0:
        rank, source = rank_from_name(path), "the rank in the file name"
        if rank is None:
            raise ProducerError(f"{path.name}: no rank: neither distributedInfo.rank nor a rank number in the file "
                                f"name (e.g. rank-1, rank1, worker3)")
    ws, pg, dev = info.get("world_size"), info.get("pg_config"), meta.get("deviceProperties")
    ws = ws if type(ws) is int and ws > 0 else None
    # A job's arrays (topology, per-rank state) are as long as its world: bound it before anything is built.
    if ws is not None and ws > MAX_WORLD_SIZE:
        raise ProducerError(f"{path.name}: refused: distributedInfo.world_size {ws:,} is over {MAX_WORLD_SIZE:,}")
    # A rank from the file name is checked against the world of all files, by the importer.
    if rank >= MAX_WORLD_SIZE or (ws is not None and source == "distributedInfo.rank" and rank >= ws):
        limit = f"the largest world size {MAX_WORLD_SIZE:,}" if rank >= MAX_WORLD_SIZE else f"world_size {ws:,}"
        raise ProducerError(f"{path.name}: refused: rank {rank:,} ({source}) is outside {limit}")
    pgs = list(pg.values()) if isinstance(pg, dict) else pg if isinstance(pg, list) else []
    device = dev[0].get("name") if isinstance(dev, list) and dev and isinstance(dev[0], dict) else None
    host, base = meta.get("host_name"), meta.get("baseTimeNanoseconds")
    base = base if type(base) is int and 0 <= base < _MAX_NS else 0
    latest = col.latest_ns()
    # Each time is under 2^62 ns on the trace's clock; with the base added it must stay so (records carry int64
    # nanoseconds, and their checks refuse 2^62 and beyond): a file beyond it is refused, not half imported.
    if latest is not None and latest + base >= _MAX_NS:
        raise ProducerError(f"{path.name}: refused: times reach {latest + base:,} ns (baseTimeNanoseconds "
                            f"{base:,} included), beyond 2^62 ns")
    return RankTrace(
        path=path, rank=rank, world_size=ws, base_ns=base,
        pg_config=[g for g in pgs if isinstance(g, dict)], device=device if isinstance(device, str) else None,
        host=host if isinstance(host, str) else None, steps=col.step_spans(base),
        phases=_rebased(col.phases, base),
        kernel_events=col.n, names=col.names, streams=dict(col.streams), skipped=col.skipped,
        first_kernel_ns=None if col.first is None else col.first + base,
        last_kernel_end_ns=None if col.last_end is None else col.last_end + base, max_lag_ns=col.max_lag,
        gpu_index=col.gpu_index,
        stream_pgs=col.stream_pgs, graph_launches=frozenset(col.graph_launches),
        spill=spill, owned_dir=owned)


def _rebased(phases: list[Phase], base: int) -> list[Phase]:
    """``phases`` moved by ``base`` ns, in place: each old phase is freed as its new one is made, so the
    list is never held twice."""
    if base:
        for i, p in enumerate(phases):
            phases[i] = Phase(p.kind, p.name, p.stream, p.start_ns + base, p.dur_ns, p.on_gpu)
    return phases


def _kernel_spans(trace: RankTrace) -> None:
    """Per step: first kernel start and last kernel end of its kernels (one binary pass over the spill)."""
    if not trace.steps:
        return
    iv = trace.intervals(gpu=True)
    lo: dict[int, int] = {}
    hi: dict[int, int] = {}
    for rows in trace.rows(_SPILL_ROWS):
        steps, ends = assign_steps(iv, rows["start"]), rows["start"] + rows["dur"]
        for s in np.unique(steps[steps >= 0]).tolist():
            sel = steps == s
            lo[s] = min(lo.get(s, _OPEN_END), int(rows["start"][sel].min()))
            hi[s] = max(hi.get(s, -_OPEN_END), int(ends[sel].max()))
    trace.steps = [dataclasses.replace(s, kernel_start_ns=lo.get(s.step), kernel_end_ns=hi.get(s.step))
                   for s in trace.steps]
