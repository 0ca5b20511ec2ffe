"""The Kineto trace importer: streaming parse, records, topology, clock offsets, bad input, real traces."""

from __future__ import annotations

import gzip
import json
import tracemalloc
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from argus.core.errors import ArgusError, ConfigError, ProducerError
from argus.core.settings import Settings
from argus.producers.kineto import (
    import_kineto,
    kernel_batches,
    parse_topology,
    read_trace,
    step_records,
    topology_from_pg_config,
)
from argus.producers.kineto_parse import classify_phase, parse_rank, to_ns
from argus.producers.topology import build_topology, groups_of
from argus.schemas.records import (
    JobLifecycle,
    JobTopology,
    KernelBatch,
    LifecycleEvent,
    ParallelGroup,
    PhaseBatch,
    PhaseKind,
    Step,
)
from argus.topics import Topic, job_key, rank_key
from tests.samples import RecordingPublisher


def collector() -> RecordingPublisher:
    """Keeps every record as decoded from its Avro encoding (each one round-trips)."""
    return RecordingPublisher(round_trip=True)


REAL = Path(__file__).resolve().parents[2].parent / "shared" / "realtraces"
T0 = 1_700_000_000_000_000  # µs since the epoch
GPU = ("kernel", "gpu_memcpy", "gpu_memset")


def kernel(name: str, ts: float, dur: float, stream: int | None = 7, cat: str = "kernel", **extra: Any) -> dict:
    args = {"device": 0, "correlation": 1} if stream is None else {"device": 0, "stream": stream, "correlation": 1}
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": "x", "ts": ts, "dur": dur, "args": args, **extra}


def annotation(name: str, ts: float, dur: float, gpu: bool = False, stream: int = 7) -> dict:
    if gpu:
        return {"ph": "X", "cat": "gpu_user_annotation", "name": name, "pid": 0, "tid": stream, "ts": ts,
                "dur": dur, "args": {"External id": 1}}
    return {"ph": "X", "cat": "user_annotation", "name": name, "pid": 100, "tid": 100, "ts": ts, "dur": dur,
            "args": {"External id": 1}}


def trace_doc(events: list[dict], rank: int | None = 0, world: int = 1, *, info_after: bool = False,
              pg_config: list[dict] | None = None, extra: dict | None = None) -> dict:
    info: dict[str, Any] = {"backend": "nccl", "world_size": world}
    if rank is not None:
        info["rank"] = rank
    if pg_config is not None:
        info["pg_config"] = pg_config
    head = {"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "Test GPU"}]}
    meta = {"distributedInfo": info}
    if info_after:
        return {**head, "traceEvents": [{"ph": "M", "name": "process_name", "pid": 0}, *events], **meta,
                **(extra or {})}
    return {**head, **meta, "traceEvents": [{"ph": "M", "name": "process_name", "pid": 0}, *events],
            **(extra or {})}


def write(path: Path, doc: dict | str) -> Path:
    text = doc if isinstance(doc, str) else json.dumps(doc)
    if path.name.endswith(".gz"):
        with gzip.open(path, "wt") as fh:
            fh.write(text)
    else:
        path.write_text(text)
    return path


def one_step_rank(rank: int, offset_us: int = 0, steps: int = 2) -> list[dict]:
    """``steps`` steps of 1000 µs: forward/backward/allreduce phases and 3 kernels each."""
    ev: list[dict] = []
    for s in range(steps):
        t = T0 + offset_us + s * 1000
        ev += [annotation(f"ProfilerStep#{s}", t, 900), annotation("## forward ##", t + 10, 300),
               annotation("nccl:all_reduce", t + 400, 50), annotation("## backward ##", t + 500, 300, gpu=True),
               kernel("gemm", t + 20, 100), kernel("gemm", t + 510, 200),
               kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", t + 720, 80,
                      stream=13)]
    return ev


def rows(trace: Any) -> dict[str, list]:
    out: dict[str, list] = {"name": [], "stream": [], "start": [], "dur": []}
    for r in trace.rows(1000):
        out["name"] += [trace.names[i] for i in r["name"]]
        for f in ("stream", "start", "dur"):
            out[f] += r[f].tolist()
    return out


# -- parsing --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("info_after", [False, True])
def test_json_and_gz_read_alike_with_distributed_info_before_or_after(tmp_path: Path, info_after: bool) -> None:
    doc = trace_doc(one_step_rank(3), rank=3, world=4, info_after=info_after)
    plain, packed = write(tmp_path / "a.json", doc), write(tmp_path / "b.json.gz", doc)
    with parse_rank(plain) as a, parse_rank(packed) as b:
        assert (a.rank, a.world_size, b.rank, b.world_size) == (3, 4, 3, 4)
        assert a.kernel_events == b.kernel_events == 6
        assert rows(a) == rows(b)
        assert a.device == "Test GPU"
        assert [s.step for s in a.steps] == [0, 1]


def test_distributed_info_after_a_long_tail_is_still_found(tmp_path: Path) -> None:
    doc = trace_doc(one_step_rank(5), rank=5, world=8, info_after=True)
    doc = {k: v for k, v in doc.items() if k != "distributedInfo"}
    doc["distributedInfo"] = {"rank": 5, "world_size": 8}
    doc["INFO"] = ["x" * 1000] * 2000  # 2 MB after distributedInfo: beyond the kept tail
    with parse_rank(write(tmp_path / "t.json", doc)) as t:
        assert (t.rank, t.world_size) == (5, 8)


def test_members_after_trace_events_are_found_among_look_alike_brackets(tmp_path: Path) -> None:
    ev = [{**kernel("k", 100, 1), "args": {"stream": 7, "Input Dims": [[], [3]], "objs": [{"a": []}]}}] * 3
    doc = {"schemaVersion": 1, "traceEvents": ev, "deviceProperties": [{"id": 0, "name": "G"}],
           "distributedInfo": {"rank": 1, "world_size": 2, "pg_config": [{"pg_desc": "default_pg", "ranks": [0, 1]}]},
           "baseTimeNanoseconds": 5_000}
    with parse_rank(write(tmp_path / "t.json", doc)) as t:
        assert (t.rank, t.world_size, t.base_ns, t.device, t.kernel_events) == (1, 2, 5_000, "G", 3)
        assert rows(t)["start"] == [105_000] * 3


def test_base_time_after_trace_events_makes_times_absolute(tmp_path: Path) -> None:
    base = 1_711_964_646_000_000_000
    doc = trace_doc([annotation("ProfilerStep#4", 1000, 500), kernel("k", 1100, 10)], info_after=True,
                    extra={"traceName": "x", "displayTimeUnit": "ms", "baseTimeNanoseconds": base})
    with parse_rank(write(tmp_path / "t.json.gz", doc)) as t:
        assert t.base_ns == base
        assert rows(t)["start"] == [base + 1_100_000]
        assert t.steps[0].start_ns == base + 1_000_000


def test_rank_from_file_name_else_error(tmp_path: Path) -> None:
    doc = trace_doc([kernel("k", T0, 1)], rank=None)
    for name, rank in [("sampled_rank-1.json", 1), ("worker3_step_12.pt.trace.json", 3), ("x_rank7.json.gz", 7)]:
        with parse_rank(write(tmp_path / name, doc)) as t:
            assert t.rank == rank
    with pytest.raises(ProducerError, match=r"nameless\.json.*no rank"):
        parse_rank(write(tmp_path / "nameless.json", doc))


def test_microsecond_decimals_become_exact_rounded_nanoseconds(tmp_path: Path) -> None:
    ev = '{{"ph": "X", "cat": "kernel", "name": "{}", "ts": {}, "dur": {}, "args": {{"stream": 7}}}}'
    text = ('{"distributedInfo": {"rank": 0, "world_size": 1}, "traceEvents": ['
            + ",".join([ev.format("a", "1712195495519689.047", "2.0005"),
                        ev.format("b", "1712195495519695.8125", "0.0016"), ev.format("c", "1712195495519700", "3")])
            + "]}")
    with parse_rank(write(tmp_path / "t.json", text)) as t:
        r = rows(t)
    assert r["start"] == [1712195495519689047, 1712195495519695812, 1712195495519700000]  # .5 ns: half-even
    assert r["dur"] == [2000, 2, 3000]
    assert to_ns(1.5) == 1500 and to_ns(True) is None and to_ns("1") is None and to_ns(float("nan")) is None


def test_invalid_events_are_skipped_and_counted(tmp_path: Path) -> None:
    bad = [kernel("neg", T0, -1), kernel("nodur", T0, None), kernel("nots", None, 1), kernel("strts", "abc", 1),
           kernel("", T0, 1), kernel("nostream", T0, 1, stream=None), 42, annotation("ProfilerStep#1", T0, -5),
           {"ph": "X", "cat": "kernel", "name": "k", "ts": T0, "args": {"stream": 7}}]
    good = [kernel("  ncclKernel_AllReduce_RING_LL_Sum_float(ncclWorkElem)  ", T0 + 1, 1, stream=20),
            kernel("Memcpy HtoD (Pinned -> Device)", T0 + 2, 1, stream=22, cat="gpu_memcpy"),
            kernel("Memset (Device)", T0 + 3, 1, stream=22, cat="gpu_memset"),
            kernel("no_launch_event", T0 + 4, 1, cat="Kernel")]  # CUPTI kernel without a runtime launch
    with parse_rank(write(tmp_path / "t.json", trace_doc(bad + good))) as t:
        assert t.kernel_events == 4
        assert t.names == ["ncclKernel_AllReduce_RING_LL_Sum_float(ncclWorkElem)", "Memcpy HtoD (Pinned -> Device)",
                           "Memset (Device)", "no_launch_event"]
        assert t.streams == {20: 1, 22: 2, 7: 1}
        assert dict(t.skipped) == {"negative_dur": 2, "missing_dur": 2, "missing_ts": 1, "invalid_ts": 1,
                                   "missing_name": 1, "missing_stream": 1, "not_an_object": 1}


@pytest.mark.parametrize("content, reason", [
    (b"this is not json", "invalid JSON"),
    (b"", "invalid JSON"),
    (b'{"schemaVersion": 1, "distributedInfo": {"rank": 0}}', "no traceEvents"),
    (b'{"traceEvents": {"a": 1}}', "traceEvents is not an array"),
    (b'{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": 1, "dur": 1', "invalid JSON"),
    (b"42", "the top level is not a JSON object"),
    (gzip.compress(b'{"traceEvents": [', mtime=0)[:-6], "invalid JSON or compression"),
])
def test_a_file_that_is_not_a_trace_raises_producer_error_naming_it(tmp_path: Path, content: bytes,
                                                                       reason: str) -> None:
    path = tmp_path / "rank0.json"
    path.write_bytes(content)
    with pytest.raises(ProducerError, match=rf"rank0\.json: not a Kineto trace: {reason}") as exc:
        parse_rank(path, spill_dir=tmp_path)
    assert isinstance(exc.value, ArgusError)
    assert [p.name for p in tmp_path.iterdir()] == ["rank0.json"]  # the spill file is gone


def test_a_bare_array_of_events_is_read(tmp_path: Path) -> None:
    with parse_rank(write(tmp_path / "rank2.json", json.dumps([kernel("k", T0, 5)]))) as t:
        assert (t.rank, t.kernel_events) == (2, 1)


# -- records --------------------------------------------------------------------------------------------


def test_kernel_batches_are_columnar_with_per_batch_names_and_eos(tmp_path: Path) -> None:
    names = ["ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)",
             "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "gemm", "gemm", "relu"]
    ev = [kernel(n, T0 + i * 10, 5 + i, stream=7 + i % 2) for i, n in enumerate(names)]
    with parse_rank(write(tmp_path / "t.json", trace_doc(ev, rank=1, world=2))) as t:
        batches = list(kernel_batches(t, "job", batch_events=2, host="h1"))
    assert [len(b) for b in batches] == [2, 2, 1]
    assert [b.seq for b in batches] == [0, 1, 2]
    assert [b.end_of_stream for b in batches] == [False, False, True]
    assert all(b.rank == 1 and b.host == "h1" and b.job_id == "job" for b in batches)
    assert batches[1].names == ("gemm",) and batches[1].name_idx.tolist() == [0, 0]
    got = [b.names[i] for b in batches for i in b.name_idx]
    assert got == names  # both NCCL spellings kept as they are
    assert np.concatenate([b.start_ns for b in batches]).tolist() == [(T0 + i * 10) * 1000 for i in range(5)]
    assert np.concatenate([b.duration_ns for b in batches]).tolist() == [(5 + i) * 1000 for i in range(5)]
    assert np.concatenate([b.stream for b in batches]).tolist() == [7, 8, 7, 8, 7]
    for b in batches:
        b.check()


def test_a_rank_without_kernels_sends_an_empty_end_of_stream_batch(tmp_path: Path) -> None:
    with parse_rank(write(tmp_path / "t.json", trace_doc([annotation("ProfilerStep#1", T0, 5)]))) as t:
        (b,) = kernel_batches(t, "job")
    assert len(b) == 0 and b.end_of_stream and b.seq == 0


def test_kernels_take_the_step_of_the_cpu_span_extended_to_the_next_step(tmp_path: Path) -> None:
    ev = [annotation("ProfilerStep#7", T0, 50), annotation("ProfilerStep#8", T0 + 100, 50),
          kernel("before", T0 - 10, 1), kernel("in7", T0 + 10, 1), kernel("gap", T0 + 70, 1),
          kernel("in8", T0 + 120, 1), kernel("after", T0 + 400, 1)]
    with parse_rank(write(tmp_path / "t.json", trace_doc(ev))) as t:
        (b,) = kernel_batches(t, "job")
        steps = [s for s, _ in step_records(t, "job")]
    assert dict(zip([b.names[i] for i in b.name_idx], b.step.tolist(), strict=True)) == {
        "before": -1, "in7": 7, "gap": 7, "in8": 8, "after": 8}
    assert [(s.step, s.start_ns, s.wall_ns, s.gpu_ns) for s in steps if s is not None] == [
        (7, T0 * 1000, 50_000, 61_000), (8, (T0 + 100) * 1000, 50_000, 281_000)]


def test_gpu_step_annotations_bound_the_kernels_of_a_step(tmp_path: Path) -> None:
    ev = [annotation("ProfilerStep#1", T0, 50), annotation("ProfilerStep#2", T0 + 60, 50),
          annotation("ProfilerStep#1", T0 + 20, 60, gpu=True), annotation("ProfilerStep#1", T0 + 25, 70, gpu=True,
                                                                           stream=13),
          annotation("ProfilerStep#2", T0 + 100, 50, gpu=True),
          kernel("a", T0 + 10, 1), kernel("b", T0 + 30, 1), kernel("c", T0 + 90, 1), kernel("d", T0 + 96, 1),
          kernel("e", T0 + 120, 1)]
    with parse_rank(write(tmp_path / "t.json", trace_doc(ev))) as t:
        (b,) = kernel_batches(t, "job")
        assert (t.steps[0].gpu_start_ns, t.steps[0].gpu_end_ns) == ((T0 + 20) * 1000, (T0 + 95) * 1000)
    assert b.step.tolist() == [-1, 1, 1, -1, 2]


@pytest.mark.parametrize("name, kind", [
    ("## forward ##", PhaseKind.FORWARD), ("DistributedDataParallel.forward", PhaseKind.FORWARD),
    ("attn_fwd", PhaseKind.FORWARD), ("## backward ##", PhaseKind.BACKWARD), ("mlp_bwd", PhaseKind.BACKWARD),
    ("## optimizer ##", PhaseKind.OPTIMIZER), ("Optimizer.step#SGD.step", PhaseKind.OPTIMIZER),
    ("nccl:all_reduce", PhaseKind.ALL_REDUCE), ("allreduce_bucket", PhaseKind.ALL_REDUCE),
    ("nccl:_reduce_scatter_base", PhaseKind.REDUCE_SCATTER), ("nccl:_all_gather_base", PhaseKind.ALL_GATHER),
    ("nccl:all_gather", PhaseKind.ALL_GATHER), ("nccl:send", PhaseKind.SEND_RECV), ("nccl:recv", PhaseKind.SEND_RECV),
    ("nccl:all_to_all", PhaseKind.ALL_TO_ALL), ("## alltoall_bwd_single ##", PhaseKind.ALL_TO_ALL),
    ("nccl:broadcast", PhaseKind.BROADCAST), ("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__",
                                              PhaseKind.DATA_LOADER),
    ("## wait_for_batch ##", PhaseKind.OTHER),
])
def test_phase_kinds_from_annotation_names(name: str, kind: PhaseKind) -> None:
    assert classify_phase(name) is kind


def test_one_phase_batch_per_step_and_rank_even_without_phases(tmp_path: Path) -> None:
    ev = [annotation("ProfilerStep#1", T0, 100), annotation("ProfilerStep#2", T0 + 100, 100),
          annotation("## forward ##", T0 + 10, 20), annotation("nccl:all_reduce", T0 + 40, 5, gpu=True, stream=13),
          annotation("early", T0 - 50, 5)]
    with parse_rank(write(tmp_path / "t.json", trace_doc(ev, rank=2, world=4))) as t:
        recs = step_records(t, "job")
    assert [(s.step if s else None, p.step) for s, p in recs] == [(None, -1), (1, 1), (2, 2)]
    p1 = recs[1][1]
    assert p1.kinds == (PhaseKind.FORWARD, PhaseKind.ALL_REDUCE) and p1.streams == (-1, 13)
    assert p1.groups == (ParallelGroup.NONE, ParallelGroup.NONE)
    assert p1.start_ns == ((T0 + 10) * 1000, (T0 + 40) * 1000) and p1.duration_ns == (20_000, 5_000)
    assert recs[2][1].kinds == () and recs[0][1].names == ("early",)


def test_read_trace_yields_one_ranks_records_without_kafka(tmp_path: Path) -> None:
    recs = list(read_trace(write(tmp_path / "t.json.gz", trace_doc(one_step_rank(0))), "job", batch_events=4))
    assert [type(r).__name__ for r in recs] == ["Step", "PhaseBatch", "Step", "PhaseBatch", "KernelBatch",
                                                "KernelBatch"]
    assert sum(len(r) for r in recs if isinstance(r, KernelBatch)) == 6


# -- topology -------------------------------------------------------------------------------------------


def megatron_pg_config(rank: int, dp: int, tp: int, pp: int) -> list[dict]:
    topo = build_topology("x", dp, tp, pp)
    out = [{"pg_name": "0", "pg_desc": "default_pg", "pg_size": dp * tp * pp, "ranks": list(range(dp * tp * pp))}]
    for kind, desc in [(ParallelGroup.TP, "TENSOR_MODEL_PARALLEL_GROUP"), (ParallelGroup.DP, "DATA_PARALLEL_GROUP"),
                       (ParallelGroup.PP, "PIPELINE_MODEL_PARALLEL_GROUP")]:
        for members in groups_of(topo, kind).values():
            if rank in members:  # a rank's trace lists only the groups it is in
                out.append({"pg_name": str(len(out)), "pg_desc": desc, "pg_size": len(members), "ranks": members})
    return out


def test_megatron_pg_config_gives_the_topology(tmp_path: Path) -> None:
    for r in range(8):
        write(tmp_path / f"rank{r}.json", trace_doc(one_step_rank(r), rank=r, world=8,
                                                    pg_config=megatron_pg_config(r, 2, 2, 2)))
    out = collector()
    report = import_kineto(Settings(), tmp_path, "job", topology="dp=8", publisher=out)
    assert report.topology_source == "pg_config" and report.topology == "dp=2,tp=2,pp=2"
    (topo,) = out.of(JobTopology)
    expected = build_topology("job", 2, 2, 2)
    assert (topo.dp_group, topo.tp_group, topo.pp_group, topo.pp_stage) == (
        expected.dp_group, expected.tp_group, expected.pp_group, expected.pp_stage)
    assert any("ignored" in m for m in report.messages)


def test_pg_config_groups_outside_megatron_order_are_kept_as_they_are() -> None:
    pgs = [{"pg_desc": "TENSOR_MODEL_PARALLEL_GROUP", "ranks": [0, 2]},
           {"pg_desc": "TENSOR_MODEL_PARALLEL_GROUP", "ranks": [1, 3]},
           {"pg_desc": "DATA_PARALLEL_GROUP", "ranks": [0, 1]}, {"pg_desc": "DATA_PARALLEL_GROUP", "ranks": [2, 3]}]
    topo = topology_from_pg_config("j", 4, pgs)
    assert topo is not None
    assert groups_of(topo, ParallelGroup.TP) == {0: [0, 2], 1: [1, 3]}
    assert groups_of(topo, ParallelGroup.DP) == {0: [0, 1], 1: [2, 3]}
    assert (topo.tp_size, topo.dp_size, topo.pp_size) == (2, 2, 1)
    assert topology_from_pg_config("j", 2, [{"pg_desc": "default_pg", "ranks": [0, 1]}]) is None
    with pytest.raises(ProducerError, match="TP groups overlap"):
        topology_from_pg_config("j", 3, [{"pg_desc": "TENSOR_MODEL_PARALLEL_GROUP", "ranks": [0, 1]},
                                         {"pg_desc": "TENSOR_MODEL_PARALLEL_GROUP", "ranks": [1, 2]}])


def test_topology_flag_default_and_validation(tmp_path: Path) -> None:
    for r in range(4):
        write(tmp_path / f"rank{r}.json", trace_doc(one_step_rank(r), rank=r, world=4))
    report = import_kineto(Settings(), tmp_path, "job", topology="tp=2,dp=2", publisher=collector())
    assert (report.topology_source, report.topology) == ("flag", "dp=2,tp=2,pp=1")
    report = import_kineto(Settings(), tmp_path, "job", publisher=collector())
    assert (report.topology_source, report.topology) == ("default", "dp=4,tp=1,pp=1")
    with pytest.raises(ConfigError, match="world size is 4"):
        import_kineto(Settings(), tmp_path, "job", topology="dp=2,tp=4", publisher=collector())
    for bad in ["dp=0", "dp2", "dp=2,dp=2", "xx=1", "dp=3,ep=2"]:
        with pytest.raises(ConfigError):
            parse_topology(bad)
    assert parse_topology("pp=2, tp=4") == {"dp": 1, "tp": 4, "pp": 2, "ep": 1}


# -- import ---------------------------------------------------------------------------------------------


def test_import_publishes_in_pipeline_order_with_accounting(tmp_path: Path) -> None:
    for r in range(2):
        write(tmp_path / f"rank{r}.json.gz", trace_doc(one_step_rank(r), rank=r, world=2))
    out = collector()
    lines: list[str] = []
    report = import_kineto(Settings(), tmp_path, "job-k", batch_events=4, publisher=out, progress=lines.append)
    topics = [t for t, _, _ in out.records]
    assert topics[:2] == [Topic.TOPOLOGY, Topic.LIFECYCLE] and topics[-1] is Topic.LIFECYCLE
    assert len(out.records) - 1 in out.flushed_at  # END published after a flush of everything before it
    start, end = out.of(JobLifecycle)
    assert (start.event, end.event, start.source, end.source) == (LifecycleEvent.START, LifecycleEvent.END,
                                                                  "kineto-import", "kineto-import")
    assert (end.kernel_events, end.steps, end.phase_batches, end.world_size) == (12, 4, 4, 2)
    assert start.time_ns == T0 * 1000 and end.time_ns == (T0 + 1900) * 1000
    for topic, key, rec in out.records:
        if topic in (Topic.STEPS, Topic.PHASES, Topic.TOPOLOGY, Topic.LIFECYCLE):
            assert key == job_key("job-k")
        else:
            assert key == rank_key("job-k", rec.rank)
    assert [(s.step, s.rank) for s in out.of(Step)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in range(2):
        bs = [b for b in out.of(KernelBatch) if b.rank == r]
        assert [b.seq for b in bs] == [0, 1] and [b.end_of_stream for b in bs] == [False, True]
    assert (report.kernel_events, report.kernel_batches, report.steps, report.phase_batches) == (12, 4, 4, 4)
    assert report.ranks == (0, 1) and report.world_size == 2 and report.records_dropped == 0
    assert report.nccl_kernels == ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",)
    assert report.streams == {0: {7: 4, 13: 2}, 1: {7: 4, 13: 2}}
    assert len(lines) >= 3


def test_clock_skew_is_reported_and_aligned_beyond_the_threshold(tmp_path: Path) -> None:
    write(tmp_path / "rank0.json", trace_doc(one_step_rank(0), rank=0, world=2))
    write(tmp_path / "rank1.json", trace_doc(one_step_rank(1, offset_us=134_000), rank=1, world=2))
    out = collector()
    report = import_kineto(Settings(), tmp_path, "job", publisher=out)
    assert report.clock_offsets_ns == {0: 0, 1: 134_000_000} and report.clock_aligned
    s0, s1 = (next(s for s in out.of(Step) if s.rank == r and s.step == 0) for r in (0, 1))
    assert s0.start_ns == s1.start_ns
    k1 = next(b for b in out.of(KernelBatch) if b.rank == 1)
    assert int(k1.start_ns[0]) == (T0 + 20) * 1000
    report = import_kineto(Settings(), tmp_path, "job", publisher=collector(), align_clocks=False)
    assert not report.clock_aligned and report.clock_offsets_ns[1] == 134_000_000
    write(tmp_path / "rank1.json", trace_doc(one_step_rank(1, offset_us=2_000), rank=1, world=2))
    report = import_kineto(Settings(), tmp_path, "job", publisher=collector())
    assert not report.clock_aligned and report.clock_offsets_ns == {0: 0, 1: 2_000_000}


def test_duplicate_ranks_partial_worlds_and_empty_directories(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    write(tmp_path / "a" / "x.json", trace_doc(one_step_rank(0), rank=0, world=2))
    write(tmp_path / "a" / "y.json", trace_doc(one_step_rank(0), rank=0, world=2))
    with pytest.raises(ProducerError, match="both rank 0"):
        import_kineto(Settings(), tmp_path / "a", "job", publisher=collector())
    (tmp_path / "b").mkdir()
    with pytest.raises(ProducerError, match=r"no \.json"):
        import_kineto(Settings(), tmp_path / "b", "job", publisher=collector())
    write(tmp_path / "b" / "r.json", trace_doc(one_step_rank(1), rank=1, world=16))
    report = import_kineto(Settings(), tmp_path / "b", "job", publisher=collector())
    assert (report.world_size, report.trace_world_size) == (2, 16)
    assert any("rank 0 have no trace" in m or "ranks 0 have no trace" in m for m in report.messages)
    write(tmp_path / "b" / "r.json", trace_doc(one_step_rank(1), rank=4, world=2))
    with pytest.raises(ProducerError, match="outside world_size 2"):
        import_kineto(Settings(), tmp_path / "b", "job", publisher=collector())


def test_a_bad_file_aborts_before_anything_is_published(tmp_path: Path) -> None:
    write(tmp_path / "rank0.json", trace_doc(one_step_rank(0), rank=0, world=2))
    (tmp_path / "rank1.json").write_text('{"traceEvents": [{"ph": "X"')
    out = collector()
    with pytest.raises(ProducerError, match=r"rank1\.json"):
        import_kineto(Settings(), tmp_path, "job", publisher=out)
    assert out.records == []


@pytest.mark.slow
def test_memory_stays_bounded_on_a_large_trace(tmp_path: Path) -> None:
    n = 60_000
    path = tmp_path / "rank0.json"
    with path.open("w") as fh:
        fh.write('{"distributedInfo": {"rank": 0, "world_size": 1}, "traceEvents": [')
        fh.write(json.dumps(annotation("ProfilerStep#1", T0, 10 * n)))
        for i in range(n):
            fh.write("," + json.dumps(kernel(f"kernel_{i % 50}", T0 + 10 * i, 5,
                                             extra_args={"grid": [i, 1, 1], "pad": "x" * 200})))
        fh.write("]}")
    size = path.stat().st_size
    tracemalloc.start()
    try:
        with parse_rank(path) as t:
            total = sum(len(b) for b in kernel_batches(t, "job", 4096))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert total == n
    assert peak < 8 * 2**20 and size > 3 * peak, (peak, size)  # constant, not proportional to the file


# -- real traces ----------------------------------------------------------------------------------------

needs_real = pytest.mark.skipif(not REAL.is_dir(), reason=f"{REAL} is absent")


def _direct_counts(path: Path) -> Counter[str]:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt") as fh:
        doc = json.load(fh)
    return Counter(str(e.get("cat")).lower() for e in doc["traceEvents"] if str(e.get("cat")).lower() in GPU)


@needs_real
def test_real_param_dlrm_8_ranks() -> None:
    directory = REAL / "param_dlrm_8rank_v100"
    out = collector()
    report = import_kineto(Settings(), directory, "dlrm", publisher=out)
    assert report.ranks == tuple(range(8)) and report.world_size == 8 and report.trace_world_size == 8
    assert (report.topology_source, report.topology) == ("default", "dp=8,tp=1,pp=1")
    assert report.skipped_events == {} and report.steps == 8 and not report.clock_aligned
    for path in sorted(directory.rglob("*.json")):
        rank = int(path.name[len("worker")])
        direct = _direct_counts(path)
        batches = [b for b in out.of(KernelBatch) if b.rank == rank]
        names = [b.names[i] for b in batches for i in b.name_idx]
        assert len(names) == sum(direct.values())
        assert sum(not n.startswith(("Memcpy", "Memset")) for n in names) == direct["kernel"]
        streams = np.concatenate([b.stream for b in batches])
        nccl = np.array([n.startswith("nccl") for n in names])
        (nccl_stream,) = set(streams[nccl].tolist())  # NCCL runs on its own stream ...
        assert not any(streams[~nccl] == nccl_stream)  # ... which runs nothing else
        assert {s.step for s in out.of(Step) if s.rank == rank} == {10}
    assert set(report.nccl_kernels) == {
        "ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)",
        "ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)"}
    assert max(abs(o) for o in report.clock_offsets_ns.values()) < 10_000_000
    assert 0 <= report.max_out_of_order_ns < 1_000_000  # kernels are nearly in order in these files


@needs_real
def test_real_hta_sampled_2_ranks() -> None:
    out = collector()
    report = import_kineto(Settings(), REAL / "hta_sampled_2rank", "hta", publisher=out)
    assert report.ranks == (0, 1) and report.trace_world_size == 128 and report.world_size == 2
    # First common step (ProfilerStep#551): rank 1 starts 192 µs after rank 0. The two clocks agree: NCCL
    # kernels of one collective end at the same µs on both ranks (e.g. ...98187835).
    assert report.clock_offsets_ns == {0: 0, 1: 192_000} and not report.clock_aligned
    for r, path in enumerate(sorted((REAL / "hta_sampled_2rank").glob("*.json.gz"))):
        assert sum(len(b) for b in out.of(KernelBatch) if b.rank == r) == sum(_direct_counts(path).values())
    assert sorted((s.rank, s.step) for s in out.of(Step)) == [(0, 551), (0, 552), (1, 551), (1, 552)]
    assert all(p.kinds for p in out.of(PhaseBatch))


@pytest.mark.slow
@needs_real
def test_real_hta_single_ranks_parse_and_mixed_jobs_are_refused() -> None:
    with parse_rank(REAL / "hta_single_rank/nccl_parser_config/nccl_data.json.gz") as t:
        assert t.base_ns == 1_711_964_646_000_000_000  # written after traceEvents
        assert t.steps[0].start_ns == 1_711_964_646_000_000_000 + 4_458_676_416_788_066
        assert t.pg_config and t.pg_config[0]["pg_desc"] == "default_pg"
    with pytest.raises(ProducerError, match="both rank"):
        import_kineto(Settings(), REAL / "hta_single_rank", "mixed", publisher=collector())
