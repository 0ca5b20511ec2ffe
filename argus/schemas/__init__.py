"""Versioned Avro schemas of every argus record, their codec and the typed record classes.

One record per ``<name>.v<N>.avsc`` file in this folder; every field documents its unit.
"""

from argus.schemas.codec import MAGIC, AvroCodec, available_schemas, codec
from argus.schemas.records import (
    DeadLetter,
    Finding,
    Heartbeat,
    JobLifecycle,
    JobTopology,
    KernelBatch,
    KernelSummary,
    Level,
    LifecycleEvent,
    ParallelGroup,
    PhaseBatch,
    PhaseKind,
    Step,
)

__all__ = [
    "MAGIC",
    "AvroCodec",
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
    "PhaseBatch",
    "PhaseKind",
    "Step",
    "available_schemas",
    "codec",
]
