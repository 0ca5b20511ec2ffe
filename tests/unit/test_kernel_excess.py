"""L3 per (rank, kernel): one kernel slower than its rank's speed predicts (argus.detectors.kernel_excess)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from argus.core.errors import DetectorError
from argus.core.kinds import FindingKind
from argus.detectors.kernel_excess import _spread_share, detect_kernel_excess
from argus.detectors.l3_ranks import KernelTotals, RankExcessParams, trimmed_sum
from argus.producers.topology import build_topology
from argus.schemas.records import KernelSummary
from argus.streams.job_context import context_totals, totals_context
from argus.streams.offline import diagnose_traces
from load_tests.kineto_scenarios import Scenario, simulate, topology_flag, write_scenario


def _job(n_ranks: int, seed: int, noise: float = 0.08, kernels: int = 16, calls: int = 300,
         slow: dict[tuple[int, int], float] | None = None, speed: dict[int, float] | None = None,
         merged: tuple[int, ...] = ()) -> list[KernelTotals]:
    """A job's totals: ``kernels`` kernels of ``calls`` calls per rank with per-call noise ``noise``.
    ``slow``: (rank, kernel) -> factor on a third of that kernel's calls (one shape of three);
    ``speed``: rank -> factor on everything it runs. Each rank's median time is its calls' median per
    shape (three shapes per kernel: 1x, 1.2x, 1.4x the kernel's base), or of all its calls for the kernels
    ``merged``."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(kernels):
        base = float(rng.lognormal(np.log(1e5), 0.7))
        t = KernelTotals(f"sm90_xmma_gemm_{k}" if k % 2 else f"vectorized_elementwise_kernel_{k}", 7)
        for r in range(n_ranks):
            shapes = np.repeat([1.0, 1.2, 1.4], calls // 3)
            f = np.where(np.arange(shapes.size) < calls // 3, (slow or {}).get((r, k), 1.0), 1.0)
            d = base * shapes * f * (speed or {}).get(r, 1.0) * np.exp(noise * rng.standard_normal(shapes.size))
            t.total_ns[r], t.calls[r] = float(d.sum()), float(d.size)
            t.median_ns[r] = float(sum(np.median(d[i::3]) * d[i::3].size for i in range(3)))
            if k in merged:  # the KDE made one cluster of the three shapes: one median for all calls
                t.median_ns[r] = float(np.median(d) * d.size)
        out.append(t)
    return out


def test_one_shape_of_one_kernel_slower_on_one_rank_is_named() -> None:
    res = detect_kernel_excess(_job(8, 1, slow={(5, 3): 1.4}))
    assert [(r.kind, r.ranks, r.kernel) for r in res] == [(FindingKind.KERNEL_DEGRADED, (5,), "sm90_xmma_gemm_3")]
    ev = res[0].evidence
    assert ev["kernels_slower"] == 1 and 1.08 < ev["top_kernels_ratio"]["sm90_xmma_gemm_3@7"] < 1.2
    assert res[0].excess_ns > 0 and math.isclose(res[0].excess_ns / 1e6, ev["excess_ms"])


@pytest.mark.parametrize("seed", range(6))
def test_one_shape_slower_in_a_merged_cluster_is_named(seed: int) -> None:
    # The slow shape's calls stay in one cluster with the others: its median moves less than its mean, and
    # held to the multiple-test bound the median total missed it; it corroborates (z >= 2.33) instead.
    totals = _job(64, 20 + seed, noise=0.05, slow={(5, 3): 1.45}, merged=(3,))
    res = detect_kernel_excess(totals)
    assert [(r.ranks, r.kernel) for r in res] == [((5,), "sm90_xmma_gemm_3")]
    ev = res[0].evidence
    assert ev["top_kernels_median_z"]["sm90_xmma_gemm_3@7"] < ev["top_kernels_z"]["sm90_xmma_gemm_3@7"]
    assert detect_kernel_excess(_job(64, 20 + seed, noise=0.05, merged=(3,))) == []


def test_two_ranks_name_the_slower_one() -> None:
    res = detect_kernel_excess(_job(2, 2, noise=0.05, kernels=20, slow={(1, 4): 1.6}))
    assert [(r.ranks, r.kernel) for r in res] == [((1,), "vectorized_elementwise_kernel_4")]


def test_a_rank_slower_in_everything_is_its_speed_not_a_kernel() -> None:
    assert detect_kernel_excess(_job(8, 3, speed={2: 1.12})) == []


def test_healthy_jobs_of_many_sizes_raise_nothing() -> None:
    for seed, n in enumerate((2, 3, 4, 8, 16, 64, 256)):
        assert detect_kernel_excess(_job(n, 10 + seed)) == [], n


def test_outlier_calls_move_only_the_plain_total() -> None:
    totals = _job(8, 4)
    totals[6].total_ns[3] *= 1.3  # a few very long calls: the mean moves, the clusters' medians do not
    assert detect_kernel_excess(totals) == []


def test_a_differently_split_cluster_moves_only_the_median_total() -> None:
    totals = _job(8, 5)
    totals[2].median_ns[4] *= 1.3  # the KDE merged two shapes on one rank: count x p50 grows, the time does not
    assert detect_kernel_excess(totals) == []


def test_a_kernel_slower_on_most_ranks_names_none() -> None:
    assert detect_kernel_excess(_job(8, 6, slow={(r, 1): 1.5 for r in range(5)})) == []


def test_kernels_with_other_work_or_few_calls_are_not_compared() -> None:
    totals = _job(8, 7, slow={(5, 3): 1.5})
    totals[3].calls[0] *= 1.5  # rank 0 runs more of it: not the same work, the kernel is left out
    assert detect_kernel_excess(totals) == []
    assert detect_kernel_excess(_job(8, 7, calls=6, slow={(5, 3): 1.5})) == []  # < kernel_min_calls


def test_ranks_without_median_totals_and_excluded_ranks_are_not_named() -> None:
    totals = _job(8, 8, slow={(5, 3): 1.4})
    assert [r.ranks for r in detect_kernel_excess(totals)] == [(5,)]
    assert detect_kernel_excess(totals, exclude={5}) == []
    del totals[3].median_ns[5]  # a part from a v1 context: its median time is unknown
    assert detect_kernel_excess(totals) == []


def test_ranks_are_compared_within_their_pipeline_stage() -> None:
    topo = build_topology("j", dp=8, pp=2)
    totals = _job(16, 9, slow={(12, 5): 1.5})
    for t in totals[:8]:  # stage 1 runs the first kernels 1.5x longer (other shapes): no rank of it is slow
        for r in range(8, 16):
            t.total_ns[r] *= 1.5
            t.median_ns[r] *= 1.5
    res = detect_kernel_excess(totals, topo)
    assert [(r.ranks, r.evidence["partition"]) for r in res] == [((12,), 1)]


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(2, 24), scale=st.floats(0.01, 100.0),
       per_kernel=st.lists(st.floats(0.2, 5.0), min_size=16, max_size=16))
def test_kernel_and_global_scales_change_nothing_but_the_excess(seed: int, n: int, scale: float,
                                                               per_kernel: list[float]) -> None:
    totals = _job(n, seed, slow={(n - 1, 3): 1.5})
    base = detect_kernel_excess(totals)
    for t, g in zip(totals, per_kernel, strict=True):  # another kernel mix, another GPU: the same verdicts
        t.total_ns = {r: v * g * scale for r, v in t.total_ns.items()}
        t.median_ns = {r: v * g * scale for r, v in t.median_ns.items()}
    again = detect_kernel_excess(totals)
    assert [(r.ranks, r.kernel) for r in again] == [(r.ranks, r.kernel) for r in base]
    for a, b in zip(again, base, strict=True):
        assert math.isclose(a.score, b.score, rel_tol=1e-6, abs_tol=1e-9)


def test_params_are_validated() -> None:
    with pytest.raises(DetectorError):
        RankExcessParams(kernel_min_ratio=0.9)
    with pytest.raises(DetectorError):
        RankExcessParams(kernel_min_kernels=2)


def _summary(rank: int, counts: tuple[int, ...], p50s: tuple[int, ...], sums: tuple[int, ...]) -> KernelSummary:
    k = len(counts)
    return KernelSummary(job_id="j", kernel="gemm", stream=7, rank=(rank,), window_start_ns=(0,),
                         window_end_ns=(10,), n_events=(sum(counts),), n_clusters=(k,), cluster_count=counts,
                         cluster_p50_ns=p50s, cluster_p99_ns=p50s, cluster_min_ns=p50s, cluster_max_ns=p50s,
                         cluster_sum_ns=sums)


def test_totals_keep_the_median_time_and_merge_it_only_while_every_part_knows_it() -> None:
    t = KernelTotals("gemm", 7)
    t.add(_summary(0, (10, 5), (100, 1000), (1100, 6000)))
    t.add(_summary(1, (4,), (50,), (220,)))
    assert t.median_ns == {0: 10 * 100 + 5 * 1000, 1: 200.0} and t.total_ns == {0: 7100.0, 1: 220.0}
    other = KernelTotals("gemm", 7, {0: 100.0, 2: 5.0}, {0: 1.0, 2: 1.0}, {2: 4.0})
    t.merge(other)
    assert t.total_ns == {0: 7200.0, 1: 220.0, 2: 5.0} and t.calls[0] == 16.0
    assert t.median_ns == {1: 200.0, 2: 4.0}  # rank 0's second part had no median time: unknown now
    with pytest.raises(DetectorError):
        t.merge(KernelTotals("other", 7))


def test_median_totals_travel_in_the_job_context() -> None:
    t = KernelTotals("gemm", 7, {0: 10.0, 1: 20.0}, {0: 1.0, 1: 2.0}, {1: 18.0})
    ctx = totals_context("j", 3, 5, [t])
    ctx = type(ctx).decode(ctx.encode())  # through Avro (job_context v2)
    assert math.isnan(ctx.totals_median_ns[0]) and ctx.totals_median_ns[1] == 18.0
    (back,) = context_totals(ctx)
    assert (back.total_ns, back.calls, back.median_ns) == (t.total_ns, t.calls, t.median_ns)
    (old,) = context_totals(totals_context("j", 3, 5, [KernelTotals("gemm", 7, {0: 1.0}, {0: 1.0})]))
    assert old.median_ns == {}


def test_trimmed_sum_counts_the_longest_call_as_the_second_longest() -> None:
    rng = np.random.default_rng(0)
    for n in (2, 4, 10, 24, 101):
        d = np.sort(rng.lognormal(np.log(3e5), 0.1, n).round())
        d[-1] *= 3.6  # a hiccup
        p99, top = float(np.rint(np.quantile(d, 0.99))), float(d[-1])
        want = float(d[:-1].sum() + d[-2])  # the longest call counted as the second longest
        assert math.isclose(trimmed_sum(n, float(d.sum()), p99, top), want, abs_tol=0.5 / (0.01 * (n - 1)) + 1)
    assert trimmed_sum(1, 900.0, 900.0, 900.0) == 900.0 and trimmed_sum(102, 1e4, 150.0, 200.0) == 1e4
    assert trimmed_sum(20, 400.0, 20.0, 20.0) == 400.0  # equal calls: nothing to trim


def _row(rank: int, d: np.ndarray) -> KernelSummary:
    """One rank's calls as one cluster, with its statistics as the compression computes them."""
    q = [int(np.rint(np.quantile(d, x))) for x in (0.5, 0.99)]
    return KernelSummary(job_id="j", kernel="sm90_xmma_gemm_0", stream=7, rank=(rank,), window_start_ns=(0,),
                         window_end_ns=(10,), n_events=(d.size,), n_clusters=(1,), cluster_count=(d.size,),
                         cluster_p50_ns=(q[0],), cluster_p99_ns=(q[1],), cluster_min_ns=(int(d.min()),),
                         cluster_max_ns=(int(d.max()),), cluster_sum_ns=(int(d.sum()),))


def _cluster_job(n_ranks: int, seed: int, per_shape: int, noise: float,
                 kernel0: Callable[[int, np.ndarray], np.ndarray]) -> list[KernelTotals]:
    """Eight kernels of four shapes (0.55, 1, 1.65 and 2.25x a base) of ``per_shape`` calls each, close enough to
    share one cluster, with log-normal noise ``noise`` per call; ``kernel0(rank, durations)`` changes kernel 0's."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(8):
        t = KernelTotals(f"sm90_xmma_gemm_{k}", 7)
        base = float(rng.lognormal(np.log(2e5), 0.5))
        for r in range(n_ranks):
            shapes = np.repeat([0.55, 1.0, 1.65, 2.25], per_shape)
            d = base * shapes * np.exp(noise * rng.standard_normal(shapes.size))
            if k == 0:
                d = kernel0(r, d)
            t.add(dataclasses.replace(_row(r, np.rint(d)), kernel=t.kernel))
        out.append(t)
    return out


def _hiccup_job(n_ranks: int, seed: int, factor: dict[int, float], hiccup: dict[int, float]) -> list[KernelTotals]:
    """24 calls a kernel; ``factor``: rank -> factor on kernel 0's calls; ``hiccup``: rank -> factor on one call
    of kernel 0's second shape (it leaves its shape: the median of the 24, between the second and third shapes,
    moves up to the third)."""
    def kernel0(r: int, d: np.ndarray) -> np.ndarray:
        d = d * factor.get(r, 1.0)
        d[6] *= hiccup.get(r, 1.0)
        return d
    return _cluster_job(n_ranks, seed, 6, 0.04, kernel0)


def test_one_long_call_of_a_kernel_on_one_rank_of_many_is_no_slow_kernel() -> None:
    # 512 ranks: the set's noise in a kernel's mean of 24 calls is under a percent, and one call 4x its usual
    # (a hiccup) moves that rank's total by 5 % and its median by 20 %: no slow kernel. The kernel 1.15x slower
    # in every call is.
    assert detect_kernel_excess(_hiccup_job(512, 1, {}, {122: 4.0})) == []
    res = detect_kernel_excess(_hiccup_job(512, 1, {122: 1.15}, {}))
    assert [(r.ranks, r.kernel) for r in res] == [((122,), "sm90_xmma_gemm_0")]


def _merged_job(n_ranks: int, seed: int, slowed: dict[int, float], hiccups: dict[int, int]) -> list[KernelTotals]:
    """48 calls a kernel (the median lies between the second and third shapes); ``slowed``: rank -> factor on
    kernel 0's longest shape in every call; ``hiccups``: rank -> how many calls of that shape run 4x."""
    def kernel0(r: int, d: np.ndarray) -> np.ndarray:
        d[36:] *= slowed.get(r, 1.0)
        d[36:36 + hiccups.get(r, 0)] *= 4.0
        return d
    return _cluster_job(n_ranks, seed, 12, 0.03, kernel0)


@pytest.mark.parametrize("seed", range(4))
def test_a_shape_slowed_in_every_call_is_named_where_its_clusters_median_does_not_move(seed: int) -> None:
    # Its longest shape x1.5 in all of its 12 calls: the median of the 48 stays between the second and third
    # shapes, so the median total does not corroborate; no few calls can carry the excess, which does.
    totals = _merged_job(64, seed, {5: 1.5}, {})
    res = detect_kernel_excess(totals)
    assert [(r.ranks, r.kernel) for r in res] == [((5,), "sm90_xmma_gemm_0")]
    assert res[0].evidence["top_kernels_median_z"]["sm90_xmma_gemm_0@7"] < 2.0
    assert res[0].evidence["top_kernels_carried_calls"]["sm90_xmma_gemm_0@7"] >= 4.0
    for t in totals:  # without the longest calls known (a context before v5), the median alone corroborates
        t.peak_ns.clear()
    assert detect_kernel_excess(totals) == []


@pytest.mark.parametrize("hiccups", [1, 2, 3])
def test_a_few_long_calls_carry_no_slow_kernel(hiccups: int) -> None:
    # Up to three calls at 4x (the longest counted as the second longest) move the plain total by as much as
    # a slowed shape; three calls carry it, and the median does not move.
    assert detect_kernel_excess(_merged_job(64, 7, {}, {9: hiccups})) == []


def test_the_longest_counted_call_merges_and_travels_in_the_job_context() -> None:
    t = KernelTotals("gemm", 7)
    t.add(_summary(0, (10, 5), (100, 1000), (1100, 6000)))
    assert t.peak_ns == {0: 1000.0}  # the summaries' max is their p50 here: nothing trimmed
    t.merge(KernelTotals("gemm", 7, {0: 1.0, 1: 2.0}, {0: 1.0, 1: 1.0}, {}, {0: 3000.0, 1: 2.0}))
    assert t.peak_ns == {0: 3000.0, 1: 2.0}
    t.merge(KernelTotals("gemm", 7, {1: 1.0}, {1: 1.0}))  # a part that did not know it: unknown now
    assert t.peak_ns == {0: 3000.0}
    ctx = totals_context("j", 3, 5, [t])
    (back,) = context_totals(type(ctx).decode(ctx.encode()))
    assert back.peak_ns == {0: 3000.0}
    assert context_totals(totals_context("j", 3, 5, [KernelTotals("gemm", 7, {0: 1.0}, {0: 1.0})]))[0].peak_ns == {}


def test_a_slowdown_inside_a_merged_cluster_is_spent_in_its_share_of_the_calls() -> None:
    # One shape x1.25 from step 4 of 13: its 16 earlier calls and 36 later ones form one cluster, whose median
    # sits at the slowed level, so at the median every call reads slowed (52 x 0.25), in total 36 x 0.25.
    cols = np.array([True, False])
    assert _spread_share(np.array([36 * 0.25, 5.0]), np.array([52 * 0.25, 1.0]), cols) == pytest.approx(36 / 52)
    # From the start: the total's excess is the median's (or more, a cluster's mean above its median): all.
    assert _spread_share(np.array([13.0, 0.0]), np.array([13.0, 0.0]), cols) == 1.0
    assert _spread_share(np.array([14.0, 0.0]), np.array([13.0, 0.0]), cols) == 1.0
    # Under a half: no median moves with a minority of its calls; the medians moved for another reason.
    assert _spread_share(np.array([2.0, 0.0]), np.array([13.0, 0.0]), cols) == 1.0
    assert _spread_share(np.array([0.0, 0.0]), np.array([0.0, 0.0]), cols) == 1.0


@pytest.mark.slow
def test_a_one_mode_slowdown_without_phases_is_judged_over_the_calls_it_slowed(tmp_path: Path) -> None:
    # The evaluation's scenario that found this (DP64 x PP2, 13 steps, no phase annotations: no onsets from
    # phases): rank 111's fc1 forward GEMM x1.25 from step 4 costs over 1 % of each step from then on, and
    # spread over all 13 steps fell under the impact bar.
    scn = Scenario.from_seed(153195981, "one_mode", 256)
    assert (scn.dp, scn.pp, scn.steps, scn.onset, scn.fault_ranks, scn.annotate_phases) == (64, 2, 13, 4, (111,),
                                                                                            False)
    found = diagnose_traces(write_scenario(scn, tmp_path, simulate(scn)), "mode", topology=topology_flag(scn))
    assert [(f["kind"], f["ranks"]) for f in found] == [("kernel_degraded", [111])]
