"""Range checks of every record's ``check()``: the values that decoded but killed a stage are now rejected at
decode time with a :class:`SchemaError` naming the field."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from argus.core.errors import SchemaError
from argus.schemas.records import TIME_LIMIT_NS, JobLifecycle, KernelBatch, LifecycleEvent, Record
from tests.samples import T0, kernel_batch, samples


def _rejected(rec: Record, match: str) -> None:
    with pytest.raises(SchemaError, match=match):
        rec.check()
    with pytest.raises(SchemaError, match=match):
        type(rec).decode(rec.encode())


def test_samples_pass() -> None:
    for rec in samples().values():
        rec.check()


@pytest.mark.parametrize("start", [2**63 - 1, -(2**63), TIME_LIMIT_NS, -TIME_LIMIT_NS])
def test_kernel_start_near_the_int64_limits_is_rejected(start: int) -> None:
    b = kernel_batch(n=4)
    bad = dataclasses.replace(b, start_ns=np.array([T0, T0, start, T0], dtype=np.int64))
    _rejected(bad, "start_ns value")


def test_kernel_batch_ranges() -> None:
    b = kernel_batch(n=4)
    _rejected(dataclasses.replace(b, duration_ns=np.array([1, 2, TIME_LIMIT_NS, 4])), "duration_ns")
    _rejected(dataclasses.replace(b, step=np.array([0, -2, 1, 1])), "step value -2")
    _rejected(dataclasses.replace(b, seq=-1), "seq")
    _rejected(dataclasses.replace(b, dropped=-5), "dropped")
    # Column lengths and the name dictionary agree.
    _rejected(dataclasses.replace(b, stream=np.array([1, 2, 3])), "column stream has 3 values")


def test_lifecycle_world_size_must_be_positive_except_on_diagnosed() -> None:
    start = JobLifecycle("j", LifecycleEvent.START, T0, 0)
    _rejected(start, "world_size value 0")
    _rejected(dataclasses.replace(start, world_size=-3), "world_size")
    _rejected(dataclasses.replace(start, world_size=4, steps=-1), "steps")
    _rejected(dataclasses.replace(start, world_size=4, job_id=""), "empty job_id")
    # A detector part that never learnt the job's size says 0.
    JobLifecycle("j", LifecycleEvent.DIAGNOSED, T0, 0, source="streams", part="l1l2").check()


@pytest.mark.parametrize("rank", [2**31, -1])
def test_step_rank_outside_int32_or_negative_is_rejected(rank: int) -> None:
    step = samples()["step"]
    with pytest.raises(SchemaError, match="rank value"):
        dataclasses.replace(step, rank=rank).check()


def test_step_and_phase_times() -> None:
    step, phases = samples()["step"], samples()["phase_batch"]
    _rejected(dataclasses.replace(step, wall_ns=-1), "wall_ns")
    _rejected(dataclasses.replace(step, gpu_ns=TIME_LIMIT_NS), "gpu_ns")
    _rejected(dataclasses.replace(step, start_ns=-(2**62)), "start_ns")
    _rejected(dataclasses.replace(phases, duration_ns=(4, -9)), "duration_ns value -9")
    _rejected(dataclasses.replace(phases, names=("forward",)), "column names has 1 values")
    _rejected(dataclasses.replace(phases, streams=(7, -2)), "streams")


def test_topology_ranks_inside_the_world() -> None:
    topo = samples()["job_topology"]
    _rejected(dataclasses.replace(topo, world_size=0, rank=(), host=(), dp_group=(), tp_group=(), pp_group=(),
                                  ep_group=(), pp_stage=()), "world_size value 0")
    _rejected(dataclasses.replace(topo, rank=(0, 2)), "rank value 2 outside")
    _rejected(dataclasses.replace(topo, rank=(1, 1)), "described twice")
    _rejected(dataclasses.replace(topo, pp_stage=(0, 1)), "pp_stage")
    _rejected(dataclasses.replace(topo, tp_group=(0, -1)), "tp_group")
    _rejected(dataclasses.replace(topo, rank=(0,)), "column rank has 1 values")


def test_summary_ranges() -> None:
    s = samples()["kernel_summary"]
    _rejected(dataclasses.replace(s, rank=(0, 2**31)), "rank value")
    _rejected(dataclasses.replace(s, window_end_ns=(s.window_start_ns[0], s.window_end_ns[1])), "window")
    _rejected(dataclasses.replace(s, cluster_sum_ns=(30, -80, 33)), "cluster_sum_ns")
    _rejected(dataclasses.replace(s, n_clusters=(2, 2)), "sum\\(n_clusters\\)")
    _rejected(dataclasses.replace(s, stream=-1), "stream")


def test_finding_dead_letter_and_stack_ranges() -> None:
    f, dl, stack = samples()["finding"], samples()["dead_letter"], samples()["cpu_stack"]
    _rejected(dataclasses.replace(f, ranks=(2**31,)), "ranks")
    _rejected(dataclasses.replace(f, time_ns=2**63 - 1), "time_ns")
    _rejected(dataclasses.replace(dl, partition=-1), "partition")
    _rejected(dataclasses.replace(stack, pid=2**31), "pid")


def test_job_end_marker_still_valid() -> None:
    KernelBatch.job_end_marker("j").check()


@pytest.mark.parametrize(("change", "match"), [
    ({"evidence_json": "{not json"}, "evidence_json is not JSON"),
    ({"evidence_json": '{"ratio": NaN}'}, "not JSON.*NaN"),
    ({"evidence_json": '{"ratio": -Infinity}'}, "not JSON.*Infinity"),
    ({"evidence_json": "[1, 2]"}, "JSON object"),
    ({"evidence_json": '{"x": "' + "a" * (1 << 20) + '"}'}, "over 1,048,576"),
    ({"score": float("nan")}, "score must be finite"),
    ({"impact_ns": float("inf")}, "impact_ns must be finite"),
    ({"impact_ns_per_step": -1.0}, "impact_ns_per_step must be finite and >= 0"),
])
def test_a_finding_that_would_break_its_readers_is_rejected(change: dict[str, object], match: str) -> None:
    """One stored finding with `{not json` made `argus findings`, the report and replay fail for its job."""
    _rejected(dataclasses.replace(samples()["finding"], **change), match)
