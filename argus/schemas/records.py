"""Frozen, typed argus records and their mapping to and from Avro.

Every record class names its schema (``SCHEMA``) and converts with :meth:`encode` / :meth:`decode`.
Times are integer nanoseconds (``*_ns``); kinds are enums. Per-event columns of :class:`KernelBatch`
are read-only numpy arrays, packed little-endian on the wire.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

import numpy as np
import numpy.typing as npt

from argus.core.errors import SchemaError
from argus.core.kinds import FindingKind, Level
from argus.schemas.codec import MAGIC, codec
from argus.schemas.column_packing import pack_column, unpack_column

__all__ = [
    "TIME_LIMIT_NS",
    "CpuStack",
    "DeadLetter",
    "Finding",
    "Heartbeat",
    "JobLifecycle",
    "JobTopology",
    "KernelBatch",
    "KernelSummary",
    "Level",
    "LifecycleEvent",
    "ParallelGroup",
    "PauseReason",
    "PhaseBatch",
    "PhaseKind",
    "Record",
    "Step",
    "raw_phase_layout",
]

#: Every event time and duration (``*_ns``) must satisfy ``|t| < TIME_LIMIT_NS`` (2^62 ns, about 146 years):
#: far enough from the int64 limits that window ends and sums of a few values still fit in an Avro long.
TIME_LIMIT_NS = 2**62
_INT32 = (-(2**31), 2**31 - 1)
_INT64 = (-(2**63), 2**63 - 1)
#: A window is at most this long (2^61 ns), so ``window_start + length`` stays inside int64.
_MAX_SPAN_NS = 2**61


def _bounded(what: str, name: str, values: int | Iterable[int] | npt.NDArray[Any], lo: int, hi: int) -> None:
    """Raise :class:`SchemaError` naming ``what`` and the field unless every value is in ``[lo, hi]``."""
    if isinstance(values, np.ndarray):
        if values.size and (int(values.min()) < lo or int(values.max()) > hi):
            bad = int(values.min()) if int(values.min()) < lo else int(values.max())
            raise SchemaError(f"{what}: {name} value {bad} outside [{lo}, {hi}]")
        return
    for v in (values,) if isinstance(values, int) else values:
        if not lo <= v <= hi:
            raise SchemaError(f"{what}: {name} value {v} outside [{lo}, {hi}]")


def _times(what: str, name: str, values: int | Iterable[int] | npt.NDArray[Any]) -> None:
    _bounded(what, name, values, -TIME_LIMIT_NS + 1, TIME_LIMIT_NS - 1)


def _durations(what: str, name: str, values: int | Iterable[int] | npt.NDArray[Any]) -> None:
    _bounded(what, name, values, 0, TIME_LIMIT_NS - 1)


def _within(values: npt.NDArray[np.int64], lo: int, hi: int) -> bool:
    """Every value of ``values`` in ``[lo, hi]``."""
    return not values.size or (lo <= int(values.min()) and int(values.max()) <= hi)


def _same_length(what: str, record: Any, names: Iterable[str], n: int, of: str) -> None:
    for f in names:
        if len(getattr(record, f)) != n:
            raise SchemaError(f"{what}: column {f} has {len(getattr(record, f))} values, {of} is {n}")


class PhaseKind(enum.Enum):
    """What a timed phase is: compute, a collective, or host work."""

    FORWARD = "FORWARD"
    BACKWARD = "BACKWARD"
    OPTIMIZER = "OPTIMIZER"
    ALL_REDUCE = "ALL_REDUCE"
    REDUCE_SCATTER = "REDUCE_SCATTER"
    ALL_GATHER = "ALL_GATHER"
    SEND_RECV = "SEND_RECV"
    ALL_TO_ALL = "ALL_TO_ALL"
    BROADCAST = "BROADCAST"
    DATA_LOADER = "DATA_LOADER"
    OTHER = "OTHER"

    @property
    def is_collective(self) -> bool:
        return self in _COLLECTIVES


_COLLECTIVES = frozenset(
    {PhaseKind.ALL_REDUCE, PhaseKind.REDUCE_SCATTER, PhaseKind.ALL_GATHER, PhaseKind.SEND_RECV,
     PhaseKind.ALL_TO_ALL, PhaseKind.BROADCAST}
)


class ParallelGroup(enum.Enum):
    """The kind of parallel group a collective runs in."""

    NONE = "NONE"
    DP = "DP"
    TP = "TP"
    PP = "PP"
    EP = "EP"

    @property
    def column(self) -> str:
        """The :class:`JobTopology` column of this kind's group ids (``dp_group``, ...); '' for NONE."""
        return "" if self is ParallelGroup.NONE else f"{self.value.lower()}_group"


class PauseReason(enum.Enum):
    """Why a rank's kernel records are paused (its steps and phases go on): a window without its kernels is
    missing data, never a fault."""

    #: ``argus control pause-kernels`` (e.g. to let nsys take CUPTI).
    CONTROL = "CONTROL"
    #: ``argus control sample-ranks N`` left this rank out.
    SAMPLING = "SAMPLING"
    #: A profiler in the process (torch.profiler) holds CUPTI, or held it when argus started.
    PROFILER = "PROFILER"


class LifecycleEvent(enum.Enum):
    START = "START"
    END = "END"
    #: A detector part has published its final diagnosis of the job (schema v2).
    DIAGNOSED = "DIAGNOSED"
    #: argus closed the job after an idle time without records (schema v4; ``reason``, ``last_step``).
    ABANDONED = "ABANDONED"


class Record:
    """Shared Avro mapping: dataclass fields are Avro fields of the same name."""

    SCHEMA: ClassVar[str]

    def to_avro(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            out[f.name] = _to_avro(getattr(self, f.name))
        return out

    @classmethod
    def from_avro(cls, data: dict[str, Any]) -> Self:
        hints = cls._enum_fields()
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            name = f.name
            value = data[name]
            enum_type = hints.get(name)
            if enum_type is not None:
                if isinstance(value, list):
                    # Avro already checked the symbols: a dict lookup per value (a phase batch has hundreds).
                    value = tuple(map(enum_type._value2member_map_.__getitem__, value))
                elif value is not None:  # a nullable enum (e.g. Heartbeat.collective) stays None
                    value = enum_type(value)
            elif isinstance(value, list):
                value = tuple(value)
            kwargs[name] = value
        return cls(**kwargs)

    @classmethod
    def _enum_fields(cls) -> dict[str, type[enum.Enum]]:
        return {}

    def encode(self) -> bytes:
        """Avro wire bytes (see :mod:`argus.schemas.codec`). Raises :class:`SchemaError`."""
        return codec(self.SCHEMA).encode(self.to_avro())

    @classmethod
    def decode(cls, payload: bytes) -> Self:
        """Parse and validate wire bytes. Raises :class:`SchemaError` with the reason."""
        rec = cls.from_avro(codec(cls.SCHEMA).decode(payload))
        rec.check()
        return rec

    def check(self) -> None:
        """Semantic checks beyond the schema; raises :class:`SchemaError`."""


def _to_avro(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple):
        return [_to_avro(v) for v in value]
    return value


def _column(data: bytes, dtype: str, name: str) -> npt.NDArray[Any]:
    size = np.dtype(dtype).itemsize
    if len(data) % size:
        raise SchemaError(f"column {name}: {len(data)} bytes is not a multiple of {size} ({dtype})")
    arr = np.frombuffer(data, dtype=dtype)
    return arr


def _narrow(values: npt.NDArray[np.int64], dtype: str, name: str) -> npt.NDArray[Any]:
    """``values`` as ``dtype``; :class:`SchemaError` when one does not fit it."""
    info = np.iinfo(np.dtype(dtype))
    if values.size and (int(values.min()) < info.min or int(values.max()) > info.max):
        bad = int(values.min()) if int(values.min()) < info.min else int(values.max())
        raise SchemaError(f"column {name}: value {bad} outside {dtype} [{info.min}, {info.max}]")
    return values.astype(dtype, copy=False)


@dataclass(frozen=True, eq=False)
class KernelBatch(Record):
    """A columnar batch of kernel events of one rank; see ``schemas/kernel_batch.v3.avsc`` (v1, v2 still read).

    ``graph_id`` / ``graph_node_id``: per event, the CUDA graph that launched the kernel and its node (0 when
    launched on its own; :data:`UNKNOWN_GRAPH` for a graph-launched kernel of an unknown graph); both empty when
    no event of the batch was graph-launched (:attr:`graph_launched` then is all False).
    """

    SCHEMA: ClassVar[str] = "kernel_batch"
    COLUMNS: ClassVar[dict[str, str]] = {
        "name_idx": "<u4", "stream": "<u4", "start_ns": "<i8", "duration_ns": "<i8", "step": "<i4",
    }
    #: Optional per-event columns (schema v3): empty, or one value per event.
    GRAPH_COLUMNS: ClassVar[dict[str, str]] = {"graph_id": "<u4", "graph_node_id": "<i8"}
    #: ``graph_id`` of a kernel known to be graph-launched (a ``cudaGraphLaunch``) whose graph is not known.
    UNKNOWN_GRAPH: ClassVar[int] = 2**32 - 1

    job_id: str
    rank: int
    seq: int
    names: tuple[str, ...]
    name_idx: npt.NDArray[np.uint32]
    stream: npt.NDArray[np.uint32]
    start_ns: npt.NDArray[np.int64]
    duration_ns: npt.NDArray[np.int64]
    step: npt.NDArray[np.int32]
    host: str = ""
    dropped: int = 0
    end_of_stream: bool = False
    graph_id: npt.NDArray[np.uint32] = field(default_factory=lambda: np.empty(0, np.uint32))
    graph_node_id: npt.NDArray[np.int64] = field(default_factory=lambda: np.empty(0, np.int64))

    def __post_init__(self) -> None:
        for name, dtype in (self.COLUMNS | self.GRAPH_COLUMNS).items():
            arr = np.ascontiguousarray(getattr(self, name), dtype=dtype)
            arr.flags.writeable = False
            object.__setattr__(self, name, arr)
        object.__setattr__(self, "names", tuple(self.names))
        if len(self.graph_id) and not self.graph_id.any() and not self.graph_node_id.any():
            for name, dtype in self.GRAPH_COLUMNS.items():  # no kernel graph-launched: one form, as on the wire
                object.__setattr__(self, name, np.empty(0, dtype))

    @property
    def graph_launched(self) -> npt.NDArray[np.bool_]:
        """Per event: launched by a CUDA graph replay."""
        if not len(self.graph_id):
            return np.zeros(len(self), dtype=bool)
        return self.graph_id != 0

    def __len__(self) -> int:
        return int(self.name_idx.shape[0])

    def to_avro(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "job_id": self.job_id, "rank": self.rank, "host": self.host, "seq": self.seq,
            "names": list(self.names), "dropped": self.dropped, "end_of_stream": self.end_of_stream,
            "packed": True,
        }
        # Packing codes starts per stream: columns of different lengths cannot be written.
        _same_length(f"kernel batch {self.job_id}/{self.rank} seq {self.seq}", self, self.COLUMNS, len(self),
                     "the length of name_idx")
        for name in self.COLUMNS:
            out[name] = pack_column(getattr(self, name))
        # A stream's kernels run one after the other: a start is coded as the gap after its predecessor's end.
        out["start_ns"] = pack_column(self.start_ns, self.stream, self.duration_ns)
        graphs = len(self.graph_id) and bool(self.graph_id.any())
        for name in self.GRAPH_COLUMNS:  # a batch without graph-launched kernels pays nothing for them
            out[name] = pack_column(getattr(self, name)) if graphs else b""
        return out

    @classmethod
    def from_avro(cls, data: dict[str, Any]) -> KernelBatch:
        if not data.get("packed", False):  # written as v1: plain arrays
            cols = {name: _column(data[name], dtype, name) for name, dtype in cls.COLUMNS.items()}
        else:
            cols = {name: _narrow(unpack_column(data[name], name), dtype, name)
                    for name, dtype in cls.COLUMNS.items() if name != "start_ns"}
            n = len(cols["name_idx"])
            for name, col in cols.items():
                if len(col) != n:
                    raise SchemaError(f"kernel batch: column {name} has {len(col)} values, the length of name_idx "
                                      f"is {n}")
            cols["start_ns"] = unpack_column(data["start_ns"], "start_ns", cols["stream"].astype(np.int64),
                                             cols["duration_ns"])
            for name, dtype in cls.GRAPH_COLUMNS.items():  # v3; v2 reads as b"" (no graph-launched kernel)
                raw = data.get(name, b"")
                if raw:
                    cols[name] = _narrow(unpack_column(raw, name), dtype, name)
        return cls(
            job_id=data["job_id"], rank=data["rank"], seq=data["seq"], names=tuple(data["names"]),
            host=data["host"], dropped=data["dropped"], end_of_stream=data["end_of_stream"], **cols,
        )

    def check(self) -> None:
        what = f"kernel batch {self.job_id}/{self.rank} seq {self.seq}"
        n = len(self)
        _same_length(what, self, self.COLUMNS, n, "the length of name_idx")
        if len(self.graph_id) or len(self.graph_node_id):
            _same_length(what, self, self.GRAPH_COLUMNS, n, "the length of name_idx")
            if bool(((self.graph_id == 0) & (self.graph_node_id != 0)).any()):
                raise SchemaError(f"{what}: a graph node id on a kernel without a graph id")
        if n and int(self.name_idx.max()) >= len(self.names):
            raise SchemaError(f"{what}: name_idx {int(self.name_idx.max())} outside the {len(self.names)}-name "
                              "dictionary")
        if not self.job_id or self.rank < -1 or (self.rank == -1 and not self.is_job_end):
            raise SchemaError(f"kernel batch: invalid job_id {self.job_id!r} or rank {self.rank}")
        _bounded(what, "rank", self.rank, -1, _INT32[1])
        _bounded(what, "seq", self.seq, 0, _INT64[1])
        _bounded(what, "dropped", self.dropped, 0, _INT64[1])
        _times(what, "start_ns", self.start_ns)
        _durations(what, "duration_ns", self.duration_ns)
        _bounded(what, "step", self.step, -1, _INT32[1])

    @property
    def is_job_end(self) -> bool:
        """A job-end marker: rank -1, no events, end_of_stream (see the schema's ``end_of_stream`` doc)."""
        return self.rank == -1 and self.end_of_stream and len(self) == 0

    @classmethod
    def job_end_marker(cls, job_id: str) -> KernelBatch:
        return cls.empty(job_id, rank=-1, seq=0, end_of_stream=True)

    @classmethod
    def empty(cls, job_id: str, rank: int, seq: int, end_of_stream: bool = False, host: str = "") -> KernelBatch:
        """A batch without events (e.g. a rank's final ``end_of_stream`` batch)."""
        cols: dict[str, Any] = {name: np.empty(0, dtype=dtype) for name, dtype in cls.COLUMNS.items()}
        return cls(job_id=job_id, rank=rank, seq=seq, names=(), host=host, end_of_stream=end_of_stream, **cols)


@dataclass(frozen=True)
class Step(Record):
    """One iteration of one rank; see ``schemas/step.v2.avsc`` (v1: without ``expert_tokens``)."""

    SCHEMA: ClassVar[str] = "step"

    job_id: str
    rank: int
    step: int
    start_ns: int
    wall_ns: int
    gpu_ns: int | None = None
    #: Tokens routed to the rank's MoE experts in the step (None: not counted).
    expert_tokens: int | None = None

    def check(self) -> None:
        what = f"step {self.job_id}/{self.rank}/{self.step}"
        _bounded(what, "rank", self.rank, 0, _INT32[1])
        _bounded(what, "step", self.step, *_INT64)
        _times(what, "start_ns", self.start_ns)
        _durations(what, "wall_ns", self.wall_ns)
        if self.gpu_ns is not None:
            _durations(what, "gpu_ns", self.gpu_ns)
        if self.expert_tokens is not None:
            _bounded(what, "expert_tokens", self.expert_tokens, 0, _INT64[1])


@dataclass(frozen=True)
class PhaseBatch(Record):
    """The phases of one step of one rank; see ``schemas/phase_batch.v1.avsc``."""

    SCHEMA: ClassVar[str] = "phase_batch"

    job_id: str
    rank: int
    step: int
    kinds: tuple[PhaseKind, ...]
    names: tuple[str, ...]
    groups: tuple[ParallelGroup, ...]
    streams: tuple[int, ...]
    start_ns: tuple[int, ...]
    duration_ns: tuple[int, ...]
    #: ``start_ns`` then ``duration_ns`` as little-endian int64 bytes (``16 x phases`` bytes, ns), the same values as
    #: the tuples, where :meth:`decode` read them so (set on the instance, not a field: equality, repr, replace and
    #: the Avro mapping ignore it); ``None`` for any other record (built, or decoded by fastavro). Bytes, not an
    #: array: whoever gathers many batches joins them at memory speed.
    packed_times: ClassVar[bytes | None] = None
    #: The (kinds, names, groups, streams) tuple this record's columns were taken from where decoding shared a
    #: layout (set on the instance, as :attr:`packed_times`): every batch decoded with an equal layout lately holds
    #: the very same one, so a fold groups a step's batches by one identity. ``None`` for any other record.
    shared_layout: ClassVar[tuple[Any, ...] | None] = None

    @classmethod
    def _enum_fields(cls) -> dict[str, type[enum.Enum]]:
        return {"kinds": PhaseKind, "groups": ParallelGroup}

    @classmethod
    def from_avro(cls, data: dict[str, Any]) -> PhaseBatch:
        # The ranks of one (TP index, stage) run the same phases: a layout equal to one decoded lately gets
        # that one's tuples (equal values), so whoever compares layouts compares objects, not 600 values.
        layout = _LAYOUTS.intern(data["kinds"], data["names"], data["groups"], data["streams"])
        rec = cls(data["job_id"], data["rank"], data["step"], *layout, tuple(data["start_ns"]),
                  tuple(data["duration_ns"]))
        rec.__dict__["shared_layout"] = layout
        return rec

    @classmethod
    def decode(cls, payload: bytes) -> PhaseBatch:
        """Parse and validate wire bytes (as :meth:`Record.decode`). Raises :class:`SchemaError` with the reason.

        A v1 body read by v1 (the only version) goes through the compiled reader
        (:mod:`argus.schemas.phase_reading`, ~10x faster than fastavro), which also keeps the times as arrays
        (:meth:`times`); whatever it does not read as fastavro would (a corrupt body) is decoded by fastavro."""
        avro = codec(cls.SCHEMA)
        if len(payload) >= 2 and payload[0] == MAGIC and payload[1] == _PHASE_V1 == avro.latest:
            # Imported here, not at the top: the rank-side tracer imports this module to encode only (numba).
            from argus.schemas.phase_reading import read_phase_batch

            raw = read_phase_batch(payload, 2, len(_KIND_SYMBOLS), len(_GROUP_SYMBOLS))
            if raw is not None:
                layout = raw_phase_layout(raw.layout, payload, raw.kinds, raw.names, raw.groups, raw.streams)
                if layout is not None:
                    rec = cls.of_layout(raw.job_id, raw.rank, raw.step, layout, tuple(raw.start_ns.tolist()),
                                        tuple(raw.duration_ns.tolist()), raw.times)
                    rec.check()
                    return rec
        rec = cls.from_avro(avro.decode(payload))
        rec.check()
        return rec

    @classmethod
    def of_layout(cls, job_id: str, rank: int, step: int, layout: _Layout, start_ns: tuple[int, ...],
                  duration_ns: tuple[int, ...], packed_times: bytes | None) -> PhaseBatch:
        """A batch the compiled readers read: its shared ``layout`` (:func:`raw_phase_layout`), its times as
        tuples and, where read so, ``packed_times`` (see the attribute). Not checked."""
        rec = cls(job_id, rank, step, *layout, start_ns, duration_ns)
        # Not fields (equality, repr, replace and the Avro mapping ignore them): the same values as the tuples,
        # read once, for whoever needs them at once (L2's fold of a step).
        rec.__dict__["shared_layout"] = layout
        if packed_times is not None:
            rec.__dict__["packed_times"] = packed_times
        return rec

    def times(self) -> npt.NDArray[np.int64] | None:
        """:attr:`packed_times` as a read-only ``2 x phases`` int64 array (``start_ns``, ``duration_ns``; ns)."""
        packed = self.packed_times
        return None if packed is None else np.frombuffer(packed, dtype="<i8").reshape(2, -1)

    def check(self) -> None:
        what = f"phase batch {self.job_id}/{self.rank}/{self.step}"
        _same_length(what, self, ("names", "groups", "streams", "start_ns", "duration_ns"), len(self.kinds),
                     "the number of kinds")
        _bounded(what, "rank", self.rank, 0, _INT32[1])
        _bounded(what, "step", self.step, *_INT64)
        _bounded(what, "streams", self.streams, -1, _INT64[1])
        times = self.times()
        # Arrays are checked at once; a value out of range is then named as the tuple check names it (the first).
        if times is None or not (_within(times[0], -TIME_LIMIT_NS + 1, TIME_LIMIT_NS - 1)
                                 and _within(times[1], 0, TIME_LIMIT_NS - 1) and times.shape[1] == len(self.kinds)):
            _times(what, "start_ns", self.start_ns)
            _durations(what, "duration_ns", self.duration_ns)


_Layout = tuple[tuple[PhaseKind, ...], tuple[str, ...], tuple[ParallelGroup, ...], tuple[int, ...]]


class _LayoutCache:
    """The (kinds, names, groups, streams) tuples of the phase layouts decoded lately, by content: at most
    ``size`` layouts, the oldest forgotten first (a job has one per (TP index, stage), a few hundred at most;
    past ``size`` distinct layouts a decode only costs the look-up, ~5 us)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._by_content: dict[tuple[tuple[Any, ...], ...], _Layout] = {}
        self._by_raw: dict[bytes, _Layout] = {}

    def intern(self, kinds: Iterable[str], names: Iterable[str], groups: Iterable[str],
               streams: Iterable[int]) -> _Layout:
        """The tuples of this layout (Avro values: enum symbols, strings, ints), those of an equal layout when
        one is held. Unknown symbols raise ``KeyError``, as :meth:`Record.from_avro`."""
        key = (tuple(kinds), tuple(names), tuple(groups), tuple(streams))
        got = self._by_content.get(key)
        if got is None:
            # Avro already checked the symbols: a dict look-up per value.
            kind_of: dict[Any, PhaseKind] = PhaseKind._value2member_map_  # type: ignore[assignment]
            group_of: dict[Any, ParallelGroup] = ParallelGroup._value2member_map_  # type: ignore[assignment]
            got = (tuple(map(kind_of.__getitem__, key[0])), key[1], tuple(map(group_of.__getitem__, key[2])), key[3])
            if len(self._by_content) >= self.size:
                self._by_content.pop(next(iter(self._by_content)), None)
            self._by_content[key] = got
        return got

    def intern_raw(self, raw: bytes, values: Callable[[], tuple[list[str], list[str], list[str], list[int]]]
                   ) -> _Layout | None:
        """The tuples of the layout whose Avro bytes (kinds, names, groups, streams: :mod:`argus.schemas.
        phase_reading`) are ``raw``; ``values()`` gives its Avro values when these bytes are new (then as
        :meth:`intern`). ``None`` when a name is not UTF-8 (the caller decodes with fastavro)."""
        got = self._by_raw.get(raw)
        if got is None:
            try:
                got = self.intern(*values())
            except (UnicodeDecodeError, KeyError):
                return None
            if len(self._by_raw) >= self.size:
                self._by_raw.pop(next(iter(self._by_raw)), None)
            self._by_raw[raw] = got
        return got


_LAYOUTS = _LayoutCache(1024)


def raw_phase_layout(raw: bytes, data: bytes, kinds: npt.NDArray[np.int64], names: npt.NDArray[np.int64],
                     groups: npt.NDArray[np.int64], streams: npt.NDArray[np.int64]) -> _Layout | None:
    """The shared (kinds, names, groups, streams) tuples of a layout the compiled readers read (those of an
    equal layout decoded lately, see :meth:`PhaseBatch.from_avro`): ``raw`` its v1 bytes, ``kinds`` / ``groups``
    enum indices, ``names`` byte ranges in ``data`` (``phases x 2``), ``streams``. ``None`` where a name is not
    UTF-8 (fastavro then decodes the batch, or names the error)."""
    return _LAYOUTS.intern_raw(raw, lambda: (
        [_KIND_SYMBOLS[i] for i in kinds.tolist()], [data[a:b].decode("utf-8") for a, b in names.tolist()],
        [_GROUP_SYMBOLS[i] for i in groups.tolist()], streams.tolist()))


_PHASE_V1 = 1
_KIND_SYMBOLS = ("FORWARD", "BACKWARD", "OPTIMIZER", "ALL_REDUCE", "REDUCE_SCATTER", "ALL_GATHER", "SEND_RECV",
                 "ALL_TO_ALL", "BROADCAST", "DATA_LOADER", "OTHER")
_GROUP_SYMBOLS = ("NONE", "DP", "TP", "PP", "EP")


@dataclass(frozen=True)
class KernelSummary(Record):
    """Cluster summaries of one (job, kernel, stream); see ``schemas/kernel_summary.v2.avsc``.

    ``piece`` (per row, schema v2): which piece of its (rank, window) a row is, the position of the last
    kernel message it summarizes. Rows of one (rank, window) with different pieces hold different events and
    add up; equal pieces are copies (a re-summary after a restart), the one with more events complete.
    Empty (v1): every row is piece 0 (:meth:`pieces`).
    """

    SCHEMA: ClassVar[str] = "kernel_summary"

    job_id: str
    kernel: str
    stream: int
    rank: tuple[int, ...]
    window_start_ns: tuple[int, ...]
    window_end_ns: tuple[int, ...]
    n_events: tuple[int, ...]
    n_clusters: tuple[int, ...]
    cluster_count: tuple[int, ...]
    cluster_p50_ns: tuple[int, ...]
    cluster_p99_ns: tuple[int, ...]
    cluster_min_ns: tuple[int, ...]
    cluster_max_ns: tuple[int, ...]
    cluster_sum_ns: tuple[int, ...]
    piece: tuple[int, ...] = ()

    def to_avro(self) -> dict[str, Any]:
        # Strings, ints and tuples of ints only: no enum to convert, so not Record's walk over every value (a
        # worker encodes every summary it sends).
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {name: list(v) if isinstance(v, tuple) else v for name, v in out.items()}

    def pieces(self) -> tuple[int, ...]:
        """The piece of every row (0 for every row of a v1 summary)."""
        return self.piece if self.piece else (0,) * len(self.rank)

    def check(self) -> None:
        what = f"kernel summary {self.job_id}/{self.kernel}/{self.stream}"
        if self.piece:
            _same_length(what, self, ("piece",), len(self.rank), "the number of ranks")
            _bounded(what, "piece", self.piece, 0, _INT64[1])
        _same_length(what, self, ("window_start_ns", "window_end_ns", "n_events", "n_clusters"), len(self.rank),
                     "the number of ranks")
        _bounded(what, "rank", self.rank, 0, _INT32[1])
        _bounded(what, "n_clusters", self.n_clusters, 0, _INT32[1])
        _bounded(what, "stream", self.stream, 0, 2**32 - 1)
        _times(what, "window_start_ns", self.window_start_ns)
        for start, end in zip(self.window_start_ns, self.window_end_ns, strict=True):
            if not start < end <= start + _MAX_SPAN_NS:
                raise SchemaError(f"{what}: window [{start}, {end}) is empty or longer than 2^61 ns")
        _bounded(what, "n_events", self.n_events, 0, _INT64[1])
        _same_length(what, self, ("cluster_count", "cluster_p50_ns", "cluster_p99_ns", "cluster_min_ns",
                                  "cluster_max_ns", "cluster_sum_ns"), sum(self.n_clusters), "sum(n_clusters)")
        _bounded(what, "cluster_count", self.cluster_count, 0, _INT64[1])
        for name in ("cluster_p50_ns", "cluster_p99_ns", "cluster_min_ns", "cluster_max_ns"):
            _durations(what, name, getattr(self, name))
        # A sum of many long durations may exceed 2^62; it must only stay a non-negative Avro long.
        _bounded(what, "cluster_sum_ns", self.cluster_sum_ns, 0, _INT64[1])


@dataclass(frozen=True)
class JobTopology(Record):
    """Parallel-group membership of every rank; see ``schemas/job_topology.v2.avsc``.

    ``group_streams`` / ``group_kinds`` (v2): CUDA streams known to carry the collectives of one
    parallel group (e.g. from the process groups a trace's NCCL kernels name), position by position; v1
    messages decode with both empty. ``gpu`` (v3): the GPU id of each rank, position by position ('' where
    unknown), or empty when no rank knew its GPU (and in v1/v2 messages).
    """

    SCHEMA: ClassVar[str] = "job_topology"

    job_id: str
    world_size: int
    dp_size: int
    tp_size: int
    pp_size: int
    rank: tuple[int, ...]
    host: tuple[str, ...]
    dp_group: tuple[int, ...]
    tp_group: tuple[int, ...]
    pp_group: tuple[int, ...]
    ep_group: tuple[int, ...]
    pp_stage: tuple[int, ...]
    ep_size: int = 1
    group_streams: tuple[int, ...] = ()
    group_kinds: tuple[ParallelGroup, ...] = ()
    gpu: tuple[str, ...] = ()

    @classmethod
    def _enum_fields(cls) -> dict[str, type[enum.Enum]]:
        return {"group_kinds": ParallelGroup}

    def gpu_of(self, position: int) -> str:
        """The GPU id of the rank at ``position`` ('' when unknown; see :attr:`gpu`)."""
        return self.gpu[position] if self.gpu else ""

    def array(self, name: str) -> npt.NDArray[np.int64]:
        """The integer column ``name`` (``rank``, ``dp_group``, ``pp_stage``, ...) as a read-only int64 array,
        converted once per topology object: detectors read the columns of a 10,240-rank job dozens of times
        a diagnosis."""
        return self._memo(name, lambda: np.array(getattr(self, name), dtype=np.int64))

    def positions(self, ranks: npt.ArrayLike) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
        """Each of ``ranks``' position in :attr:`rank` (the last of equal ranks), by one search, and whether
        it is there at all (where not, its position is meaningless)."""
        order = self._memo("_rank_order", lambda: np.argsort(self.array("rank"), kind="stable"))
        ordered = self._memo("_sorted_rank", lambda: self.array("rank")[order])
        want = np.asarray(ranks, dtype=np.int64)
        if not ordered.size:
            return np.zeros(want.shape, dtype=np.int64), np.zeros(want.shape, dtype=bool)
        at = np.maximum(np.searchsorted(ordered, want, side="right") - 1, 0)
        found: npt.NDArray[np.bool_] = ordered[at] == want
        out: npt.NDArray[np.int64] = order[at]
        return out, found

    def members(self) -> frozenset[int]:
        """The job's ranks as a set, built once per topology object: the job agent tests every record's rank
        against it (building it per record cost O(world size) a record: 2.5 ms at 102,400 ranks)."""
        got: frozenset[int] | None = self.__dict__.get("_members")
        if got is None:
            got = self.__dict__["_members"] = frozenset(self.rank)
        return got

    def _memo(self, key: str, make: Callable[[], npt.NDArray[np.int64]]) -> npt.NDArray[np.int64]:
        """``make()`` once per topology object, read-only (the fields are frozen: the cache sits beside them)."""
        arrays: dict[str, npt.NDArray[np.int64]] = self.__dict__.setdefault("_arrays", {})
        out = arrays.get(key)
        if out is None:
            out = arrays[key] = make()
            out.flags.writeable = False
        return out

    def stream_groups(self) -> dict[int, ParallelGroup]:
        """``group_streams`` mapped to their ``group_kinds``."""
        return dict(zip(self.group_streams, self.group_kinds, strict=True))

    def check(self) -> None:
        what = f"topology {self.job_id}"
        _same_length(what, self, ("group_kinds",), len(self.group_streams), "group_streams")
        _bounded(what, "group_streams", self.group_streams, 0, _INT64[1])
        for name in ("world_size", "dp_size", "tp_size", "pp_size", "ep_size"):
            _bounded(what, name, getattr(self, name), 1, _INT32[1])
        _same_length(what, self, ("rank", "host", "dp_group", "tp_group", "pp_group", "ep_group", "pp_stage"),
                     self.world_size, "world_size")
        if self.gpu and len(self.gpu) != self.world_size:
            raise SchemaError(f"{what}: gpu has {len(self.gpu)} entries for world_size {self.world_size}")
        _bounded(what, "rank", self.rank, 0, self.world_size - 1)
        if len(set(self.rank)) != len(self.rank):
            raise SchemaError(f"{what}: a rank is described twice")
        for name in ("dp_group", "tp_group", "pp_group", "ep_group"):
            _bounded(what, name, getattr(self, name), 0, _INT32[1])
        _bounded(what, "pp_stage", self.pp_stage, 0, self.pp_size - 1)


@dataclass(frozen=True)
class JobLifecycle(Record):
    """A job started or ended, a detector part diagnosed it, or argus abandoned it; see
    ``schemas/job_lifecycle.v4.avsc``.

    ``finding_ids`` (DIAGNOSED, v3): the ids of the job's findings the part had published before it.
    ``reason``, ``last_step`` (ABANDONED, v4): why argus closed the job after an idle time and the last step
    number it had seen (-1 if none); messages of v1-v3 decode with ``""`` and ``-1``.
    """

    SCHEMA: ClassVar[str] = "job_lifecycle"

    job_id: str
    event: LifecycleEvent
    time_ns: int
    world_size: int
    source: str = "live"
    kernel_events: int | None = None
    steps: int | None = None
    phase_batches: int | None = None
    part: str = ""
    finding_ids: tuple[str, ...] = ()
    reason: str = ""
    last_step: int = -1

    @classmethod
    def _enum_fields(cls) -> dict[str, type[enum.Enum]]:
        return {"event": LifecycleEvent}

    def check(self) -> None:
        what = f"lifecycle {self.job_id} {self.event.value}"
        if not self.job_id:
            raise SchemaError(f"{what}: empty job_id")
        # DIAGNOSED records carry 0 when the detector part never learnt the job's size.
        least = 0 if self.event is LifecycleEvent.DIAGNOSED else 1
        _bounded(what, "world_size", self.world_size, least, _INT32[1])
        _times(what, "time_ns", self.time_ns)
        for name in ("kernel_events", "steps", "phase_batches"):
            if getattr(self, name) is not None:
                _bounded(what, name, getattr(self, name), 0, _INT64[1])
        _bounded(what, "last_step", self.last_step, -1, _INT64[1])


@dataclass(frozen=True)
class Heartbeat(Record):
    """Liveness of one rank: what it is doing now; see ``schemas/heartbeat.v2.avsc`` (v1 still read).

    Published by the rank-side tracer every ``Settings.heartbeat_interval_s`` seconds and on phase entry.

    Attributes:
        time_ns: when it was taken (event time, ns since the Unix epoch).
        step: the last step the rank began (-1 before the first).
        phase: the innermost phase entered and not exited (``""`` if none); ``phase_kind`` its kind (None).
        collective: kind of the collective in flight (None if none), in ``group`` (NONE if none) number
            ``group_index`` (-1 if unknown); ``seq`` its sequence number among this rank's collectives of that
            group (-1 if none); ``in_flight_since_ns`` when it was issued (ns since the epoch, -1 if none).
        kernels_paused: the rank's kernel records are paused now, for ``pause_reasons``; ``kernel_pauses``
            counts the pauses so far. ``control_ack``: id of the last control command applied ('' if none),
            ``control_error`` why it was refused ('' when applied).
    """

    SCHEMA: ClassVar[str] = "heartbeat"

    job_id: str
    rank: int
    time_ns: int
    step: int = -1
    phase: str = ""
    phase_kind: PhaseKind | None = None
    collective: PhaseKind | None = None
    group: ParallelGroup = ParallelGroup.NONE
    group_index: int = -1
    seq: int = -1
    in_flight_since_ns: int = -1
    kernels_paused: bool = False
    pause_reasons: tuple[PauseReason, ...] = ()
    control_ack: str = ""
    control_error: str = ""
    kernel_pauses: int = 0

    @classmethod
    def _enum_fields(cls) -> dict[str, type[enum.Enum]]:
        return {"phase_kind": PhaseKind, "collective": PhaseKind, "group": ParallelGroup,
                "pause_reasons": PauseReason}

    @property
    def in_flight(self) -> bool:
        """A collective is in flight (issued and not finished on the host)."""
        return self.collective is not None

    def check(self) -> None:
        what = f"heartbeat {self.job_id}/{self.rank}"
        if not self.job_id:
            raise SchemaError(f"{what}: empty job_id")
        _bounded(what, "rank", self.rank, 0, _INT32[1])
        _times(what, "time_ns", self.time_ns)
        _bounded(what, "step", self.step, -1, _INT64[1])
        _bounded(what, "group_index", self.group_index, -1, _INT32[1])
        _bounded(what, "seq", self.seq, -1, _INT64[1])
        if self.in_flight_since_ns != -1:
            _times(what, "in_flight_since_ns", self.in_flight_since_ns)
        if self.collective is not None and not self.collective.is_collective:
            raise SchemaError(f"{what}: collective {self.collective.value} is not a collective kind")
        _bounded(what, "kernel_pauses", self.kernel_pauses, 0, _INT64[1])
        if self.kernels_paused != bool(self.pause_reasons):
            raise SchemaError(f"{what}: kernels_paused={self.kernels_paused} with pause reasons "
                              f"{[r.value for r in self.pause_reasons]}")


#: Longest ``Finding.evidence_json`` accepted, characters (a detector's evidence is a few hundred).
MAX_EVIDENCE_CHARS = 1 << 20


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a finite number")


@dataclass(frozen=True)
class Finding(Record):
    """A diagnosis; see ``schemas/finding.v4.avsc``.

    ``impact_ns_per_step``: GPU time (ns) the whole job loses per affected step because of it (the delay it
    adds to the iteration times the ranks that wait); ``impact_ns``: that over all affected steps. Both 0
    when unknown (findings written with schema v1). ``detector_version``: the detectors that made it
    (``<package version>+<hash of their parameters and code>``, see ``argus.streams.diagnosis.detector_version``);
    '' when unknown (schemas v1 and v2). It does not enter ``finding_id``. ``hosts`` (v4): the hosts of its
    ranks, sorted, each once (empty when unknown or job-wide). ``incident_id`` (v4): the ``finding_id`` of the
    lead finding of the incident it belongs to (its own when it leads one or stands alone; '' before v4, read
    as its own: :attr:`incident`); ``gpus`` (v4): the GPU id of each of its ranks, position by position ('' where
    unknown), empty when none is known; none of them enters ``finding_id``.
    """

    SCHEMA: ClassVar[str] = "finding"

    finding_id: str
    job_id: str
    level: Level
    kind: FindingKind
    ranks: tuple[int, ...]
    steps: tuple[int, ...]
    score: float
    evidence_json: str
    time_ns: int
    phase: str | None = None
    kernel: str | None = None
    stream: int | None = None
    impact_ns_per_step: float = 0.0
    impact_ns: float = 0.0
    detector_version: str = ""
    hosts: tuple[str, ...] = ()
    incident_id: str = ""
    gpus: tuple[str, ...] = ()

    @classmethod
    def _enum_fields(cls) -> dict[str, type[enum.Enum]]:
        return {"level": Level, "kind": FindingKind}

    @property
    def incident(self) -> str:
        """The incident it belongs to: ``incident_id``, or its own ``finding_id`` where that is '' (v1-v3)."""
        return self.incident_id or self.finding_id

    def __post_init__(self) -> None:
        if not isinstance(self.kind, FindingKind):  # a kind given by its string: the member (old names too)
            try:
                object.__setattr__(self, "kind", FindingKind.of(self.level, self.kind))
            except ValueError as exc:
                raise SchemaError(f"finding {self.finding_id}: unknown kind {self.kind!r}") from exc

    @classmethod
    def from_avro(cls, data: dict[str, Any]) -> Self:
        """Also reads the kinds' old names (see :mod:`argus.core.kinds`); an unknown kind is a SchemaError."""
        try:
            kind = FindingKind.of(data["level"], data["kind"])
        except ValueError as exc:
            raise SchemaError(f"finding {data.get('finding_id')}: unknown kind {data['kind']!r}") from exc
        return super().from_avro({**data, "kind": kind.value})

    def check(self) -> None:
        what = f"finding {self.finding_id} of {self.job_id}"
        if self.kind.level is not self.level:
            raise SchemaError(f"{what}: kind {self.kind.value} is of level {self.kind.level.value}, "
                              f"not {self.level.value}")
        _bounded(what, "ranks", self.ranks, 0, _INT32[1])
        if list(self.hosts) != sorted(set(self.hosts)) or not all(self.hosts):
            raise SchemaError(f"{what}: hosts must be distinct, sorted and non-empty names, got {self.hosts!r}")
        if self.gpus and len(self.gpus) != len(self.ranks):
            raise SchemaError(f"{what}: gpus has {len(self.gpus)} entries for {len(self.ranks)} ranks")
        _bounded(what, "steps", self.steps, *_INT64)
        _times(what, "time_ns", self.time_ns)
        if self.stream is not None:
            _bounded(what, "stream", self.stream, *_INT64)
        for name in ("score", "impact_ns_per_step", "impact_ns"):
            value = getattr(self, name)
            if not math.isfinite(value) or (name != "score" and value < 0):
                raise SchemaError(f"{what}: {name} must be finite{'' if name == 'score' else ' and >= 0'}, "
                                  f"got {value!r}")
        # Readers (argus findings, the report, replay's diff) parse the evidence: a finding whose evidence is
        # not one JSON object of finite numbers would break them all for its job.
        if len(self.evidence_json) > MAX_EVIDENCE_CHARS:
            raise SchemaError(f"{what}: evidence_json is over {MAX_EVIDENCE_CHARS:,} characters")
        try:
            evidence = json.loads(self.evidence_json, parse_constant=_refuse_constant)
        except ValueError as exc:  # JSONDecodeError is a ValueError; so is a NaN or Infinity refused
            raise SchemaError(f"{what}: evidence_json is not JSON: {exc}") from exc
        if not isinstance(evidence, dict):
            raise SchemaError(f"{what}: evidence_json must be a JSON object, got {type(evidence).__name__}")

    @property
    def evidence(self) -> dict[str, Any]:
        return dict(json.loads(self.evidence_json))


@dataclass(frozen=True)
class DeadLetter(Record):
    """A rejected message and the reason; see ``schemas/dead_letter.v1.avsc``."""

    SCHEMA: ClassVar[str] = "dead_letter"

    topic: str
    partition: int
    offset: int
    payload: bytes
    reason: str
    stage: str
    time_ns: int
    key: bytes | None = field(default=None)

    def check(self) -> None:
        what = f"dead letter {self.topic}[{self.partition}]@{self.offset}"
        _bounded(what, "partition", self.partition, 0, _INT32[1])
        _bounded(what, "offset", self.offset, -1, _INT64[1])
        _times(what, "time_ns", self.time_ns)


@dataclass(frozen=True)
class CpuStack(Record):
    """py-spy stacks of one rank's process, captured for a finding; see ``schemas/cpu_stack.v1.avsc``."""

    SCHEMA: ClassVar[str] = "cpu_stack"

    job_id: str
    rank: int
    host: str
    pid: int
    time_ns: int
    finding_id: str
    stacks_json: str

    def check(self) -> None:
        if not self.job_id or self.rank < 0 or self.pid <= 0:
            raise SchemaError(f"cpu stack {self.job_id!r}/{self.rank}: invalid job_id, rank or pid {self.pid}")
        what = f"cpu stack {self.job_id}/{self.rank}"
        _bounded(what, "rank", self.rank, 0, _INT32[1])
        _bounded(what, "pid", self.pid, 1, _INT32[1])
        _times(what, "time_ns", self.time_ns)

    @property
    def stacks(self) -> list[dict[str, Any]]:
        """The decoded py-spy threads (empty if ``stacks_json`` is not a JSON array)."""
        try:
            out = json.loads(self.stacks_json)
        except ValueError:
            return []
        return list(out) if isinstance(out, list) else []
