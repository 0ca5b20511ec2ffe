"""Streaming parse of one torch.profiler / Kineto Chrome-trace file (``.json`` or ``.json.gz``) of one rank.

Memory stays bounded whatever the file size: the file is never loaded whole. One pass with ``ijson`` (its C
backend ``yajl2_c`` when installed) walks ``traceEvents`` event by event:

* GPU activities (``cat`` ``kernel``, ``gpu_memcpy``, ``gpu_memset``, case-insensitive) go, as fixed-size
  binary rows (name id, stream, start, duration), to a spill file on disk, so only the distinct kernel names
  stay in memory;
* ``ProfilerStep#N`` annotations (CPU ``user_annotation`` and GPU ``gpu_user_annotation``) become steps, other
  annotations phases: these are few per step and kept in memory;
* everything else (CPU ops, runtime calls, flows) is skipped.

The small top-level keys (``distributedInfo``, ``baseTimeNanoseconds``, ``deviceProperties``, ``host_name``)
are read by a cheap scan of the file's head, which stops where ``traceEvents`` begins. When
``distributedInfo`` is not there (it was written after the events) it is collected during the same pass by a
second, C-level prefix filter over the same bytes.

Times: Kineto writes ``ts``/``dur`` in microseconds, possibly with sub-µs decimals. Numbers are parsed
exactly (``Decimal``, not float: a float loses the ns digits of an epoch in µs) and rounded to integer ns;
``ts`` is relative to ``baseTimeNanoseconds`` when the trace carries it. Events with missing or invalid
fields are skipped and counted by reason, never fatal.

Steps of kernels: a kernel belongs to the step whose GPU ``ProfilerStep#N`` span contains its start, or,
without GPU step annotations, to the step whose CPU span *extended to the next step's start* contains it
(kernels run after the CPU launched them; the last step is open-ended); else step -1.
"""

from __future__ import annotations

import contextlib
import gzip
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
from typing import IO, Any

import ijson
import numpy as np
import numpy.typing as npt

from argus.errors import ProducerError
from schemas.records import KernelBatch, ParallelGroup, PhaseBatch, PhaseKind, Record, Step

__all__ = ["GPU_CATEGORIES", "RankTrace", "StepSpan", "classify_phase", "parse_rank", "rank_from_name",
           "read_trace", "to_ns"]

#: Event categories imported as kernel events (compared lower-case).
GPU_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
_ANNOTATIONS = {"user_annotation": False, "gpu_user_annotation": True}  # category -> on the GPU timeline
_STEP_RE = re.compile(r"ProfilerStep#(\d+)")
_RANK_RE = re.compile(r"(?:rank|worker)[-_]?(\d+)", re.IGNORECASE)
_SPILL = np.dtype([("name", "<u4"), ("stream", "<u4"), ("start", "<i8"), ("dur", "<i8")])
_SPILL_ROWS = 65_536
_CHUNK = 256 * 1024
#: Top-level keys also looked for after ``traceEvents`` (each costs one more C-level scan of the file).
_LATE_KEYS = ("distributedInfo", "baseTimeNanoseconds")
_MAX_NS = 2**62
_OPEN_END = np.iinfo(np.int64).max
_U32 = 2**32

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


def classify_phase(name: str) -> PhaseKind:
    """The phase kind of an annotation name (case-insensitive substring rules; see module docstring)."""
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
    elif t is not Decimal:
        return None
    try:
        if not value.is_finite():
            return None
        return int((value * 1000).to_integral_value(rounding=ROUND_HALF_EVEN))
    except (InvalidOperation, OverflowError):
        return None


def rank_from_name(path: Path) -> int | None:
    """A rank number in a file name (``rank-1``, ``rank1``, ``rank_1``, ``worker3``), else None."""
    m = _RANK_RE.search(path.name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class StepSpan:
    """One ``ProfilerStep#N`` of a rank; times in ns on the trace's clock (before any alignment)."""

    step: int
    start_ns: int
    dur_ns: int
    #: GPU-timeline span (union over streams) when the trace has GPU step annotations.
    gpu_start_ns: int | None = None
    gpu_end_ns: int | None = None
    #: First kernel start to last kernel end of the kernels assigned to the step.
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
    """What :func:`parse_rank` read from one file; kernels wait in a spill file until :meth:`kernel_batches`.

    Close it (or use it as a context manager) to delete the spill file.
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
    #: Largest distance a kernel start lies behind an earlier kernel start in file order (out-of-order).
    max_lag_ns: int = 0
    _spill: Path | None = None
    _owned_dir: Path | None = field(default=None, repr=False)

    # -- records ---------------------------------------------------------------------------------------

    def step_records(self, job_id: str, shift_ns: int = 0) -> list[Step]:
        out = []
        for s in self.steps:
            gpu = None if s.kernel_start_ns is None or s.kernel_end_ns is None else s.kernel_end_ns - s.kernel_start_ns
            out.append(Step(job_id, self.rank, s.step, s.start_ns + shift_ns, s.dur_ns, gpu))
        return out

    def phase_batches(self, job_id: str, shift_ns: int = 0) -> list[PhaseBatch]:
        """One :class:`PhaseBatch` per step (step -1: phases outside every step), ascending."""
        starts = np.array([p.start_ns for p in self.phases], dtype=np.int64)
        on_gpu = np.array([p.on_gpu for p in self.phases], dtype=bool)
        steps = np.where(on_gpu, _assign(self._intervals(gpu=True), starts), _assign(self._intervals(gpu=False), starts))
        by_step: dict[int, list[Phase]] = {}
        for p, step in zip(self.phases, steps.tolist(), strict=True):
            by_step.setdefault(step, []).append(p)
        return [
            PhaseBatch(job_id, self.rank, step, tuple(p.kind for p in ps), tuple(p.name for p in ps),
                       tuple(ParallelGroup.NONE for _ in ps), tuple(p.stream for p in ps),
                       tuple(p.start_ns + shift_ns for p in ps), tuple(p.dur_ns for p in ps))
            for step, ps in sorted(by_step.items())
        ]

    def kernel_batches(self, job_id: str, batch_events: int, shift_ns: int = 0, seq0: int = 0,
                       host: str = "") -> Iterator[KernelBatch]:
        """The rank's kernels in file order, ``batch_events`` per batch; the last has ``end_of_stream``."""
        if batch_events < 1:
            raise ValueError(f"batch_events must be >= 1, got {batch_events}")
        iv = self._intervals(gpu=True)
        seq = seq0
        pending: KernelBatch | None = None
        for rows in self._rows(batch_events):
            uniq, inv = np.unique(rows["name"], return_inverse=True)
            batch = KernelBatch(
                job_id=job_id, rank=self.rank, seq=seq, names=tuple(self.names[int(i)] for i in uniq),
                name_idx=inv.astype(np.uint32), stream=rows["stream"], start_ns=rows["start"] + shift_ns,
                duration_ns=rows["dur"], step=_assign(iv, rows["start"]), host=host)
            seq += 1
            if pending is not None:
                yield pending
            pending = batch
        if pending is None:
            yield KernelBatch.empty(job_id, self.rank, seq, end_of_stream=True, host=host)
        else:
            yield _with_eos(pending)

    def records(self, job_id: str, batch_events: int = 4096, shift_ns: int = 0, host: str = "") -> Iterator[Record]:
        """Steps, then phase batches, then kernel batches (the last one ``end_of_stream``) of this rank."""
        yield from self.step_records(job_id, shift_ns)
        yield from self.phase_batches(job_id, shift_ns)
        yield from self.kernel_batches(job_id, batch_events, shift_ns, host=host)

    # -- helpers ---------------------------------------------------------------------------------------

    def _rows(self, n: int) -> Iterator[npt.NDArray[Any]]:
        if self._spill is None or not self.kernel_events:
            return
        with self._spill.open("rb") as fh:
            while True:
                rows = np.fromfile(fh, dtype=_SPILL, count=n)
                if not rows.shape[0]:
                    return
                if self.base_ns:
                    rows["start"] += self.base_ns
                yield rows

    def _intervals(self, gpu: bool) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int32]]:
        """Sorted step spans ``(starts, ends, steps)`` used to assign events to steps.

        ``gpu``: for GPU-timeline events (kernels, GPU annotations): a step's GPU span where annotated.
        Otherwise, and for host events, the CPU span extended to the next step's start (the last is open).
        """
        spans: list[tuple[int, int, int]] = []
        steps = sorted(self.steps, key=lambda s: s.start_ns)
        for i, s in enumerate(steps):
            if gpu and s.gpu_start_ns is not None and s.gpu_end_ns is not None:
                spans.append((s.gpu_start_ns, s.gpu_end_ns, s.step))
            else:
                end = steps[i + 1].start_ns if i + 1 < len(steps) else _OPEN_END
                spans.append((s.start_ns, max(end, s.start_ns + s.dur_ns), s.step))
        spans.sort()
        return (np.array([a for a, _, _ in spans], dtype=np.int64), np.array([b for _, b, _ in spans], dtype=np.int64),
                np.array([c for _, _, c in spans], dtype=np.int32))

    def close(self) -> None:
        if self._owned_dir is not None:
            shutil.rmtree(self._owned_dir, ignore_errors=True)
            self._owned_dir = None
        elif self._spill is not None:
            self._spill.unlink(missing_ok=True)
        self._spill = None

    def __enter__(self) -> RankTrace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _assign(iv: tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int32]],
            t: npt.NDArray[np.int64]) -> npt.NDArray[np.int32]:
    starts, ends, steps = iv
    if not starts.shape[0]:
        return np.full(t.shape[0], -1, dtype=np.int32)
    idx = np.searchsorted(starts, t, side="right") - 1
    safe = np.clip(idx, 0, None)
    ok = (idx >= 0) & (t < ends[safe])
    return np.where(ok, steps[safe], -1).astype(np.int32)


def _with_eos(b: KernelBatch) -> KernelBatch:
    return KernelBatch(job_id=b.job_id, rank=b.rank, seq=b.seq, names=b.names, name_idx=b.name_idx, stream=b.stream,
                       start_ns=b.start_ns, duration_ns=b.duration_ns, step=b.step, host=b.host, end_of_stream=True)


# -- file reading ---------------------------------------------------------------------------------------


def _open(path: Path) -> IO[bytes]:
    fh = path.open("rb")
    magic = fh.read(2)
    fh.seek(0)
    if magic == b"\x1f\x8b":
        return gzip.GzipFile(fileobj=fh, mode="rb")  # type: ignore[return-value]
    return fh


def _fail(path: Path, reason: str, exc: BaseException | None = None) -> ProducerError:
    return ProducerError(f"{path.name}: not a Kineto trace: {reason}" + (f" ({exc})" if exc else ""))


_READ_ERRORS = (ijson.JSONError, OSError, EOFError, zlib.error, UnicodeDecodeError)


def _head(path: Path) -> tuple[dict[str, Any], str]:
    """Top-level keys before ``traceEvents`` and the prefix of the events (``traceEvents.item`` or ``item``)."""
    meta: dict[str, Any] = {}
    key: str | None = None
    builder: Any = None
    depth = 0
    try:
        with _open(path) as fh:
            for prefix, event, value in _IJSON.parse(fh, buf_size=64 * 1024):
                if builder is not None:
                    builder.event(event, value)
                    depth += 1 if event in ("start_map", "start_array") else -1 if event in ("end_map", "end_array") else 0
                    if depth == 0:
                        meta[key or ""], builder = builder.value, None
                    continue
                if prefix == "":
                    if event == "start_array":
                        return meta, "item"  # a bare JSON array of events (Chrome "JSON Array Format")
                    if event == "map_key":
                        key = value
                    elif event == "end_map":
                        break
                    elif event != "start_map":
                        raise _fail(path, "the top level is not a JSON object")
                    continue
                if key == "traceEvents":
                    if event != "start_array":
                        raise _fail(path, "traceEvents is not an array")
                    return meta, "traceEvents.item"
                if event in ("start_map", "start_array"):
                    builder, depth = ijson.ObjectBuilder(), 1
                    builder.event(event, value)
                else:
                    meta[key or ""] = value
    except _READ_ERRORS as exc:
        raise _fail(path, "invalid JSON or compression", exc) from exc
    raise _fail(path, "no traceEvents array")


class _Collector:
    """Per-event state of the single pass over ``traceEvents``."""

    def __init__(self, spill: IO[bytes]) -> None:
        self.spill = spill
        self.cats: dict[Any, tuple[str, bool]] = {}
        self.names: list[str] = []
        self.name_ids: dict[str, int] = {}
        self.streams: Counter[int] = Counter()
        self.skipped: Counter[str] = Counter()
        self.cpu_steps: dict[int, tuple[int, int]] = {}
        self.gpu_steps: dict[int, tuple[int, int]] = {}
        self.phases: list[Phase] = []
        self.buf: tuple[list[int], list[int], list[int], list[int]] = ([], [], [], [])
        self.n = 0
        self.first: int | None = None
        self.last_end: int | None = None
        self.watermark: int | None = None
        self.max_lag = 0

    def _kind(self, cat: Any) -> tuple[str, bool]:
        hit = self.cats.get(cat)
        if hit is None:
            low = cat.lower()
            hit = ("gpu", True) if low in GPU_CATEGORIES else ("ann", _ANNOTATIONS[low]) if low in _ANNOTATIONS else ("", False)
            if len(self.cats) < 1024:
                self.cats[cat] = hit
        return hit

    def _times(self, e: dict[str, Any]) -> tuple[int, int] | None:
        ts, dur = e.get("ts"), e.get("dur")
        if ts is None:
            self.skipped["missing_ts"] += 1
            return None
        if dur is None:
            self.skipped["missing_dur"] += 1
            return None
        t, d = to_ns(ts), to_ns(dur)
        if t is None:
            self.skipped["invalid_ts"] += 1
            return None
        if d is None:
            self.skipped["invalid_dur"] += 1
            return None
        if not -_MAX_NS < t < _MAX_NS:
            self.skipped["invalid_ts"] += 1
            return None
        if d < 0:
            self.skipped["negative_dur"] += 1
            return None
        if d >= _MAX_NS:
            self.skipped["invalid_dur"] += 1
            return None
        return t, d

    def event(self, e: Any) -> None:
        if type(e) is not dict:
            self.skipped["not_an_object"] += 1
            return
        cat = e.get("cat")
        if type(cat) is not str:
            return
        kind, on_gpu = self._kind(cat)
        if not kind or e.get("ph", "X") != "X":
            return
        name = e.get("name")
        name = name.strip() if isinstance(name, str) else ""
        if not name:
            self.skipped["missing_name"] += 1
            return
        times = self._times(e)
        if times is None:
            return
        args = e.get("args")
        stream = args.get("stream") if type(args) is dict else None
        if type(stream) is not int or not 0 <= stream < _U32:
            tid = e.get("tid")
            stream = tid if type(tid) is int and 0 <= tid < _U32 else None
        if kind == "gpu":
            if stream is None:
                self.skipped["missing_stream"] += 1
                return
            self._kernel(name, stream, *times)
        else:
            self._annotation(name, on_gpu, -1 if stream is None or not on_gpu else stream, *times)

    def _kernel(self, name: str, stream: int, start: int, dur: int) -> None:
        idx = self.name_ids.get(name)
        if idx is None:
            idx = self.name_ids[name] = len(self.names)
            self.names.append(name)
        names, streams, starts, durs = self.buf
        names.append(idx)
        streams.append(stream)
        starts.append(start)
        durs.append(dur)
        self.streams[stream] += 1
        self.n += 1
        if self.watermark is None or start > self.watermark:
            self.watermark = start
        elif self.watermark - start > self.max_lag:
            self.max_lag = self.watermark - start
        if self.first is None or start < self.first:
            self.first = start
        if self.last_end is None or start + dur > self.last_end:
            self.last_end = start + dur
        if len(names) >= _SPILL_ROWS:
            self.flush()

    def _annotation(self, name: str, on_gpu: bool, stream: int, start: int, dur: int) -> None:
        m = _STEP_RE.fullmatch(name)
        if m is None:
            self.phases.append(Phase(classify_phase(name), name, stream, start, dur, on_gpu))
            return
        step = int(m.group(1))
        if step >= 2**31:
            self.skipped["invalid_step"] += 1
            return
        if on_gpu:
            old = self.gpu_steps.get(step)
            self.gpu_steps[step] = (start, start + dur) if old is None else (min(old[0], start),
                                                                            max(old[1], start + dur))
        elif step in self.cpu_steps:
            self.skipped["duplicate_step"] += 1
        else:
            self.cpu_steps[step] = (start, dur)

    def flush(self) -> None:
        names, streams, starts, durs = self.buf
        if not names:
            return
        rows = np.empty(len(names), dtype=_SPILL)
        rows["name"], rows["stream"], rows["start"], rows["dur"] = names, streams, starts, durs
        rows.tofile(self.spill)
        for col in self.buf:
            col.clear()

    def steps(self) -> list[StepSpan]:
        out = []
        for step in sorted(set(self.cpu_steps) | set(self.gpu_steps)):
            g = self.gpu_steps.get(step)
            c = self.cpu_steps.get(step)
            start, dur = c if c is not None else (g[0], g[1] - g[0]) if g is not None else (0, 0)
            out.append(StepSpan(step, start, dur, g[0] if g else None, g[1] if g else None))
        return sorted(out, key=lambda s: s.start_ns)


def parse_rank(path: Path, spill_dir: Path | None = None) -> RankTrace:
    """Read one rank's trace file in one streaming pass (see the module docstring).

    Args:
        path: a Kineto ``.json`` or ``.json.gz`` file (gzip is detected by content).
        spill_dir: where to put the kernel spill file; default: a private temporary directory.

    Raises:
        ProducerError: the file is not a trace (bad JSON or gzip, no ``traceEvents``), or no rank is known
            (neither ``distributedInfo.rank`` nor a number in the file name).
    """
    path = Path(path)
    meta, events_prefix = _head(path)
    owned = Path(tempfile.mkdtemp(prefix="argus-kineto-")) if spill_dir is None else None
    with tempfile.NamedTemporaryFile("wb", dir=owned or spill_dir, suffix=".kernels", delete=False) as sp:
        spill = Path(sp.name)
    ok = False
    try:
        with spill.open("wb") as sp:
            col = _Collector(sp)
            late = _scan(path, events_prefix, col, late_meta="distributedInfo" not in meta)
            col.flush()
        for key, value in late.items():
            meta.setdefault(key, value)
        trace = _build(path, meta, col, spill, owned)
        _finish_steps(trace)
        ok = True
        return trace
    finally:
        if not ok:
            if owned is not None:
                shutil.rmtree(owned, ignore_errors=True)
            else:
                spill.unlink(missing_ok=True)


def _scan(path: Path, prefix: str, col: _Collector, late_meta: bool) -> dict[str, Any]:
    events = ijson.sendable_list()
    coros = [_IJSON.items_coro(events, prefix)]
    late: dict[str, list[Any]] = {}
    if late_meta and prefix != "item":
        for key in _LATE_KEYS:
            late[key] = ijson.sendable_list()
            coros.append(_IJSON.items_coro(late[key], key))
    try:
        with _open(path) as fh:
            while chunk := fh.read(_CHUNK):
                for c in coros:
                    c.send(chunk)
                for e in events:
                    col.event(e)
                events.clear()
            for c in coros:
                c.close()
        for e in events:
            col.event(e)
    except _READ_ERRORS as exc:
        raise _fail(path, "invalid JSON or compression", exc) from exc
    return {k: v[0] for k, v in late.items() if v}


def _build(path: Path, meta: dict[str, Any], col: _Collector, spill: Path, owned: Path | None) -> RankTrace:
    info = meta.get("distributedInfo")
    info = info if isinstance(info, dict) else {}
    rank = info.get("rank")
    if type(rank) is not int or rank < 0:
        rank = rank_from_name(path)
        if rank is None:
            raise ProducerError(f"{path.name}: no rank: neither distributedInfo.rank nor a rank number in the file "
                                f"name (e.g. rank-1, rank1, worker3)")
    ws = info.get("world_size")
    pg = info.get("pg_config")
    pg_list = list(pg.values()) if isinstance(pg, dict) else pg if isinstance(pg, list) else []
    dev = meta.get("deviceProperties")
    device = dev[0].get("name") if isinstance(dev, list) and dev and isinstance(dev[0], dict) else None
    host = meta.get("host_name")
    base = meta.get("baseTimeNanoseconds")
    base = base if type(base) is int and 0 <= base < _MAX_NS else 0
    # Everything was read on the trace's clock (ts * 1000); public times are absolute: + baseTimeNanoseconds.
    steps = [StepSpan(s.step, s.start_ns + base, s.dur_ns, None if s.gpu_start_ns is None else s.gpu_start_ns + base,
                      None if s.gpu_end_ns is None else s.gpu_end_ns + base) for s in col.steps()]
    phases = [Phase(p.kind, p.name, p.stream, p.start_ns + base, p.dur_ns, p.on_gpu) for p in col.phases]
    return RankTrace(
        path=path, rank=rank, world_size=ws if type(ws) is int and ws > 0 else None,
        base_ns=base, pg_config=[g for g in pg_list if isinstance(g, dict)],
        device=device if isinstance(device, str) else None, host=host if isinstance(host, str) else None,
        steps=steps, phases=phases, kernel_events=col.n, names=col.names, streams=dict(col.streams),
        skipped=col.skipped, first_kernel_ns=None if col.first is None else col.first + base,
        last_kernel_end_ns=None if col.last_end is None else col.last_end + base, max_lag_ns=col.max_lag,
        _spill=spill, _owned_dir=owned)


def _finish_steps(trace: RankTrace) -> None:
    """Per step: first kernel start and last kernel end of its kernels (one binary pass over the spill)."""
    if not trace.steps:
        return
    iv = trace._intervals(gpu=True)
    lo: dict[int, int] = {}
    hi: dict[int, int] = {}
    for rows in trace._rows(_SPILL_ROWS):
        step = _assign(iv, rows["start"])
        ends = rows["start"] + rows["dur"]
        for s in np.unique(step):
            if s < 0:
                continue
            sel = step == s
            a, b = int(rows["start"][sel].min()), int(ends[sel].max())
            lo[int(s)] = min(lo.get(int(s), a), a)
            hi[int(s)] = max(hi.get(int(s), b), b)
    trace.steps = [StepSpan(s.step, s.start_ns, s.dur_ns, s.gpu_start_ns, s.gpu_end_ns, lo.get(s.step),
                            hi.get(s.step)) for s in trace.steps]


def read_trace(path: Path, job_id: str = "kineto", batch_events: int = 4096, shift_ns: int = 0) -> Iterator[Record]:
    """Parse one rank's file and yield its records (steps, phase batches, kernel batches; see
    :meth:`RankTrace.records`). Pure: no Kafka. Raises :class:`ProducerError` like :func:`parse_rank`."""
    with contextlib.closing(parse_rank(path)) as trace:
        yield from trace.records(job_id, batch_events, shift_ns, host=trace.host or "")
