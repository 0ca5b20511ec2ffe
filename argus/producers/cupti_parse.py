"""The pure half of the CUPTI kernel channel: activity records -> columns -> KernelBatches, and the rules
that select which processes trace.

Nothing here touches CUPTI or a GPU, so all of it is unit-tested with fake record objects (any object with
the attributes of a ``cupti-python`` activity record). :mod:`argus.producers.cupti_kernels` runs it on its parser
thread.

Details and reasoning: docs/internals/producers.md.
"""

from __future__ import annotations

import collections
import operator
import os
import sys
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from argus.producers.kernel_names import memcpy_name, normalize
from argus.schemas.records import KernelBatch

__all__ = [
    "KIND_CONCURRENT_KERNEL",
    "KIND_KERNEL",
    "KIND_MEMCPY",
    "KIND_MEMSET",
    "ActivityColumns",
    "NameTable",
    "StepMarks",
    "build_kernel_batches",
    "columns_to_batches",
    "cupti_enabled_for",
    "extract_columns",
    "parse_rank_list",
]

#: ``cupti.ActivityKind`` values (stable in the CUPTI ABI), so the parser needs no ``cupti`` import.
KIND_MEMCPY = 1
KIND_MEMSET = 2
KIND_KERNEL = 3
KIND_CONCURRENT_KERNEL = 10
_KERNEL_KINDS = (KIND_KERNEL, KIND_CONCURRENT_KERNEL)


# -- selective enablement --------------------------------------------------------------------------------


def parse_rank_list(spec: str) -> frozenset[int] | None:
    """``"all"``/``""`` -> None (every rank), ``"none"`` -> empty, ``"0,3,8-11"`` -> {0, 3, 8, 9, 10, 11}.

    Raises:
        ValueError: a part is neither an integer nor a ``lo-hi`` range.
    """
    text = spec.strip().lower()
    if text in ("", "all", "*"):
        return None
    if text == "none":
        return frozenset()
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            a, b = (int(lo), int(hi)) if sep else (int(part), int(part))
        except ValueError:
            raise ValueError(f"{part!r} is neither a rank nor a range like 8-11") from None
        if a < 0 or b < a:
            raise ValueError(f"bad rank {'range ' if sep else ''}{part!r}")
        out.update(range(a, b + 1))
    return frozenset(out)


def _is_compile_worker(argv: Sequence[str]) -> bool:
    if any("compile_worker" in a for a in argv):
        return True
    utils = sys.modules.get("torch._inductor.compile_worker.utils")
    in_top = getattr(utils, "in_toplevel_process", None)
    return callable(in_top) and not in_top()


def cupti_enabled_for(rank: int, world_size: int, env: Mapping[str, str] | None = None,
                      argv: Sequence[str] | None = None, distributed_initialized: bool | None = None,
                      ) -> tuple[bool, str]:
    """Whether this process should trace kernels, and why not.

    Rules, first match wins: ``ARGUS_CUPTI=0`` disables; a TorchInductor compile worker (its command line,
    or ``in_toplevel_process()`` false) is skipped; a multi-rank job's process that is neither in an
    initialized process group nor started with ``RANK`` set (a launcher such as the torchrun agent) is
    skipped; ``ARGUS_CUPTI_RANKS`` (``all`` default, ``none``, or ``0,3,8-11``) selects ranks.
    """
    env = os.environ if env is None else env
    argv = sys.argv if argv is None else argv
    if env.get("ARGUS_CUPTI", "1").strip().lower() in ("0", "false", "no", "off"):
        return False, "ARGUS_CUPTI disables kernel tracing"
    if _is_compile_worker(argv):
        return False, "TorchInductor compile worker"
    if world_size > 1:
        if distributed_initialized is None:
            dist = sys.modules.get("torch.distributed")
            distributed_initialized = bool(dist is not None and dist.is_available() and dist.is_initialized())
        if not distributed_initialized and "RANK" not in env:
            return False, "not a torch.distributed worker (no process group, no RANK): launcher process?"
    try:
        ranks = parse_rank_list(env.get("ARGUS_CUPTI_RANKS", "all"))
    except ValueError as exc:
        return False, f"ARGUS_CUPTI_RANKS unreadable ({exc}): kernel tracing off"
    if ranks is not None and rank not in ranks:
        return False, f"rank {rank} not in ARGUS_CUPTI_RANKS"
    return True, ""


# -- step marks ------------------------------------------------------------------------------------------


class StepMarks:
    """Host start times of the latest steps (epoch ns), written by the tracer, read by the parser thread.

    Bounded: only the newest ``capacity`` marks are kept (kernels older than all of them get step -1).
    """

    def __init__(self, capacity: int = 4096) -> None:
        self._starts: collections.deque[int] = collections.deque(maxlen=capacity)
        self._steps: collections.deque[int] = collections.deque(maxlen=capacity)
        self._lock = threading.Lock()

    def mark(self, step: int, start_ns: int) -> None:
        with self._lock:
            self._starts.append(start_ns)
            self._steps.append(step)

    def snapshot(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int32]]:
        with self._lock:
            return np.array(self._starts, dtype=np.int64), np.array(self._steps, dtype=np.int32)


def _assign_steps(start_ns: npt.NDArray[np.int64], marks: tuple[npt.NDArray[np.int64], npt.NDArray[np.int32]]
                  ) -> npt.NDArray[np.int32]:
    starts, steps = marks
    if starts.shape[0] == 0:
        return np.full(start_ns.shape[0], -1, dtype=np.int32)
    order = np.argsort(starts, kind="stable")
    starts, steps = starts[order], steps[order]
    pos = np.searchsorted(starts, start_ns, side="right") - 1
    return np.where(pos >= 0, steps[np.maximum(pos, 0)], -1).astype(np.int32)


# -- parsing (pure) --------------------------------------------------------------------------------------


class NameTable:
    """Normalized kernel names and their ids, shared by the columns of one parser (bounded)."""

    def __init__(self, normalizer: Callable[[str], str] = normalize) -> None:
        self.names: list[str] = []
        self._ids: dict[str, int] = {}
        #: raw name -> id, for names seen before (read directly by the parser's fast path)
        self.raw_ids: dict[str, int] = {}
        self._normalize = normalizer

    def id_of(self, raw: str) -> int:
        """The id of a raw name (normalized once per distinct raw name)."""
        idx = self.raw_ids.get(raw)
        if idx is None:
            canon = self._normalize(raw)
            idx = self._ids.get(canon)
            if idx is None:
                idx = self._ids[canon] = len(self.names)
                self.names.append(canon)
            self.raw_ids[raw] = idx
        return idx

    def __len__(self) -> int:
        return len(self.names)


@dataclass(frozen=True)
class ActivityColumns:
    """Kernel/copy/set events as columns; ``name_id`` indexes a :class:`NameTable`. ``graph_id`` and
    ``graph_node_id``: the CUDA graph (CUPTI ``graphId``, 0 when launched on its own) and node (``graphNodeId``
    as its int64 bit pattern) of each event."""

    name_id: npt.NDArray[np.uint32]
    stream: npt.NDArray[np.uint32]
    start_ns: npt.NDArray[np.int64]
    duration_ns: npt.NDArray[np.int64]
    skipped: int = 0
    graph_id: npt.NDArray[np.uint32] | None = None
    graph_node_id: npt.NDArray[np.int64] | None = None

    def __post_init__(self) -> None:
        n = len(self)
        if self.graph_id is None:
            object.__setattr__(self, "graph_id", np.zeros(n, np.uint32))
        if self.graph_node_id is None:
            object.__setattr__(self, "graph_node_id", np.zeros(n, np.int64))

    def __len__(self) -> int:
        return int(self.name_id.shape[0])

    @classmethod
    def empty(cls) -> ActivityColumns:
        return cls(np.empty(0, np.uint32), np.empty(0, np.uint32), np.empty(0, np.int64), np.empty(0, np.int64))

    @classmethod
    def concat(cls, parts: Sequence[ActivityColumns]) -> ActivityColumns:
        if not parts:
            return cls.empty()
        if len(parts) == 1:
            return parts[0]
        cat = [np.concatenate([getattr(p, f) for p in parts]) for f in _FIELDS]
        return cls(cat[0], cat[1], cat[2], cat[3], sum(p.skipped for p in parts), cat[4], cat[5])

    def slice(self, lo: int, hi: int | None = None) -> ActivityColumns:
        c = [getattr(self, f)[lo:hi] for f in _FIELDS]
        return ActivityColumns(c[0], c[1], c[2], c[3], 0, c[4], c[5])

    def take(self, order: npt.NDArray[np.intp]) -> ActivityColumns:
        """The events in ``order`` (indices)."""
        c = [getattr(self, f)[order] for f in _FIELDS]
        return ActivityColumns(c[0], c[1], c[2], c[3], self.skipped, c[4], c[5])


_FIELDS = ("name_id", "stream", "start_ns", "duration_ns", "graph_id", "graph_node_id")
_KIND = operator.attrgetter("kind")
_START = operator.attrgetter("start")
_END = operator.attrgetter("end")
_STREAM = operator.attrgetter("stream_id")
_NAME = operator.attrgetter("name")
_COPY_KIND = operator.attrgetter("copy_kind")
_GRAPH = operator.attrgetter("graph_id")
_GRAPH_NODE = operator.attrgetter("graph_node_id")


def _graph_columns(recs: list[Any], kernels: npt.NDArray[np.intp], pick: list[Any], n: int
                   ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Per record, the graph id and graph node id of the kernels among them (0 elsewhere, and everywhere for
    records without those fields: CUPTI before graph support, or a collector that leaves them out)."""
    gid, node = np.zeros(n, np.int64), np.zeros(n, np.int64)
    if not kernels.shape[0]:
        return gid, node
    try:
        gid[kernels] = np.fromiter(map(_GRAPH, pick), dtype=np.int64, count=len(pick))
        node[kernels] = np.fromiter(map(_GRAPH_NODE, pick), dtype=np.uint64, count=len(pick)).view(np.int64)
    except AttributeError:  # some records without the fields: they were not graph-launched
        gid[kernels] = [getattr(r, "graph_id", 0) or 0 for r in pick]
        node[kernels] = np.array([getattr(r, "graph_node_id", 0) or 0 for r in pick], np.uint64).view(np.int64)
    return gid, node


def extract_columns(records: Iterable[Any], names: NameTable, clock_offset_ns: int = 0) -> ActivityColumns:
    """Columns of the kernel, memcpy and memset records among ``records`` (others are skipped and counted).

    A record needs ``kind`` (a ``cupti.ActivityKind`` value), ``start``/``end`` (CUPTI ns), ``stream_id``, and
    ``name`` (kernels) or ``copy_kind`` (memcpy); kernels may carry ``graph_id``/``graph_node_id`` (a kernel
    replayed by a CUDA graph: there is no per-kernel launch, and CUPTI names its graph and node instead). Records
    with a zero start or an end before the start are skipped. ``clock_offset_ns`` maps CUPTI time to epoch ns.

    Fields are read column by column with C-level iteration (``map`` + ``attrgetter`` into ``np.fromiter``);
    a buffer with a malformed record falls back to a record-by-record loop that skips (and counts) it.
    """
    recs = records if isinstance(records, list) else list(records)
    n = len(recs)
    try:
        kind = np.fromiter(map(_KIND, recs), dtype=np.int64, count=n)
        start = np.fromiter(map(_START, recs), dtype=np.int64, count=n)
        end = np.fromiter(map(_END, recs), dtype=np.int64, count=n)
        stream = np.fromiter(map(_STREAM, recs), dtype=np.int64, count=n)
    except (AttributeError, TypeError, ValueError, OverflowError):
        return _extract_slowly(recs, names, clock_offset_ns)
    ids = np.full(n, -1, dtype=np.int64)
    kernels = np.flatnonzero((kind == KIND_CONCURRENT_KERNEL) | (kind == KIND_KERNEL))
    pick = [recs[i] for i in kernels.tolist()] if kernels.shape[0] < n else recs
    try:
        gid, node = _graph_columns(recs, kernels, pick, n)
        if kernels.shape[0]:
            raw = list(map(_NAME, pick))
            known: list[int | None] = list(map(names.raw_ids.get, raw))
            if None in known:
                ids[kernels] = [g if g is not None else names.id_of(r or "") for g, r in zip(known, raw, strict=True)]
            else:
                ids[kernels] = known  # type: ignore[assignment]
        for i in np.flatnonzero(kind == KIND_MEMCPY).tolist():
            ids[i] = names.id_of(memcpy_name(_COPY_KIND(recs[i])))
        sets = np.flatnonzero(kind == KIND_MEMSET)
        if sets.shape[0]:
            ids[sets] = names.id_of("memset")
    except (AttributeError, TypeError, ValueError, OverflowError):
        return _extract_slowly(recs, names, clock_offset_ns)
    keep = (ids >= 0) & (start != 0) & (end >= start) & (gid >= 0) & (gid < 2**32)
    skipped = n - int(np.count_nonzero(keep))
    if skipped:
        ids, stream, start, end, gid, node = ids[keep], stream[keep], start[keep], end[keep], gid[keep], node[keep]
    return ActivityColumns(ids.astype(np.uint32), stream.astype(np.uint32), start + clock_offset_ns, end - start,
                           skipped, gid.astype(np.uint32), node)


def _extract_slowly(records: list[Any], names: NameTable, clock_offset_ns: int) -> ActivityColumns:
    ids: list[int] = []
    streams: list[int] = []
    starts: list[int] = []
    ends: list[int] = []
    graphs: list[int] = []
    nodes: list[int] = []
    skipped = 0
    id_of = names.id_of
    for r in records:
        try:
            kind = r.kind
            if kind in _KERNEL_KINDS:
                idx = id_of(r.name or "")
            elif kind == KIND_MEMCPY:
                idx = id_of(memcpy_name(r.copy_kind))
            elif kind == KIND_MEMSET:
                idx = id_of("memset")
            else:
                skipped += 1
                continue
            start, end, stream = int(r.start), int(r.end), int(r.stream_id)
            graph = int(getattr(r, "graph_id", 0) or 0) if kind in _KERNEL_KINDS else 0
            node = int(getattr(r, "graph_node_id", 0) or 0) if graph else 0
            if not start or end < start or not 0 <= stream < 1 << 32 or not 0 <= graph < 1 << 32 \
                    or not 0 <= node < 1 << 64:
                skipped += 1
                continue
            ids.append(idx)
            streams.append(stream)
            starts.append(start)
            ends.append(end)
            graphs.append(graph)
            nodes.append(node - (1 << 64) if node >= 1 << 63 else node)
        except (AttributeError, TypeError, ValueError, OverflowError):
            skipped += 1
    start_arr = np.array(starts, dtype=np.int64)
    dur = np.array(ends, dtype=np.int64) - start_arr
    return ActivityColumns(np.array(ids, dtype=np.uint32), np.array(streams, dtype=np.uint32),
                           start_arr + clock_offset_ns, dur, skipped, np.array(graphs, dtype=np.uint32),
                           np.array(nodes, dtype=np.int64))


def columns_to_batches(cols: ActivityColumns, names: NameTable, *, job_id: str, rank: int, host: str = "",
                       first_seq: int = 0, batch_events: int = 4096,
                       marks: tuple[npt.NDArray[np.int64], npt.NDArray[np.int32]] | None = None,
                       final: bool = True, dropped: int = 0) -> tuple[list[KernelBatch], ActivityColumns]:
    """Cut ``cols`` (sorted by start) into KernelBatches of ``batch_events`` events with their own name
    dictionaries; steps from ``marks`` (see :class:`StepMarks`).

    With ``final`` every event is emitted (the last batch may be short); otherwise a short tail is returned
    as the remainder for the next call. ``dropped`` is written on the first batch (events lost before it).
    Returns (batches, remainder).
    """
    if batch_events < 1:
        raise ValueError(f"batch_events must be >= 1, got {batch_events}")
    n = len(cols)
    cols = cols.take(np.argsort(cols.start_ns, kind="stable"))
    name_id, stream, start, dur = cols.name_id, cols.stream, cols.start_ns, cols.duration_ns
    gid, node = cols.graph_id, cols.graph_node_id
    assert gid is not None and node is not None
    full = n if final else n - n % batch_events
    steps = _assign_steps(start[:full], marks if marks is not None else (np.empty(0, np.int64),
                                                                         np.empty(0, np.int32)))
    table = np.array(names.names, dtype=object)
    batches: list[KernelBatch] = []
    for i, lo in enumerate(range(0, full, batch_events)):
        hi = min(lo + batch_events, full)
        used, local = np.unique(name_id[lo:hi], return_inverse=True)
        graphs = bool(gid[lo:hi].any())  # the graph columns only where a kernel of the batch was graph-launched
        batches.append(KernelBatch(
            job_id=job_id, rank=rank, seq=first_seq + i, names=tuple(table[used].tolist()),
            name_idx=local.astype(np.uint32), stream=stream[lo:hi], start_ns=start[lo:hi],
            duration_ns=dur[lo:hi], step=steps[lo:hi], host=host, dropped=dropped if i == 0 else 0,
            graph_id=gid[lo:hi] if graphs else np.empty(0, np.uint32),
            graph_node_id=node[lo:hi] if graphs else np.empty(0, np.int64)))
    return batches, cols.slice(full)


def build_kernel_batches(records: Iterable[Any], *, job_id: str, rank: int, host: str = "", first_seq: int = 0,
                         batch_events: int = 4096, clock_offset_ns: int = 0,
                         marks: tuple[npt.NDArray[np.int64], npt.NDArray[np.int32]] | None = None,
                         ) -> list[KernelBatch]:
    """Activity records -> KernelBatches in one call (a pure function of its arguments; see
    :func:`extract_columns` and :func:`columns_to_batches`)."""
    names = NameTable()
    cols = extract_columns(records, names, clock_offset_ns)
    batches, _ = columns_to_batches(cols, names, job_id=job_id, rank=rank, host=host, first_seq=first_seq,
                                    batch_events=batch_events, marks=marks, final=True)
    return batches
