"""The job context shared between workers: conversions both ways, the merged rank aggregate, and the
table's keys and tombstones (the thread itself runs against the broker in tests/integration)."""

from __future__ import annotations

from argus.detectors.impact import StepClock
from argus.detectors.l3_ranks import KernelTotals
from argus.schemas.job_context import CONTEXT_JOB_PART, JobContext
from argus.schemas.records import ParallelGroup
from argus.streams.diagnosis import RankDiagnosis
from argus.streams.job_context import (
    ContextTable,
    context_clock,
    context_groups,
    context_key,
    context_topology,
    context_totals,
    job_context,
    totals_context,
)
from tests.samples import samples


def test_the_job_agents_context_round_trips() -> None:
    topo = samples()["job_topology"]
    clock = StepClock((10, 20, 30), 10.0)
    ctx = job_context(topo.job_id, 99, topo, {17: ParallelGroup.TP, 7: ParallelGroup.DP}, {3, 1}, clock, True)
    back = JobContext.decode(ctx.encode())
    assert back.part == CONTEXT_JOB_PART and back.final and back.stragglers == (1, 3)
    assert context_topology(back) == topo and context_clock(back) == clock
    assert context_groups(back) == {7: ParallelGroup.DP, 17: ParallelGroup.TP}
    # Onsets and routed tokens (v3) travel too: the L3 parts elsewhere judge impacts and grouped GEMMs alike.
    rich = StepClock((10, 20, 30), 10.0, onsets=((3, 20),), expert_tokens=((0, 500), (1, 900)))
    moe = JobContext.decode(job_context("j", 1, None, {}, (), rich, False).encode())
    assert context_clock(moe) == rich
    empty = job_context("j", 0, None, {}, (), None, False)
    assert context_topology(empty) is None and context_clock(empty) is None and context_groups(None) == {}


def test_part_totals_round_trip_and_merge_into_the_jobs_rank_aggregate() -> None:
    a = [KernelTotals("gemm", 7, {0: 10.0, 1: 12.0}, {0: 2.0, 1: 2.0}), KernelTotals("ln", 7, {0: 1.0}, {0: 1.0})]
    b = [KernelTotals("gemm", 7, {0: 5.0, 2: 6.0}, {0: 1.0, 2: 1.0})]
    ctx_a = JobContext.decode(totals_context("j", 0, 50, a).encode())
    ctx_b = JobContext.decode(totals_context("j", 1, 70, b).encode())
    assert ctx_a.part == "l3/0" and context_totals(ctx_a) == sorted(a, key=lambda t: (t.kernel, t.stream))
    merged = RankDiagnosis("j")
    merged.add_totals(context_totals(ctx_a), ctx_a.time_ns)
    merged.add_totals(context_totals(ctx_b), ctx_b.time_ns)
    gemm = {(t.kernel, t.stream): t for t in merged.totals()}[("gemm", 7)]
    assert gemm.total_ns == {0: 15.0, 1: 12.0, 2: 6.0} and gemm.calls == {0: 3.0, 1: 2.0, 2: 1.0}
    assert merged.last_time_ns == 70


def test_the_table_keeps_the_newest_per_part_forgets_on_tombstones_and_is_bounded() -> None:
    from argus.core.settings import Settings

    table = ContextTable(Settings(), max_jobs=2)
    job = job_context("a/b", 1, None, {}, (), None, False)  # a job id with a slash
    table._take(context_key("a/b", CONTEXT_JOB_PART), job.encode())
    table._take(context_key("a/b", "l3/3"), totals_context("a/b", 3, 5, []).encode())
    assert set(table.get("a/b")) == {"job", "l3/3"}
    table._take(context_key("a/b", "l3/3"), None)
    assert set(table.get("a/b")) == {"job"}
    table._take(context_key("x", "job"), b"not a context")  # logged, ignored
    for j in ("c", "d"):
        table.put(job_context(j, 1, None, {}, (), None, False))
    assert table.get("a/b") == {} and set(table.get("d")) == {"job"}
