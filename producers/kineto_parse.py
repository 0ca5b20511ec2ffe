"""Streaming parse of one torch.profiler / Kineto Chrome-trace file (``.json`` or ``.json.gz``) of one rank.

Memory stays bounded whatever the file size: the file is never loaded whole. One pass with ``ijson`` (its C
backend ``yajl2_c``) walks ``traceEvents`` event by event:

* GPU activities (``cat`` ``kernel``, ``gpu_memcpy``, ``gpu_memset``, case-insensitive) go as fixed-size binary
  rows (name id, stream, start, duration) to a spill file on disk; only the distinct names stay in memory;
* ``ProfilerStep#N`` annotations (CPU ``user_annotation``, GPU ``gpu_user_annotation``) become steps, other
  annotations phases: few per step, kept in memory;
* everything else (CPU ops, runtime calls, flows) is passed over.

The small top-level keys (``distributedInfo``, ``baseTimeNanoseconds``, ``deviceProperties``, ``host_name``)
come from a scan of the file's head that stops where ``traceEvents`` begins, and, for those written after the
events (Kineto writes ``baseTimeNanoseconds`` there), from the file's last 1 MiB kept while streaming. Only
when ``distributedInfo`` is in neither does one more C-level scan of the whole file look for it.

Times: ``ts``/``dur`` are microseconds, possibly with sub-µs decimals. Numbers are parsed exactly (``Decimal``;
a float loses the ns digits of an epoch in µs) and rounded to integer ns; absolute time is
``baseTimeNanoseconds`` (when present) + ts. Events with missing or invalid fields are skipped and counted by
reason, never fatal.

Steps: a GPU event belongs to the step whose GPU ``ProfilerStep#N`` span contains its start, or, without GPU
step annotations, to the step whose CPU span *extended to the next step's start* contains it (kernels run
after the host launched them; the last step is open-ended); host events use the extended CPU spans; else -1.
"""

from __future__ import annotations

import gzip
import json
import math
import re
import shutil
import tempfile
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from decimal import ROUND_HALF_EVEN, Decimal, InvalidOperation
from pathlib import Path
from types import ModuleType
from typing import IO, Any, cast

import ijson
import numpy as np
import numpy.typing as npt

from argus.errors import ProducerError
from schemas.records import PhaseKind

__all__ = ["GPU_CATEGORIES", "Phase", "RankTrace", "StepSpan", "classify_phase", "parse_rank", "rank_from_name",
           "to_ns"]

#: Event categories imported as kernel events (compared lower-case).
GPU_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
_ANNOTATIONS = {"user_annotation": False, "gpu_user_annotation": True}  # category -> on the GPU timeline
_STEP_RE = re.compile(r"ProfilerStep#(\d+)")
_RANK_RE = re.compile(r"(?:rank|worker)[-_]?(\d+)", re.IGNORECASE)
_SPILL = np.dtype([("name", "<u4"), ("stream", "<u4"), ("start", "<i8"), ("dur", "<i8")])
_SPILL_ROWS = 16_384
_CHUNK = 256 * 1024
_TAIL = 1024 * 1024
_MAX_NS = 2**62
_OPEN_END = np.iinfo(np.int64).max
# The events array ends after its last event object (or is empty): the leftmost such "]" whose remainder is
# one JSON object reaching the end of the file. A "]" inside an event leaves unbalanced closers behind it.
_TAIL_CANDIDATE = re.compile(r"[}\[]\s*\]\s*[,}]")
_WS = re.compile(r"\s*")
_READ_ERRORS = (ijson.JSONError, OSError, EOFError, zlib.error, UnicodeDecodeError)
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
    try:
        return int((value * 1000).to_integral_value(rounding=ROUND_HALF_EVEN))
    except (InvalidOperation, OverflowError):
        return None


def rank_from_name(path: Path) -> int | None:
    """A rank number in a file name (``rank-1``, ``rank1``, ``rank_1``, ``worker3``), else None."""
    m = _RANK_RE.search(path.name)
    return int(m.group(1)) if m else None


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


@dataclass(frozen=True)
class Phase:
    kind: PhaseKind
    name: str
    stream: int
    start_ns: int
    dur_ns: int
    on_gpu: bool


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
    spill: Path | None = field(default=None, repr=False)
    owned_dir: Path | None = field(default=None, repr=False)

    def rows(self, n: int) -> Iterator[npt.NDArray[Any]]:
        """The kernels in file order, ``n`` per array (fields name, stream, start, dur; absolute ns)."""
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


# -- reading -------------------------------------------------------------------------------------------


def _open(path: Path) -> IO[bytes]:
    with path.open("rb") as fh:
        gz = fh.read(2) == b"\x1f\x8b"
    return cast(IO[bytes], gzip.open(path, "rb")) if gz else path.open("rb")


def _fail(path: Path, reason: str, exc: BaseException | None = None) -> ProducerError:
    return ProducerError(f"{path.name}: not a Kineto trace: {reason}" + (f" ({exc})" if exc else ""))


def _head(path: Path) -> tuple[dict[str, Any], str]:
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
            meta = dict(_IJSON.kvitems(until_events(_IJSON.parse(fh)), ""))
    except _READ_ERRORS as exc:
        raise _fail(path, "invalid JSON or compression", exc) from exc
    if "events" not in state:
        raise _fail(path, "no traceEvents array")
    if not state["events"]:
        raise _fail(path, "traceEvents is not an array")
    return meta, state["events"]


class _TailReader:
    """File wrapper keeping the last :data:`_TAIL` bytes read and counting all."""

    def __init__(self, fh: IO[bytes]) -> None:
        self.fh, self.tail, self.total = fh, bytearray(), 0

    def read(self, n: int = -1) -> bytes:
        data = self.fh.read(n)
        self.total += len(data)
        self.tail += data
        if len(self.tail) > 2 * _TAIL:
            del self.tail[:-_TAIL]
        return data


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
        except ValueError:
            return None


def _skip(text: str, pos: int) -> int:
    return _WS.match(text, pos).end()  # type: ignore[union-attr]  # "\s*" always matches


class _Collector:
    """Per-event state of the pass over ``traceEvents``; times on the trace's clock (ts * 1000)."""

    def __init__(self, spill: Path) -> None:
        self.spill = spill
        self.cats: dict[str, tuple[str, bool]] = {}
        self.names: list[str] = []
        self.name_ids: dict[str, int] = {}
        self.streams: Counter[int] = Counter()
        self.skipped: Counter[str] = Counter()
        self.cpu_steps: dict[int, tuple[int, int]] = {}
        self.gpu_steps: dict[int, tuple[int, int]] = {}
        self.phases: list[Phase] = []
        self.buf: list[tuple[int, int, int, int]] = []
        self.n = self.max_lag = 0
        self.first: int | None = None
        self.last_end: int | None = None
        self.watermark: int | None = None

    def event(self, e: Any) -> None:
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
                   else ("", False))
            if len(self.cats) < 1024:
                self.cats[cat] = hit
        kind, on_gpu = hit
        if not kind or e.get("ph", "X") != "X":
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
            self._kernel(name, stream or 0, start, dur)
        else:
            self._annotation(name, on_gpu, stream if on_gpu and stream is not None else -1, start, dur)

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

    def _kernel(self, name: str, stream: int, start: int, dur: int) -> None:
        idx = self.name_ids.get(name)
        if idx is None:
            idx = self.name_ids[name] = len(self.names)
            self.names.append(name)
        self.buf.append((idx, stream, start, dur))
        if len(self.buf) >= _SPILL_ROWS:
            self.flush()

    def _annotation(self, name: str, on_gpu: bool, stream: int, start: int, dur: int) -> None:
        m = _STEP_RE.fullmatch(name)
        if m is None:
            self.phases.append(Phase(classify_phase(name), name, stream, start, dur, on_gpu))
            return
        step = int(m.group(1))
        if step >= 2**31:
            self.skipped["invalid_step"] += 1
        elif on_gpu:
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

    def step_spans(self, base: int) -> list[StepSpan]:
        out = []
        for step in set(self.cpu_steps) | set(self.gpu_steps):
            g = self.gpu_steps.get(step)
            start, dur = self.cpu_steps.get(step) or (g[0], g[1] - g[0])  # type: ignore[index]
            out.append(StepSpan(step, start + base, dur, g and g[0] + base, g and g[1] + base))
        return sorted(out, key=lambda s: s.start_ns)


def parse_rank(path: Path, spill_dir: Path | None = None) -> RankTrace:
    """Read one rank's trace file in one streaming pass (see the module docstring).

    Args:
        path: a Kineto ``.json`` or ``.json.gz`` file (gzip is detected by content).
        spill_dir: where to put the kernel spill file; default: a private temporary directory.

    Raises:
        ProducerError: the file is not a trace (bad JSON or gzip, no ``traceEvents`` array), or its rank is
            unknown (neither ``distributedInfo.rank`` nor a number in the file name).
    """
    path = Path(path)
    meta, prefix = _head(path)
    owned = Path(tempfile.mkdtemp(prefix="argus-kineto-")) if spill_dir is None else None
    with tempfile.NamedTemporaryFile("wb", dir=owned or spill_dir, suffix=".kernels", delete=False) as sp:
        spill = Path(sp.name)
    try:
        col = _Collector(spill)
        try:
            with _open(path) as fh:
                reader = _TailReader(fh)
                for e in _IJSON.items(reader, prefix, buf_size=_CHUNK):
                    col.event(e)
            col.flush()
        except _READ_ERRORS as exc:
            raise _fail(path, "invalid JSON or compression", exc) from exc
        if prefix != "item":
            for key, value in _tail_keys(bytes(reader.tail[-_TAIL:])).items():
                meta.setdefault(key, value)
            if "distributedInfo" not in meta and reader.total > _TAIL:
                with _open(path) as fh:  # written before the last bytes: one more (C-level) scan
                    meta["distributedInfo"] = next(iter(_IJSON.items(fh, "distributedInfo")), None)
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
    rank = info.get("rank")
    if type(rank) is not int or rank < 0:
        rank = rank_from_name(path)
        if rank is None:
            raise ProducerError(f"{path.name}: no rank: neither distributedInfo.rank nor a rank number in the file "
                                f"name (e.g. rank-1, rank1, worker3)")
    ws, pg, dev = info.get("world_size"), info.get("pg_config"), meta.get("deviceProperties")
    pgs = list(pg.values()) if isinstance(pg, dict) else pg if isinstance(pg, list) else []
    device = dev[0].get("name") if isinstance(dev, list) and dev and isinstance(dev[0], dict) else None
    host, base = meta.get("host_name"), meta.get("baseTimeNanoseconds")
    base = base if type(base) is int and 0 <= base < _MAX_NS else 0
    return RankTrace(
        path=path, rank=rank, world_size=ws if type(ws) is int and ws > 0 else None, base_ns=base,
        pg_config=[g for g in pgs if isinstance(g, dict)], device=device if isinstance(device, str) else None,
        host=host if isinstance(host, str) else None, steps=col.step_spans(base),
        phases=[Phase(p.kind, p.name, p.stream, p.start_ns + base, p.dur_ns, p.on_gpu) for p in col.phases],
        kernel_events=col.n, names=col.names, streams=dict(col.streams), skipped=col.skipped,
        first_kernel_ns=None if col.first is None else col.first + base,
        last_kernel_end_ns=None if col.last_end is None else col.last_end + base, max_lag_ns=col.max_lag,
        spill=spill, owned_dir=owned)


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
    trace.steps = [StepSpan(s.step, s.start_ns, s.dur_ns, s.gpu_start_ns, s.gpu_end_ns, lo.get(s.step),
                            hi.get(s.step)) for s in trace.steps]
