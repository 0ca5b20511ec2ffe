"""Sample records of every schema, shared by unit and integration tests."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from argus.schemas.control import ControlAction, ControlCommand
from argus.schemas.job_context import JobContext
from argus.schemas.records import (
    CpuStack,
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
    Record,
    Step,
)
from argus.topics import Topic

T0 = 1_767_225_600_000_000_000


def kernel_batch(n: int = 5, rank: int = 3, seq: int = 0, job: str = "job-a") -> KernelBatch:
    return KernelBatch(
        job_id=job, rank=rank, seq=seq, names=("gemm_kernel", "ncclDevKernel_AllReduce_Sum_bf16_RING_LL"),
        name_idx=np.arange(n) % 2, stream=np.where(np.arange(n) % 2, 13, 7),
        start_ns=T0 + np.arange(n, dtype=np.int64) * 1000, duration_ns=np.arange(1, n + 1) * 100,
        step=np.arange(n) // 2, host="node-0",
    )


def samples() -> dict[str, Record]:
    return {
        "kernel_batch": kernel_batch(),
        "step": Step("job-a", 1, 7, T0, 150_000_000, 140_000_000),
        "phase_batch": PhaseBatch("job-a", 1, 7, (PhaseKind.FORWARD, PhaseKind.ALL_REDUCE), ("forward", "dp-allreduce"),
                                  (ParallelGroup.NONE, ParallelGroup.DP), (7, 13), (T0, T0 + 5), (4, 9)),
        "kernel_summary": KernelSummary("job-a", "gemm_kernel", 7, (0, 1), (T0, T0), (T0 + 10, T0 + 10), (5, 3),
                                        (2, 1), (3, 2, 3), (10, 40, 11), (12, 44, 13), (9, 38, 10), (13, 45, 14),
                                        (30, 80, 33)),
        "job_topology": JobTopology("job-a", 2, 2, 1, 1, (0, 1), ("h0", "h0"), (0, 0), (0, 1), (0, 1), (0, 0),
                                    (0, 0)),
        "job_lifecycle": JobLifecycle("job-a", LifecycleEvent.END, T0, 2, "simulator", 123),
        "finding": Finding("f1", "job-a", Level.L2, "phase_straggler", (5,), (15,), 7.5, '{"cv": 0.4}', T0,
                           phase="mlp"),
        "dead_letter": DeadLetter("argus.kernels", 2, 40, b"\x00\x01", "not an argus Avro message", "compress",
                                  T0, key=b"job-a/3"),
        "cpu_stack": CpuStack("job-a", 5, "node0000", 4242, T0, "f1",
                              '[{"thread_id": 1, "thread_name": "MainThread", "owns_gil": true, "active": true, '
                              '"frames": [{"name": "train_step", "filename": "train.py", "line": 12}]}]'),
        "heartbeat": Heartbeat("job-a", 5, T0, 7, "dp-allreduce", PhaseKind.ALL_REDUCE, PhaseKind.ALL_REDUCE,
                               ParallelGroup.DP, 1, 42, T0 - 1_000_000),
        "control_command": ControlCommand("job-a", "5f0c2d9e1a7b4c30", T0, ControlAction.PAUSE_KERNELS, (1, 3)),
        "job_context": JobContext("job-a", "l3/1", T0, None, (7, 13), (ParallelGroup.NONE, ParallelGroup.DP), (5,),
                                  (T0, T0 + 150_000_000), 150_000_000.0, True, ("gemm_kernel",), (7,), (2,), (0, 1),
                                  (1.5e6, 1.6e6), (10.0, 10.0)),
    }


class RecordingPublisher:
    """A duck-typed publisher for tests that keeps what it is given, as ``(topic, key, record)``.

    Args:
        accept: what ``publish`` answers (False simulates a full queue).
        refuse_every: refuse every n-th call (0: never).
        check: validate and encode every record, as the real publisher's sender would.
        round_trip: keep the record as decoded from its Avro encoding, not the object given.
    """

    def __init__(self, accept: bool = True, refuse_every: int = 0, check: bool = False,
                 round_trip: bool = False) -> None:
        self.records: list[tuple[Topic, bytes, Any]] = []
        self.accept, self.refuse_every, self.check, self.round_trip = accept, refuse_every, check, round_trip
        self.flushes = 0
        #: How many records had been published at each flush, in order.
        self.flushed_at: list[int] = []
        self.lock = threading.Lock()

    def publish(self, topic: Topic, key: bytes, record: Any) -> bool:
        if self.check:
            record.check()
            record.encode()
        if self.round_trip:
            record = type(record).decode(record.encode())
        with self.lock:
            self.records.append((topic, key, record))
            n = len(self.records)
        return self.accept and not (self.refuse_every and n % self.refuse_every == 0)

    def flush(self, timeout_s: float = 30.0) -> int:
        with self.lock:
            self.flushes += 1
            self.flushed_at.append(len(self.records))
        return 0

    def of(self, kind: type) -> list[Any]:
        """The records of one type, in publication order."""
        return [r for _, _, r in self.records if isinstance(r, kind)]

    def batches(self) -> list[KernelBatch]:
        return [r for t, _, r in self.records if t is Topic.KERNELS]
