"""Parallel groups of imported communication phases: point-to-point role names and the process groups
that NCCL kernels name in their args (PyTorch 2.3+), through parse -> import -> topology and phases."""

from __future__ import annotations

from pathlib import Path

from argus.core.settings import Settings
from argus.producers.kineto import import_kineto
from argus.producers.kineto_groups import PhaseGroups
from argus.producers.kineto_parse import StreamPG, stream_pg
from argus.producers.topology import build_topology
from argus.schemas.records import JobTopology, ParallelGroup, PhaseBatch, PhaseKind
from tests.unit.test_kineto import T0, annotation, collector, kernel, trace_doc, write

AR = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"


def test_sends_and_receives_between_stages_are_named_by_their_role() -> None:
    topo = build_topology("j", dp=2, pp=2)  # stage 0: ranks 0, 1; stage 1: ranks 2, 3
    g = PhaseGroups(topo)
    n = ParallelGroup.NONE
    assert g.phase(0, "nccl:send 0->2", PhaseKind.SEND_RECV, n) == ("nccl:send next", ParallelGroup.PP)
    assert g.phase(2, "nccl:recv 2<-0", PhaseKind.SEND_RECV, n) == ("nccl:recv prev", ParallelGroup.PP)
    assert g.phase(3, "nccl:send 3->1", PhaseKind.SEND_RECV, n) == ("nccl:send prev", ParallelGroup.PP)
    # Local ranks of the pipeline group (the stage), as a send on the PP process group names them.
    assert g.phase(3, "nccl:recv 1<-0", PhaseKind.SEND_RECV, n) == ("nccl:recv prev", ParallelGroup.PP)
    # A peer outside the pipeline, or not a transfer at all: unchanged.
    assert g.phase(0, "nccl:send 0->3", PhaseKind.SEND_RECV, n) == ("nccl:send 0->3", n)
    assert g.phase(0, "forward", PhaseKind.FORWARD, ParallelGroup.DP) == ("forward", n)
    assert g.phase(0, "nccl:all_reduce", PhaseKind.ALL_REDUCE, ParallelGroup.DP) == ("nccl:all_reduce",
                                                                                     ParallelGroup.DP)


def test_a_stream_group_is_found_by_megatron_description_or_by_members() -> None:
    topo = build_topology("j", dp=2, tp=2, pp=2)
    g = PhaseGroups(topo)
    assert g.stream_group(0, StreamPG("3", "data_parallel_group", ())) is ParallelGroup.DP
    tp = [r for r in topo.rank if topo.tp_group[r] == topo.tp_group[0]]
    assert g.stream_group(0, StreamPG("7", "undefined", tuple(tp))) is ParallelGroup.TP
    assert g.stream_group(0, StreamPG("0", "default_pg", tuple(topo.rank))) is ParallelGroup.NONE
    assert g.stream_group(0, StreamPG("9", "", ())) is ParallelGroup.NONE


def test_stream_pg_reads_kernel_args_and_refuses_what_does_not_parse() -> None:
    assert stream_pg({"Process Group Name": "2", "Process Group Description": "DATA_PARALLEL_GROUP",
                      "Process Group Ranks": "[0, 4, 8]"}) == StreamPG("2", "DATA_PARALLEL_GROUP", (0, 4, 8))
    assert stream_pg({"Process Group Name": 5, "Process Group Ranks": "[0, x]"}) == StreamPG("5", "", ())
    assert stream_pg({"Process Group Ranks": [1, 3]}) is None


def _rank_events(rank: int, dp_peer: int) -> list[dict]:
    ev: list[dict] = []
    for s in range(2):
        t = T0 + s * 1000
        ranks = f"[{min(rank, dp_peer)}, {max(rank, dp_peer)}]"
        ev += [annotation(f"ProfilerStep#{s}", t, 900),
               annotation("nccl:all_reduce", t + 700, 100, gpu=True, stream=13),
               kernel("gemm", t + 20, 100),
               kernel(AR, t + 720, 80, stream=13, args={"device": 0, "stream": 13, "correlation": 1,
                                                         "Process Group Name": "1", "Process Group Ranks": ranks,
                                                         "Process Group Description": "undefined"})]
    return ev


def test_import_publishes_the_stream_groups_and_labels_the_collective_phases(tmp_path: Path) -> None:
    # DP 2 x TP 2: rank r's DP peer is r ^ 2; the all-reduce stream's kernels name that group by its ranks.
    for r in range(4):
        write(tmp_path / f"rank{r}.json", trace_doc(_rank_events(r, r ^ 2), rank=r, world=4))
    out = collector()
    import_kineto(Settings(), tmp_path, "job-g", topology="dp=2,tp=2,pp=1", publisher=out)
    (topo,) = out.of(JobTopology)
    assert topo.stream_groups() == {13: ParallelGroup.DP}
    labelled = {(b.rank, n, g) for b in out.of(PhaseBatch) for n, g in zip(b.names, b.groups, strict=True)}
    assert labelled == {(r, "nccl:all_reduce", ParallelGroup.DP) for r in range(4)}
