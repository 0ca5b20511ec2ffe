"""CUDA graphs without a GPU: graph-launched kernels from fake CUPTI records keep their graph and node ids through
the parser, the collector and the wire (kernel_batch v3), and are judged like any other by the diagnosis; the
tracer records nothing inside a captured region (no CUDA event on a capturing stream, phases left out and
counted, collectives passed through) and times each graph replay as a phase."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import argus.producers.cupti_kernels as ck
from argus.producers.cupti_kernels import CuptiKernels
from argus.producers.cupti_parse import KIND_CONCURRENT_KERNEL, NameTable, columns_to_batches, extract_columns
from argus.producers.faults import FaultSpec
from argus.producers.simulator import JobSimulator, JobSpec
from argus.schemas.codec import codec
from argus.schemas.records import KernelBatch, PhaseBatch, PhaseKind, Step
from argus.streams.offline import diagnose_records
from tests.samples import RecordingPublisher
from tests.unit.test_cupti_kernels import FakeCupti

T0 = 1_700_000_000_000_000_000


def graph_kernel(name: str, start: int, graph: int, node: int, stream: int = 7) -> SimpleNamespace:
    return SimpleNamespace(kind=KIND_CONCURRENT_KERNEL, name=name, start=start, end=start + 40, stream_id=stream,
                           correlation_id=9, graph_id=graph, graph_node_id=node)


def plain_kernel(name: str, start: int) -> SimpleNamespace:
    return SimpleNamespace(kind=KIND_CONCURRENT_KERNEL, name=name, start=start, end=start + 40, stream_id=7,
                           correlation_id=1)


def test_graph_ids_through_the_parser_and_the_wire() -> None:
    names = NameTable()
    big_node = 2**63 + 5  # a 64-bit node id: kept as its bit pattern
    recs = [plain_kernel("gemm", T0), graph_kernel("gemm", T0 + 100, 3, 17), graph_kernel("softmax", T0 + 200, 3,
                                                                                          big_node)]
    cols = extract_columns(recs, names)
    assert cols.graph_id is not None and cols.graph_id.tolist() == [0, 3, 3]
    (batch,), _ = columns_to_batches(cols, names, job_id="j", rank=0, batch_events=8)
    assert batch.graph_launched.tolist() == [False, True, True]
    again = KernelBatch.decode(batch.encode())
    assert batch.encode()[1] == 3
    assert again.graph_id.tolist() == [0, 3, 3]
    assert again.graph_node_id.view(np.uint64).tolist() == [0, 17, big_node]
    # A batch of plain kernels pays nothing for the graph columns, and reads back without them.
    (plain,), _ = columns_to_batches(extract_columns([plain_kernel("gemm", T0)], names), names, job_id="j", rank=0)
    assert len(plain.graph_id) == 0 and not KernelBatch.decode(plain.encode()).graph_launched.any()
    assert codec("kernel_batch").decode(plain.encode())["graph_id"] == b""


def test_records_without_graph_fields_and_the_slow_path() -> None:
    names = NameTable()
    cols = extract_columns([plain_kernel("a", T0), plain_kernel("b", T0 + 50)], names)  # older CUPTI: no fields
    assert cols.graph_id is not None and not cols.graph_id.any()
    broken = SimpleNamespace(kind=KIND_CONCURRENT_KERNEL, name="x")  # no times: the record-by-record path
    cols = extract_columns([graph_kernel("g", T0, 2, 4), broken], names)
    assert cols.skipped == 1 and cols.graph_id is not None and cols.graph_id.tolist() == [2]
    assert cols.graph_node_id is not None and cols.graph_node_id.tolist() == [4]


def test_graph_kernels_through_the_collector(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeCupti()
    monkeypatch.setattr(ck, "_load_cupti", lambda: (fake, ""))
    pub = RecordingPublisher(check=True, round_trip=True)
    k = CuptiKernels("job-g", 0, 1, pub, batch_events=64, env={}, max_latency_s=30.0)
    k.start()
    base = time.time_ns()
    # One replay of a 3-node graph, then a kernel launched on its own.
    fake.pending.append([graph_kernel(f"node{i}", base + 100 * i, 11, i + 1) for i in range(3)]
                        + [plain_kernel("eager", base + 1000)])
    k.stop()
    (batch,) = pub.batches()
    assert batch.graph_id.tolist() == [11, 11, 11, 0] and batch.graph_node_id.tolist() == [1, 2, 3, 0]
    assert [batch.names[i] for i in batch.name_idx.tolist()] == ["node0", "node1", "node2", "eager"]


def test_graph_launched_kernels_are_judged_like_others() -> None:
    base = JobSpec("graphs", dp=8, steps=30, seed=0)
    spec = dataclasses.replace(base, fault=FaultSpec.compute_straggler(JobSimulator(base).topology(), rank=5,
                                                                       onset_step=5))

    def as_graphs(rec: Any) -> Any:  # every kernel replayed by graph 1 (node = its position in the batch)
        if isinstance(rec, KernelBatch) and len(rec):
            return dataclasses.replace(rec, graph_id=np.ones(len(rec), np.uint32),
                                       graph_node_id=np.arange(1, len(rec) + 1, dtype=np.int64))
        return rec

    plain = diagnose_records(r.record for r in JobSimulator(spec).records())["graphs"]
    graphs = diagnose_records(as_graphs(KernelBatch.decode(r.record.encode()) if isinstance(r.record, KernelBatch)
                                        else r.record) for r in JobSimulator(spec).records())["graphs"]
    assert plain and {(f.level, f.kind, f.ranks) for f in graphs} == {(f.level, f.kind, f.ranks) for f in plain}


# -- the tracer and captures --------------------------------------------------------------------------------

torch = pytest.importorskip("torch")

from argus.producers.rank_registry import RankRegistry  # noqa: E402
from argus.producers.tracer import Tracer  # noqa: E402
from argus.schemas.records import ParallelGroup  # noqa: E402
from tests.unit.test_tracer import FakeCuda, FakeTorch  # noqa: E402


class CapturingCuda(FakeCuda):
    """FakeCuda with stream capture and CUDA graphs: a replay runs 5 fake ms of GPU work."""

    def __init__(self) -> None:
        super().__init__()
        self.capturing = False
        cuda = self

        class CUDAGraph:
            def replay(self) -> None:
                cuda.clock += 5.0
                cuda.log.append(("replay", self, None))

        self.CUDAGraph = CUDAGraph
        original = self.Event

        class Event(original):  # type: ignore[misc, valid-type]
            def record(self, stream: Any = None) -> None:
                assert not cuda.capturing, "a timing event recorded on a capturing stream"
                super().record(stream)

        self.Event = Event

    def is_current_stream_capturing(self) -> bool:
        return self.capturing


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> CapturingCuda:
    import argus.producers.tracer as tracer_mod
    import argus.producers.tracer_collectives as coll_mod

    c = CapturingCuda()
    monkeypatch.setattr(tracer_mod, "torch", FakeTorch(c))
    monkeypatch.setattr(coll_mod, "torch", FakeTorch(c))
    return c


def _tracer(pub: RecordingPublisher, tmp_path: Path) -> Tracer:
    return Tracer(None, "job-cg", 0, 1, pub, kernels=False, registry=RankRegistry(tmp_path / "r"), cuda=True,
                  heartbeat=False, reduce_counts=False)


def test_nothing_is_recorded_inside_a_capture(cuda: CapturingCuda, tmp_path: Path) -> None:
    pub = RecordingPublisher(check=True)
    with _tracer(pub, tmp_path) as tr:
        with tr.step():
            with tr.phase("eager", PhaseKind.FORWARD):
                pass
            cuda.capturing = True  # e.g. torch.compile(mode="reduce-overhead") capturing its graph
            with tr.phase("captured-forward", PhaseKind.FORWARD), tr.phase("captured-mlp", PhaseKind.FORWARD):
                pass
            with tr.phase("captured-then-ends", PhaseKind.OTHER):  # opened in the capture: left out
                cuda.capturing = False
            with tr.phase("capture-begins-inside", PhaseKind.OTHER):  # no end event: dropped at publication
                cuda.capturing = True
            cuda.capturing = False
        cuda.capturing = True
        with tr.step():  # a step that begins and ends while capturing: timed on the host only
            cuda.capturing = True
        cuda.capturing = False
    stats = tr.stats()
    steps, batches = pub.of(Step), pub.of(PhaseBatch)
    assert len(steps) == 2 and steps[0].gpu_ns is not None and steps[1].gpu_ns is None
    assert batches[0].names == ("eager",)  # captured phases left out, the one closed inside the capture dropped
    assert stats.phases_captured == 3 and stats.phases_dropped == 1
    assert stats.errors == 0


def test_a_collective_inside_a_capture_passes_through(cuda: CapturingCuda, tmp_path: Path) -> None:
    pub = RecordingPublisher(check=True)
    tr = _tracer(pub, tmp_path).start()
    calls: list[str] = []
    with tr.step():
        cuda.capturing = True  # NCCL captured into the graph (Megatron's full-iteration capture)
        tr._collective("dp-allreduce", PhaseKind.ALL_REDUCE, ParallelGroup.DP,
                       [SimpleNamespace(is_cuda=True, device="cuda:0")], None, False, lambda: calls.append("nccl"))
        cuda.capturing = False
    tr.close()
    assert calls == ["nccl"]  # launched, as the user asked
    assert not [e for e in cuda.log if e[0] == "wait"]  # and no stream fork/join inside the capture
    assert pub.of(PhaseBatch)[0].names == ()


def test_graph_replays_are_timed_as_phases(cuda: CapturingCuda, tmp_path: Path) -> None:
    pub = RecordingPublisher(check=True)
    g1, g2 = cuda.CUDAGraph(), cuda.CUDAGraph()
    with _tracer(pub, tmp_path) as tr:
        assert cuda.CUDAGraph.replay is not None and hasattr(cuda.CUDAGraph.replay, "__wrapped__")
        for _ in range(2):
            with tr.step():
                g1.replay()  # e.g. the forward and backward graphs of make_graphed_callables
                g2.replay()
        g1.replay()  # outside a step: replayed, not timed
    assert not hasattr(cuda.CUDAGraph.replay, "__wrapped__")  # restored at close
    batches = pub.of(PhaseBatch)
    assert [b.names for b in batches] == [("cuda-graph-0", "cuda-graph-1")] * 2
    assert all(d == 6_000_000 for b in batches for d in b.duration_ns)  # 5 fake ms of replay + 1 per event
    assert sum(1 for e in cuda.log if e[0] == "replay") == 5
