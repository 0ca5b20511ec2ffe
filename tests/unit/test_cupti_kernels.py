"""CUPTI kernel channel without a GPU: the pure parser on fake activity records, selective enablement, the
callback -> parser-thread path with a fake ``cupti`` module, and the UNAVAILABLE state on this machine."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import argus.producers.cupti_kernels as ck
from argus.producers.cupti_kernels import CuptiKernels, CuptiState
from argus.producers.cupti_parse import (
    KIND_CONCURRENT_KERNEL,
    KIND_MEMCPY,
    KIND_MEMSET,
    NameTable,
    StepMarks,
    build_kernel_batches,
    columns_to_batches,
    cupti_enabled_for,
    extract_columns,
    parse_rank_list,
)
from argus.topics import rank_key
from tests.samples import RecordingPublisher

T0 = 1_000_000_000


def kernel(name: str, start: int, dur: int, stream: int = 7, corr: int = 1) -> SimpleNamespace:
    return SimpleNamespace(kind=KIND_CONCURRENT_KERNEL, name=name, start=start, end=start + dur, stream_id=stream,
                           correlation_id=corr)


def memcpy(copy_kind: int, start: int, dur: int, stream: int = 9) -> SimpleNamespace:
    return SimpleNamespace(kind=KIND_MEMCPY, copy_kind=copy_kind, start=start, end=start + dur, stream_id=stream,
                           correlation_id=2)


def test_records_to_batches_columns_and_names() -> None:
    recs = [
        kernel("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", T0 + 300, 50, stream=13),
        kernel("gemm_128x128", T0 + 100, 20),
        memcpy(1, T0 + 50, 5),
        kernel("ncclKernel_AllReduce_RING_LL_Sum_bfloat16", T0 + 500, 40, stream=13),
        SimpleNamespace(kind=KIND_MEMSET, start=T0 + 700, end=T0 + 701, stream_id=9, correlation_id=3),
        SimpleNamespace(kind=5, start=T0, end=T0 + 1, stream_id=1),  # another activity kind: skipped
        kernel("bad", T0 + 900, -5),  # end before start: skipped
        kernel("zero", 0, 5),  # no timestamp: skipped
    ]
    (batch,) = build_kernel_batches(recs, job_id="j", rank=3, host="h", first_seq=4, clock_offset_ns=10)
    batch.check()
    assert batch.seq == 4 and batch.rank == 3 and batch.host == "h" and len(batch) == 5
    names = [batch.names[i] for i in batch.name_idx]
    assert names == ["memcpy:HtoD", "gemm_128x128", "nccl:AllReduce:Sum:bf16:RING:LL",
                     "nccl:AllReduce:Sum:bf16:RING:LL", "memset"]
    assert sorted(batch.names) == sorted(set(names))  # one dictionary entry per normalized name
    assert batch.start_ns.tolist() == [T0 + 60, T0 + 110, T0 + 310, T0 + 510, T0 + 710]
    assert batch.duration_ns.tolist() == [5, 20, 50, 40, 1]
    assert batch.stream.tolist() == [9, 7, 13, 13, 9]
    assert batch.step.tolist() == [-1] * 5
    assert type(batch).decode(batch.encode()).to_avro() == batch.to_avro()


def test_batches_are_cut_with_their_own_dictionaries_and_steps() -> None:
    recs = [kernel(f"k{i % 3}", T0 + 10 * i, 5) for i in range(7)]
    marks = (np.array([T0 + 25, T0], dtype=np.int64), np.array([8, 7], dtype=np.int32))  # unsorted on purpose
    batches = build_kernel_batches(recs, job_id="j", rank=0, batch_events=3, marks=marks)
    assert [len(b) for b in batches] == [3, 3, 1]
    assert [b.seq for b in batches] == [0, 1, 2]
    assert batches[0].names == ("k0", "k1", "k2")
    assert batches[2].names == ("k0",) and batches[2].name_idx.tolist() == [0]
    steps = np.concatenate([b.step for b in batches]).tolist()
    assert steps == [7, 7, 7, 8, 8, 8, 8]
    for b in batches:
        b.check()


def test_partial_tail_is_kept_for_the_next_call() -> None:
    names = NameTable()
    cols = extract_columns([kernel("k", T0 + i, 1) for i in range(5)], names)
    batches, rest = columns_to_batches(cols, names, job_id="j", rank=0, batch_events=2, final=False, dropped=9)
    assert [len(b) for b in batches] == [2, 2] and len(rest) == 1
    assert batches[0].dropped == 9 and batches[1].dropped == 0
    assert rest.start_ns.tolist() == [T0 + 4]


def test_extract_counts_malformed_records() -> None:
    names = NameTable()
    cols = extract_columns([object(), kernel("k", T0, 1), SimpleNamespace(kind=KIND_CONCURRENT_KERNEL)], names)
    assert len(cols) == 1 and cols.skipped == 2


def test_step_marks_keep_the_newest() -> None:
    marks = StepMarks(capacity=2)
    for s in range(4):
        marks.mark(s, T0 + s)
    starts, steps = marks.snapshot()
    assert starts.tolist() == [T0 + 2, T0 + 3] and steps.tolist() == [2, 3]


def test_rank_lists() -> None:
    assert parse_rank_list("all") is None and parse_rank_list("") is None
    assert parse_rank_list("none") == frozenset()
    assert parse_rank_list("0, 3,8-10") == {0, 3, 8, 9, 10}
    with pytest.raises(ValueError):
        parse_rank_list("3-1")
    with pytest.raises(ValueError):
        parse_rank_list("x")


@pytest.mark.parametrize(("rank", "world", "env", "argv", "dist", "ok", "why"), [
    (0, 1, {}, ["train.py"], False, True, ""),
    (0, 1, {"ARGUS_CUPTI": "0"}, ["train.py"], False, False, "ARGUS_CUPTI"),
    (0, 1, {}, ["python", "-m", "torch._inductor.compile_worker", "--pickler=x"], False, False, "compile worker"),
    (0, 8, {}, ["torchrun"], False, False, "launcher"),
    (0, 8, {"RANK": "0"}, ["train.py"], False, True, ""),
    (5, 8, {}, ["train.py"], True, True, ""),
    (5, 8, {"ARGUS_CUPTI_RANKS": "0-3"}, ["train.py"], True, False, "not in ARGUS_CUPTI_RANKS"),
    (2, 8, {"ARGUS_CUPTI_RANKS": "0-3"}, ["train.py"], True, True, ""),
    (2, 8, {"ARGUS_CUPTI_RANKS": "zero"}, ["train.py"], True, False, "unreadable"),
])
def test_selective_enablement(rank: int, world: int, env: dict[str, str], argv: list[str], dist: bool, ok: bool,
                              why: str) -> None:
    got, reason = cupti_enabled_for(rank, world, env, argv, distributed_initialized=dist)
    assert got is ok and why in reason


def test_start_without_gpu_is_unavailable_not_an_error() -> None:
    pytest.importorskip("torch")
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: tests/gpu covers the running state")
    pub = RecordingPublisher()
    kernels = CuptiKernels("job-x", 0, 1, pub, env={})
    status = kernels.start()
    assert status.state is CuptiState.UNAVAILABLE and status.reason
    assert kernels.stream_id(1234) is None
    kernels.stop()
    kernels.stop()  # idempotent
    (end,) = pub.batches()
    assert end.end_of_stream and len(end) == 0 and pub.records[0][1] == rank_key("job-x", 0)


def test_disabled_rank_still_ends_its_stream() -> None:
    pub = RecordingPublisher()
    kernels = CuptiKernels("job-x", 4, 8, pub, env={"ARGUS_CUPTI_RANKS": "0", "RANK": "4"})
    assert kernels.start().state is CuptiState.DISABLED
    kernels.stop()
    assert [b.end_of_stream for b in pub.batches()] == [True]


class FakeCupti:
    """Enough of ``cupti.cupti`` for CuptiKernels: callbacks are kept so the test can deliver buffers."""

    class ActivityAttribute:
        ATTR_DEVICE_BUFFER_SIZE = 0
        ATTR_DEVICE_BUFFER_PRE_ALLOCATE_VALUE = 7
        ATTR_DEVICE_BUFFER_POOL_LIMIT = 2

    def __init__(self) -> None:
        self.enabled: list[int] = []
        self.requested: Any = None
        self.completed: Any = None
        self.pending: list[list[Any]] = []
        self.attributes: list[int] = []

    def activity_set_attribute(self, attr: int, size: int, ptr: int) -> None:
        self.attributes.append(attr)

    def activity_register_callbacks(self, requested: Any, completed: Any) -> None:
        self.requested, self.completed = requested, completed

    def activity_enable(self, kind: int) -> None:
        self.enabled.append(kind)

    def activity_disable(self, kind: int) -> None:
        self.enabled.remove(kind)

    def activity_flush_period(self, ms: int) -> None:
        pass

    def activity_flush_all(self, flag: int) -> None:
        while self.pending:
            self.completed(self.pending.pop(0))

    def get_timestamp(self) -> int:
        return time.time_ns() - 1_000  # CUPTI clock 1 us behind the host's

    def get_stream_id_ex(self, ctx: int, stream: int, per_thread: int) -> int:
        return 40 + stream


def test_callback_to_parser_thread_with_fake_cupti(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeCupti()
    monkeypatch.setattr(ck, "_load_cupti", lambda: (fake, ""))
    pub = RecordingPublisher()
    marks = StepMarks()
    kernels = CuptiKernels("job-f", 2, 4, pub, marks, batch_events=4, env={"RANK": "2"}, max_latency_s=30.0)
    assert kernels.start().state is CuptiState.RUNNING
    assert fake.enabled == [KIND_CONCURRENT_KERNEL, KIND_MEMCPY, KIND_MEMSET] and len(fake.attributes) == 3
    assert fake.requested() == (2 << 20, 0)
    assert kernels.stream_id(3) == 43
    base = time.time_ns()
    marks.mark(0, base)
    fake.completed([kernel(f"k{i}", base + 10 * i, 5) for i in range(6)])  # CUPTI's thread would do this
    deadline = time.monotonic() + 5
    while not pub.batches() and time.monotonic() < deadline:
        time.sleep(0.01)
    first = pub.batches()
    assert [len(b) for b in first] == [4] and not first[0].end_of_stream
    fake.pending.append([kernel("tail", base + 1000, 5)])
    kernels.stop()
    assert fake.enabled == []
    batches = pub.batches()
    assert [len(b) for b in batches] == [4, 3] and batches[-1].end_of_stream
    assert [b.seq for b in batches] == [0, 1]
    assert all(k == rank_key("job-f", 2) for t, k, _ in pub.records)
    offset = batches[0].start_ns[0] - base
    assert 0 < offset < 1_000_000  # CUPTI time mapped to the host clock (1 us + measurement noise)
    assert batches[0].step.tolist() == [0, 0, 0, 0]
    stats = kernels.stats()
    assert stats.events == 7 and stats.records == 7 and stats.batches == 2 and stats.dropped_records == 0
    assert kernels.status.state is CuptiState.STOPPED


def test_full_inbox_drops_and_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeCupti()
    monkeypatch.setattr(ck, "_load_cupti", lambda: (fake, ""))
    pub = RecordingPublisher()
    kernels = CuptiKernels("job-d", 0, 1, pub, batch_events=100, max_queued_records=3, env={})
    kernels.start()
    kernels._stop.set()  # freeze the parser so that the inbox fills up
    kernels._wake.set()
    assert kernels._thread is not None
    kernels._thread.join(2)
    kernels._stop.clear()
    fake.completed([kernel("a", T0 + i, 1) for i in range(3)])
    fake.completed([kernel("b", T0 + i, 1) for i in range(5)])  # does not fit: dropped
    kernels.stop()
    (batch,) = pub.batches()
    assert len(batch) == 3 and batch.dropped == 5 and batch.end_of_stream
    assert kernels.stats().dropped_records == 5


def test_enable_failure_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    class Refusing(FakeCupti):
        def activity_enable(self, kind: int) -> None:
            raise RuntimeError("CUDA driver is not found")

    monkeypatch.setattr(ck, "_load_cupti", lambda: (Refusing(), ""))
    kernels = CuptiKernels("job-r", 0, 1, RecordingPublisher(), env={})
    status = kernels.start()
    assert status.state is CuptiState.UNAVAILABLE and "driver" in status.reason
    kernels.stop()
