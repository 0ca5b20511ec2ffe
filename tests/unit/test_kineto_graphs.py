"""Kineto traces of CUDA-graph training: kernels replayed by a ``cudaGraphLaunch`` come through ``argus
import-kineto``'s importer with their graph (the trace's ``graph id`` / ``graph node id`` args where it names
them; :attr:`KernelBatch.UNKNOWN_GRAPH` where only the launch's correlation id ties them to the graph launch),
beside kernels launched on their own, and none of them is lost (HTA #290: graph-launched kernels missing)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from argus.core.settings import Settings
from argus.producers.kineto import import_kineto
from argus.schemas.records import KernelBatch
from tests.unit.test_kineto import T0, annotation, collector, kernel, trace_doc, write


def runtime(name: str, ts: float, corr: int) -> dict[str, Any]:
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "pid": 100, "tid": 100, "ts": ts, "dur": 5,
            "args": {"correlation": corr, "cbid": 311}}


def graph_step(s: int) -> list[dict[str, Any]]:
    """One step: an eager kernel (cudaLaunchKernel), then a replay of a 3-kernel graph. In even steps the trace
    names the graph and nodes (newer Kineto), in odd ones only the launch's correlation ties them to it."""
    t = T0 + s * 1000
    corr = 100 + s
    named = s % 2 == 0
    ev = [annotation(f"ProfilerStep#{s}", t, 900), runtime("cudaLaunchKernel", t + 1, 50 + s),
          kernel("embedding", t + 10, 50) | {"args": {"device": 0, "stream": 7, "correlation": 50 + s}},
          runtime("cudaGraphLaunch", t + 60, corr)]
    for i, name in enumerate(("gemm", "gelu", "gemm")):
        args: dict[str, Any] = {"device": 0, "stream": 7, "correlation": corr}
        if named:
            args |= {"graph id": 4, "graph node id": 10 + i}
        ev.append(kernel(name, t + 100 + 100 * i, 80) | {"args": args})
    return ev


def test_graph_kernels_through_the_kineto_importer(tmp_path: Path) -> None:
    events = [e for s in range(4) for e in graph_step(s)]
    write(tmp_path / "rank0.json", trace_doc(events, rank=0, world=1))
    out = collector()
    report = import_kineto(Settings(), tmp_path, "job-graphs", batch_events=64, publisher=out)
    batches = out.of(KernelBatch)
    assert report.kernel_events == 16 == sum(len(b) for b in batches)  # every graph kernel kept
    names = [b.names[i] for b in batches for i in b.name_idx.tolist()]
    graphs = [int(g) for b in batches for g in (b.graph_id if len(b.graph_id) else [0] * len(b))]
    nodes = [int(n) for b in batches for n in (b.graph_node_id if len(b.graph_node_id) else [0] * len(b))]
    unknown = KernelBatch.UNKNOWN_GRAPH
    assert names[:4] == ["embedding", "gemm", "gelu", "gemm"]
    assert graphs == [0, 4, 4, 4, 0, unknown, unknown, unknown] * 2
    assert nodes == [0, 10, 11, 12, 0, 0, 0, 0] * 2
    assert [b.step.tolist() for b in batches] == [[0] * 4 + [1] * 4 + [2] * 4 + [3] * 4]


def test_a_trace_without_graphs_has_no_graph_columns(tmp_path: Path) -> None:
    write(tmp_path / "rank0.json", trace_doc([annotation("ProfilerStep#0", T0, 900), kernel("gemm", T0 + 10, 50)]))
    out = collector()
    import_kineto(Settings(), tmp_path, "job-plain", publisher=out)
    assert all(len(b.graph_id) == 0 for b in out.of(KernelBatch))
