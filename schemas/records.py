"""Frozen, typed argus records and their mapping to and from Avro.

Every record class names its schema (``SCHEMA``) and converts with :meth:`encode` / :meth:`decode`.
Times are integer nanoseconds (``*_ns``); kinds are enums. Per-event columns of :class:`KernelBatch`
are read-only numpy arrays, packed little-endian on the wire.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

import numpy as np
import numpy.typing as npt

from argus.errors import SchemaError
from schemas.codec import codec

__all__ = [
    "CpuStack",
    "DeadLetter",
    "Finding",
    "JobLifecycle",
    "JobTopology",
    "KernelBatch",
    "KernelSummary",
    "Level",
    "LifecycleEvent",
    "ParallelGroup",
    "PhaseBatch",
    "PhaseKind",
    "Record",
    "Step",
]


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


class LifecycleEvent(enum.Enum):
    START = "START"
    END = "END"
    #: A detector part has published its final diagnosis of the job (schema v2).
    DIAGNOSED = "DIAGNOSED"


class Level(enum.Enum):
    """Diagnosis level: L1 iteration time, L2 straggler rank + phase, L3 degraded kernel."""

    L1 = "L1"
    L2 = "L2"
    L3 = "L3"


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
                value = tuple(enum_type(v) for v in value) if isinstance(value, list) else enum_type(value)
            elif isinstance(value, list):
                value = tuple(value)
            kwargs[name] = value
        return cls(**kwargs)

    @classmethod
    def _enum_fields(cls) -> dict[str, type[enum.Enum]]:
        return {}

    def encode(self) -> bytes:
        """Avro wire bytes (see :mod:`schemas.codec`). Raises :class:`SchemaError`."""
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


@dataclass(frozen=True, eq=False)
class KernelBatch(Record):
    """A columnar batch of kernel events of one rank; see ``schemas/kernel_batch.v1.avsc``."""

    SCHEMA: ClassVar[str] = "kernel_batch"
    COLUMNS: ClassVar[dict[str, str]] = {
        "name_idx": "<u4", "stream": "<u4", "start_ns": "<i8", "duration_ns": "<i8", "step": "<i4",
    }

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

    def __post_init__(self) -> None:
        for name, dtype in self.COLUMNS.items():
            arr = np.ascontiguousarray(getattr(self, name), dtype=dtype)
            arr.flags.writeable = False
            object.__setattr__(self, name, arr)
        object.__setattr__(self, "names", tuple(self.names))

    def __len__(self) -> int:
        return int(self.name_idx.shape[0])

    def to_avro(self) -> dict[str, Any]:
        out = {
            "job_id": self.job_id, "rank": self.rank, "host": self.host, "seq": self.seq,
            "names": list(self.names), "dropped": self.dropped, "end_of_stream": self.end_of_stream,
        }
        for name in self.COLUMNS:
            out[name] = getattr(self, name).tobytes()
        return out

    @classmethod
    def from_avro(cls, data: dict[str, Any]) -> KernelBatch:
        cols = {name: _column(data[name], dtype, name) for name, dtype in cls.COLUMNS.items()}
        return cls(
            job_id=data["job_id"], rank=data["rank"], seq=data["seq"], names=tuple(data["names"]),
            host=data["host"], dropped=data["dropped"], end_of_stream=data["end_of_stream"], **cols,
        )

    def check(self) -> None:
        n = len(self)
        for name in self.COLUMNS:
            if getattr(self, name).shape[0] != n:
                raise SchemaError(f"kernel batch {self.job_id}/{self.rank} seq {self.seq}: column {name} has "
                                  f"{getattr(self, name).shape[0]} values, name_idx has {n}")
        if n and int(self.name_idx.max()) >= len(self.names):
            raise SchemaError(f"kernel batch {self.job_id}/{self.rank} seq {self.seq}: name_idx "
                              f"{int(self.name_idx.max())} outside the {len(self.names)}-name dictionary")
        if n and int(self.duration_ns.min()) < 0:
            raise SchemaError(f"kernel batch {self.job_id}/{self.rank} seq {self.seq}: negative duration_ns")
        if not self.job_id or self.rank < -1 or (self.rank == -1 and not self.is_job_end):
            raise SchemaError(f"kernel batch: invalid job_id {self.job_id!r} or rank {self.rank}")

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
    """One iteration of one rank; see ``schemas/step.v1.avsc``."""

    SCHEMA: ClassVar[str] = "step"

    job_id: str
    rank: int
    step: int
    start_ns: int
    wall_ns: int
    gpu_ns: int | None = None

    def check(self) -> None:
        if self.wall_ns < 0 or (self.gpu_ns is not None and self.gpu_ns < 0) or self.rank < 0:
            raise SchemaError(f"step {self.job_id}/{self.rank}/{self.step}: negative duration or rank")


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

    @classmethod
    def _enum_fields(cls) -> dict[str, type[enum.Enum]]:
        return {"kinds": PhaseKind, "groups": ParallelGroup}

    def check(self) -> None:
        n = len(self.kinds)
        if any(len(getattr(self, f)) != n for f in ("names", "groups", "streams", "start_ns", "duration_ns")):
            raise SchemaError(f"phase batch {self.job_id}/{self.rank}/{self.step}: columns differ in length")
        if any(d < 0 for d in self.duration_ns):
            raise SchemaError(f"phase batch {self.job_id}/{self.rank}/{self.step}: negative duration_ns")


@dataclass(frozen=True)
class KernelSummary(Record):
    """Cluster summaries of one (job, kernel, stream); see ``schemas/kernel_summary.v1.avsc``."""

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

    def check(self) -> None:
        rows = len(self.rank)
        if any(len(getattr(self, f)) != rows for f in ("window_start_ns", "window_end_ns", "n_events",
                                                         "n_clusters")):
            raise SchemaError(f"kernel summary {self.job_id}/{self.kernel}: row columns differ in length")
        total = sum(self.n_clusters)
        if any(len(getattr(self, f)) != total for f in ("cluster_count", "cluster_p50_ns", "cluster_p99_ns",
                                                         "cluster_min_ns", "cluster_max_ns", "cluster_sum_ns")):
            raise SchemaError(f"kernel summary {self.job_id}/{self.kernel}: cluster columns do not match "
                              f"sum(n_clusters)={total}")


@dataclass(frozen=True)
class JobTopology(Record):
    """Parallel-group membership of every rank; see ``schemas/job_topology.v1.avsc``."""

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

    def check(self) -> None:
        cols = ("rank", "host", "dp_group", "tp_group", "pp_group", "ep_group", "pp_stage")
        if any(len(getattr(self, c)) != self.world_size for c in cols):
            raise SchemaError(f"topology {self.job_id}: per-rank columns must have world_size={self.world_size}")


@dataclass(frozen=True)
class JobLifecycle(Record):
    """A job started or ended; see ``schemas/job_lifecycle.v1.avsc``."""

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

    @classmethod
    def _enum_fields(cls) -> dict[str, type[enum.Enum]]:
        return {"event": LifecycleEvent}


@dataclass(frozen=True)
class Finding(Record):
    """A diagnosis; see ``schemas/finding.v2.avsc``.

    ``impact_ns_per_step``: GPU time (ns) the whole job loses per affected step because of it (the delay it
    adds to the iteration times the ranks that wait); ``impact_ns``: that over all affected steps. Both 0
    when unknown (findings written with schema v1).
    """

    SCHEMA: ClassVar[str] = "finding"

    finding_id: str
    job_id: str
    level: Level
    kind: str
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

    @classmethod
    def _enum_fields(cls) -> dict[str, type[enum.Enum]]:
        return {"level": Level}

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

    @property
    def stacks(self) -> list[dict[str, Any]]:
        """The decoded py-spy threads (empty if ``stacks_json`` is not a JSON array)."""
        try:
            out = json.loads(self.stacks_json)
        except ValueError:
            return []
        return list(out) if isinstance(out, list) else []
