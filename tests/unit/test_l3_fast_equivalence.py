"""The vectorized L3 core (issue 10) against straightforward re-statements of the algorithms it replaced.

Each reference below is the earlier implementation written plainly: a dense CDF (every component on every
grid point), counting each level over a whole row, a per-group loop of leave-one-out medians, per-summary
array building, a median recomputed where it is used. Unit tests compare the parts; the end-to-end tests
run :func:`detect_l3` once as it is and once with every part replaced by its reference, and need the same
findings: kinds, ranks, kernels and evidence keys equal, numbers equal to 1e-9 relative.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.special import ndtr

from argus.core.errors import DetectorError
from argus.detectors import cdf_grid, kernel_rows, l3_kernels, mixture
from argus.detectors.kernel_modes import mode_quantiles
from argus.detectors.l2_groups import loo_median, loo_median_rows
from argus.detectors.l3_kernels import L3Params, L3Result, RankScores, Scope, detect_l3, primary_p50
from argus.detectors.mixture import MixtureBatch, geometric_grid
from argus.producers.topology import build_topology
from argus.schemas.records import JobTopology, KernelSummary, ParallelGroup

PROPERTY = settings(max_examples=60, deadline=None)
GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n"
AR = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL"
SR = "ncclDevKernel_SendRecv"
RTOL = 1e-9
#: The compiled CDF against scipy's dense ndtr (a few ulps of 1.0).
CDF_ATOL = 4e-15


# -- references: the replaced algorithms, plainly -----------------------------------------------------------


def ref_cdfs(counts: np.ndarray, p50_ns: np.ndarray, p99_ns: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Every component's weight * ndtr(z) on every grid point, summed in component order."""
    mu = np.log(p50_ns)
    sigma = np.maximum((np.log(p99_ns) - mu) / mixture.Z99, mixture.MIN_SIGMA)
    weight = counts / counts.sum(axis=-1, keepdims=True)
    log_grid = np.log(np.maximum(grid, np.finfo(np.float64).tiny))
    out = np.zeros((*counts.shape[:-1], grid.size))
    for k in range(counts.shape[-1]):
        out += weight[..., k, None] * ndtr((log_grid - mu[..., k, None]) / sigma[..., k, None])
    return out


def ref_mode_quantiles(cdf: np.ndarray, grid: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """Level by level: the count of each row's values below it, the grid cell above, log-linear inside."""
    lg = np.log(grid)
    rows = np.arange(cdf.shape[0])
    out = np.empty((cdf.shape[0], levels.size))
    for j, q in enumerate(np.asarray(levels, dtype=np.float64).tolist()):
        hi = np.clip((cdf < q).sum(axis=1), 1, lg.size - 1)
        c0, c1 = cdf[rows, hi - 1], cdf[rows, hi]
        t = np.clip((q - c0) / np.maximum(c1 - c0, 1e-12), 0.0, 1.0)
        out[:, j] = np.exp(lg[hi - 1] + t * (lg[hi] - lg[hi - 1]))
    return out


def ref_loo_median(values: np.ndarray) -> np.ndarray:
    v = np.asarray(values, dtype=np.float64)
    if v.size < 2:
        return np.full(v.size, np.nan)
    return np.array([np.median(np.delete(v, i)) for i in range(v.size)])


def ref_score_ranks(mixtures: MixtureBatch, grid_points: int = 512, mode_log_gap: float = 0.3,
                    levels: l3_kernels.Levels | None = None) -> RankScores:
    grid = geometric_grid(mixtures, points=grid_points)
    cdf = ref_cdfs(mixtures.counts, mixtures.p50_ns, mixtures.p99_ns, grid)
    ref = np.median(cdf, axis=0)
    step = np.diff(grid)
    w = np.zeros(grid.size)
    w[:-1] += 0.5 * step
    w[1:] += 0.5 * step
    w1 = np.abs(cdf - ref) @ w
    shift = (ref - cdf) @ w
    ref_mean = float(grid[0] + (1.0 - ref) @ w)
    lv = np.empty(0) if levels is None else levels(ref, grid)
    return RankScores(w1, shift, w1 / ref_mean, primary_p50(mixtures, mode_log_gap), ref_mean, grid, w, ref,
                      lv, ref_mode_quantiles(cdf, grid, lv))


def ref_merge(summaries: list[KernelSummary] | kernel_rows.SummaryColumns,
              min_events: int) -> tuple[np.ndarray, MixtureBatch | None, np.ndarray]:
    """Each rank's clusters with calls, in order of appearance; ranks with ``min_events`` calls, ascending."""
    if isinstance(summaries, kernel_rows.SummaryColumns):  # as detect_l3 hands them over
        summaries = list(summaries.summaries)
    per_rank: dict[int, list[tuple[float, float, float, float]]] = {}
    for s in summaries:
        at = 0
        for rank, k in zip(s.rank, s.n_clusters, strict=True):
            for i in range(at, at + k):
                if s.cluster_count[i] > 0:
                    p50 = max(float(s.cluster_p50_ns[i]), 1.0)
                    p99, calls = max(float(s.cluster_p99_ns[i]), p50), float(s.cluster_count[i])
                    per_rank.setdefault(rank, []).append((calls, p50, p99, float(s.cluster_sum_ns[i])))
            at += k
    kept = [r for r in sorted(per_rank) if sum(c[0] for c in per_rank[r]) >= min_events]
    if not kept:
        return np.empty(0, dtype=np.int64), None, np.empty(0)
    owner = np.array([i for i, r in enumerate(kept) for _ in per_rank[r]])
    comps = np.array([c for r in kept for c in per_rank[r]])
    batch = MixtureBatch.from_long(owner, comps[:, 0], comps[:, 1], comps[:, 2], n_owners=len(kept))
    return np.array(kept, dtype=np.int64), batch, np.array([sum(c[3] for c in per_rank[r]) for r in kept])


def ref_late_candidates(groups: list[tuple[str, int, np.ndarray]], p50: np.ndarray, late_ratio: float = 2.0
                        ) -> list[Any]:
    out = []
    for kind, g, rows in groups:
        if int(np.sum(late_ratio * p50[rows] <= np.median(p50[rows]))) > max(1, rows.size // 4):
            continue
        peers = ref_loo_median(p50[rows])
        ratio = peers / p50[rows]
        out += [(float(ratio[i]), kind, g, int(rows[i]), rows, float(peers[i]))
                for i in np.flatnonzero(ratio >= late_ratio).tolist()]
    out.sort(key=lambda c: (-c[0], c[3]))
    return out


# -- inputs -------------------------------------------------------------------------------------------------


def _mixtures(rng: np.random.Generator, rows: int, k: int) -> MixtureBatch:
    """Rows of ``k`` components, some padded (zero counts), p99 == p50 at times, spreads from 1e-4 to 3 in
    ln(ns), medians from 1 ns to 1e9 ns."""
    counts = rng.integers(0, 1000, (rows, k)).astype(np.float64)
    counts[:, 0] += 1.0
    if rng.random() < 0.3:
        counts[rng.random((rows, k)) < 0.3] = 0.0
        counts[:, 0] = np.maximum(counts[:, 0], 1.0)
    centre = rng.uniform(0.0, 20.0)
    p50 = np.exp(rng.normal(centre, rng.choice([0.01, 0.5, 2.0]), (rows, k)))
    spread = rng.choice([1e-4, 0.05, 0.5, 3.0], (rows, k))
    p99 = p50 * np.exp(np.abs(rng.normal(0.0, spread)))
    same = rng.random((rows, k)) < 0.1
    p99[same] = p50[same]  # p99 == p50: the floor of sigma
    return MixtureBatch(counts, p50, np.maximum(p99, p50))


def _rows(rng: np.random.Generator, n: int, modes: list[tuple[int, float]], scale: dict[int, float],
          jitter: float, windows: int) -> list[tuple[int, list[tuple[int, float, float]]]]:
    """Per rank, one window's clusters of ``modes`` (calls, p50 ns), scaled per rank, over ``windows`` windows."""
    out = []
    for w in range(windows):
        for r in range(n):
            speed = scale.get(r, 1.0) * math.exp(jitter * rng.standard_normal())
            comps = [(calls, p50 * speed * math.exp(0.004 * rng.standard_normal()),
                      p50 * speed * math.exp(abs(rng.normal(0.12, 0.03)))) for calls, p50 in modes]
            if w and rng.random() < 0.2:
                comps = comps[:1]  # a window holding one mode only: rows with fewer components pad
            out.append((r, comps))
    return out


def _summaries(rows: list[tuple[int, list[tuple[int, float, float]]]], kernel: str, per_record: int
               ) -> list[KernelSummary]:
    out = []
    for at in range(0, len(rows), per_record):
        part = rows[at:at + per_record]
        comps = [c for _, cs in part for c in cs]
        count = tuple(int(c[0]) for c in comps)
        p50 = tuple(max(1, round(c[1])) for c in comps)
        p99 = tuple(max(1, round(c[2])) for c in comps)
        out.append(KernelSummary(
            job_id="j", kernel=kernel, stream=7, rank=tuple(r for r, _ in part),
            window_start_ns=tuple(0 for _ in part), window_end_ns=tuple(10 for _ in part),
            n_events=tuple(sum(c[0] for c in cs) for _, cs in part), n_clusters=tuple(len(cs) for _, cs in part),
            cluster_count=count, cluster_p50_ns=p50, cluster_p99_ns=p99, cluster_min_ns=p50, cluster_max_ns=p99,
            cluster_sum_ns=tuple(c * m for c, m in zip(count, p50, strict=True))))
    return out


def _job(seed: int) -> tuple[list[KernelSummary], JobTopology | None, L3Params, ParallelGroup | None]:
    """A random (kernel, window set, topology, faults) case."""
    rng = np.random.default_rng(seed)
    dp, tp, pp = (int(x) for x in rng.choice([1, 2, 4, 8], 3))
    dp = max(dp, 2)
    topo = build_topology("j", dp, tp, pp)
    n = topo.world_size
    kernel = str(rng.choice([GEMM, AR, SR]))
    n_modes = int(rng.integers(1, 4))
    modes = [(int(rng.integers(5, 500)), float(rng.uniform(5e3, 5e6))) for _ in range(n_modes)]
    scale: dict[int, float] = {}
    for _ in range(int(rng.integers(0, 3))):
        fault = int(rng.integers(0, 3))
        r = int(rng.integers(0, n))
        if fault == 0:  # a slow rank
            scale[r] = float(rng.uniform(1.1, 3.0))
        elif fault == 1:  # a late arrival: short itself, its TP (or DP) peers long
            col = topo.tp_group if tp > 1 else topo.dp_group
            for peer in range(n):
                if col[peer] == col[r]:
                    scale[peer] = 6.0
            scale[r] = 1 / 1.3
        else:  # a degraded group (link)
            for peer in range(n):
                if topo.dp_group[peer] == topo.dp_group[r]:
                    scale[peer] = float(rng.uniform(1.3, 3.0))
    rows = _rows(rng, n, modes, scale, float(rng.choice([0.0, 0.01, 0.05])), int(rng.integers(1, 3)))
    if rng.random() < 0.2:
        rows = [(r, [(int(rng.integers(1, 12)), c[1], c[2]) for c in cs]) for r, cs in rows]  # few events
    summaries = _summaries(rows, kernel, int(rng.choice([1, 7, len(rows)])))
    params = L3Params(compute_scope=Scope.JOB) if rng.random() < 0.2 else L3Params()
    group_kind = None if rng.random() < 0.7 else ParallelGroup(str(rng.choice(["DP", "TP", "PP"])))
    return summaries, (topo if rng.random() < 0.85 else None), params, group_kind


def same_values(a: Any, b: Any, path: str = "", abs_tol: float = 1e-300) -> None:
    """Equal structure, equal non-float leaves, floats equal to RTOL (relative to the larger) or ``abs_tol``."""
    if isinstance(a, float) or isinstance(b, float):
        assert isinstance(a, (float, int)) and isinstance(b, (float, int)), path
        if math.isnan(a) or math.isnan(b):
            assert math.isnan(a) and math.isnan(b), path
        else:
            assert a == pytest.approx(b, rel=RTOL, abs=abs_tol), (path, a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for k in a:
            same_values(a[k], b[k], f"{path}.{k}", abs_tol)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same_values(x, y, f"{path}[{i}]", abs_tol)
    else:
        assert a == b, (path, a, b)


def _same_results(fast: list[L3Result], slow: list[L3Result]) -> None:
    assert [(r.kind, r.ranks, r.kernel, r.stream) for r in fast] == [(r.kind, r.ranks, r.kernel, r.stream)
                                                                     for r in slow]
    for f, s in zip(fast, slow, strict=True):
        same_values(f.score, s.score, "score")
        same_values(f.excess_ns, s.excess_ns, "excess_ns")
        same_values(f.evidence, s.evidence, "evidence")


# -- the parts ----------------------------------------------------------------------------------------------


@PROPERTY
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 300), k=st.integers(1, 5),
       points=st.sampled_from([2, 15, 16, 17, 64, 512]))
def test_cdfs_match_the_dense_evaluation(seed: int, rows: int, k: int, points: int) -> None:
    rng = np.random.default_rng(seed)
    b = _mixtures(rng, rows, k)
    grid = geometric_grid(b, points=points)
    fast, dense = mixture._cdfs(b.counts, b.p50_ns, b.p99_ns, grid), ref_cdfs(b.counts, b.p50_ns, b.p99_ns, grid)
    # The compiled kernel interpolates ndtr from a table (cubic Hermite, 1/1024 steps of z): within a few
    # ulps of 1.0 of the dense values, and every row nondecreasing as a CDF is.
    assert np.max(np.abs(fast - dense), initial=0.0) <= CDF_ATOL
    assert np.all(np.diff(fast, axis=-1) >= 0.0)


def test_cdfs_of_one_mixture_unsorted_grids_and_zero() -> None:
    rng = np.random.default_rng(5)
    b = _mixtures(rng, 1, 3)
    for grid in (np.geomspace(1.0, 1e10, 100), np.geomspace(1.0, 1e10, 100)[::-1], np.array([0.0, 1.0, 5e3, 1e12]),
                 np.linspace(0.0, 1e7, 40)):
        one = mixture._cdfs(b.counts[0], b.p50_ns[0], b.p99_ns[0], grid)
        dense = ref_cdfs(b.counts[0], b.p50_ns[0], b.p99_ns[0], grid)
        assert one.shape == (grid.size,)
        assert np.allclose(one, dense, rtol=0, atol=CDF_ATOL)


@PROPERTY
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 60), g=st.integers(2, 130), n_levels=st.integers(1, 25))
def test_quantiles_match_a_whole_row_count(seed: int, rows: int, g: int, n_levels: int) -> None:
    rng = np.random.default_rng(seed)
    kind = rng.integers(0, 3)
    if kind == 0:  # CDF-like: sorted, with ties and plateaus at levels
        c = np.sort(rng.choice([0.0, 0.1, 0.25, 0.5, 0.6, 1.0], (rows, g)), axis=1)
    elif kind == 1:
        c = np.sort(rng.random((rows, g)), axis=1)
    else:  # some rows out of order (rounding): counted in full
        c = np.sort(rng.random((rows, g)), axis=1)
        bad = rng.random(rows) < 0.5
        c[bad] = rng.random((int(bad.sum()), g))
    levels = np.concatenate([rng.choice([0.0, 0.1, 0.25, 0.5, 0.6, 0.9, 1.0, 1.5], n_levels), rng.random(3)])
    grid = np.geomspace(1e3, 1e3 * (1.0 + rng.random() * 10.0), g) if g > 1 else np.array([1e3])
    for layout in (c, np.asfortranarray(c)):  # row-major or grid-major storage
        np.testing.assert_allclose(mode_quantiles(layout, grid, levels), ref_mode_quantiles(c, grid, levels),
                                   rtol=1e-15, atol=0)


def test_mode_quantiles_match_on_real_cdfs() -> None:
    rng = np.random.default_rng(11)
    for _ in range(30):
        b = _mixtures(rng, int(rng.integers(1, 200)), int(rng.integers(1, 4)))
        grid = geometric_grid(b, points=int(rng.choice([16, 100, 512])))
        cdf = ref_cdfs(b.counts, b.p50_ns, b.p99_ns, grid)
        levels = np.concatenate([rng.random(5), np.arange(0.1, 0.9 + 1e-9, 0.05), [0.9, 0.0, 1.0]])
        np.testing.assert_allclose(mode_quantiles(cdf, grid, levels), ref_mode_quantiles(cdf, grid, levels),
                                   rtol=1e-15, atol=0)


def test_pointwise_median_and_the_one_pass_scores_match_numpy() -> None:
    rng = np.random.default_rng(12)
    for rows in (1, 2, 3, 64, 65, 1025, 1026, 3000):
        b = _mixtures(rng, rows, int(rng.integers(1, 4)))
        grid = geometric_grid(b, points=128)
        cdf = mixture._cdfs(b.counts, b.p50_ns, b.p99_ns, grid)
        pick = cdf_grid.median_sample(rows)
        assert pick.size == min(rows, cdf_grid.MEDIAN_SAMPLE) and np.all(np.diff(pick) > 0)
        assert np.array_equal(pick, cdf_grid.median_sample(rows))  # one input, one sample
        ref = cdf_grid.pointwise_median(cdf[pick])
        assert np.array_equal(ref, np.median(cdf[pick], axis=0))
        w = rng.random(grid.size)
        levels = np.concatenate([rng.random(4), [0.0, 0.5, 1.0]])
        parts = mixture.log_normal_components(b.counts, b.p50_ns, b.p99_ns)
        w1, shift, q = cdf_grid.score_against(*parts, np.log(grid), ref, w, levels)
        np.testing.assert_allclose(w1, np.abs(ref - cdf) @ w, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(shift, (ref - cdf) @ w, rtol=1e-12, atol=1e-12)
        assert np.array_equal(q, mode_quantiles(cdf, grid, levels))
    with pytest.raises(DetectorError, match="increasing grid"):
        cdf_grid.score_against(*parts, np.log(grid[::-1]), ref, w, levels)


@PROPERTY
@given(values=st.lists(st.lists(st.sampled_from([0.0, 1.0, 2.5, 3.0, 1e9, -4.0]) | st.floats(-1e6, 1e6),
                                min_size=0, max_size=12), min_size=1, max_size=6))
def test_loo_median_rows_match_deleting_each_entry(values: list[list[float]]) -> None:
    width = len(values[0])
    rows = np.array([(v + values[0])[:width] for v in values], dtype=np.float64).reshape(len(values), width)
    got = loo_median_rows(rows)
    for i in range(rows.shape[0]):
        want = ref_loo_median(rows[i])
        assert np.array_equal(got[i], want, equal_nan=True)
        assert np.array_equal(loo_median(rows[i]), want, equal_nan=True)


@PROPERTY
@given(seed=st.integers(0, 2**32 - 1))
def test_late_candidates_match_the_per_group_loop(seed: int) -> None:
    rng = np.random.default_rng(seed)
    size, n_groups = int(rng.integers(2, 10)), int(rng.integers(1, 12))
    p50 = np.exp(rng.normal(10.0, 0.05, size * n_groups + 5))
    p50[rng.random(p50.size) < 0.15] /= rng.choice([1.5, 2.0, 3.0, 8.0])  # some short, ties at exactly 2x
    perm = rng.permutation(p50.size)
    groups = [(str(rng.choice(["DP", "TP"])), int(i), perm[i * size:(i + 1) * size]) for i in range(n_groups)]
    fast, want = l3_kernels._late_candidates(groups, p50, 2.0), ref_late_candidates(groups, p50)
    assert [(c[0], c[1], c[2], c[3], c[5]) for c in fast] == [(c[0], c[1], c[2], c[3], c[5]) for c in want]
    assert all(f[4] is w[4] for f, w in zip(fast, want, strict=True))
    assert l3_kernels._late_candidates([], p50, 2.0) == []


@PROPERTY
@given(seed=st.integers(0, 2**32 - 1))
def test_merge_matches_per_summary_arrays(seed: int) -> None:
    summaries, _, _, _ = _job(seed)
    ranks, batch, total = kernel_rows.merge_rows(summaries, 10)
    want_ranks, want_batch, want_total = ref_merge(summaries, 10)
    assert np.array_equal(ranks, want_ranks) and np.array_equal(total, want_total)
    assert (batch is None) == (want_batch is None)
    if batch is not None and want_batch is not None:
        for f in ("counts", "p50_ns", "p99_ns"):
            assert np.array_equal(getattr(batch, f), getattr(want_batch, f))


@PROPERTY
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 120), k=st.integers(1, 4))
def test_score_ranks_match(seed: int, rows: int, k: int) -> None:
    b = _mixtures(np.random.default_rng(seed), rows, k)
    fast, want = l3_kernels.score_ranks(b), ref_score_ranks(b)
    scale = want.reference_mean_ns
    span = float(want.grid[-1] - want.grid[0])
    atol = 1e-12 * scale + 8 * CDF_ATOL * span  # the CDFs' last-bits error, integrated over the grid's span
    for f in ("w1_ns", "shift_ns"):
        np.testing.assert_allclose(getattr(fast, f), getattr(want, f), rtol=RTOL, atol=atol)
    np.testing.assert_allclose(fast.score, want.score, rtol=RTOL, atol=1e-12 + 8 * CDF_ATOL * span / scale)
    assert fast.reference_mean_ns == pytest.approx(scale, rel=1e-12, abs=8 * CDF_ATOL * span)
    np.testing.assert_allclose(fast.reference, want.reference, rtol=0, atol=CDF_ATOL)
    assert np.array_equal(fast.primary_p50_ns, want.primary_p50_ns) and np.array_equal(fast.grid, want.grid)


# -- end to end ---------------------------------------------------------------------------------------------


def _both(summaries: list[KernelSummary], topo: JobTopology | None, params: L3Params,
          group_kind: ParallelGroup | None, monkeypatch: pytest.MonkeyPatch) -> tuple[list[L3Result], list[L3Result]]:
    fast = detect_l3(summaries, topo, params, group_kind)
    with monkeypatch.context() as m:
        m.setattr(mixture, "_cdfs", ref_cdfs)
        m.setattr(l3_kernels, "score_ranks", ref_score_ranks)
        m.setattr(l3_kernels, "merge_rows", ref_merge)
        m.setattr(l3_kernels, "_late_candidates", ref_late_candidates)
        slow = detect_l3(summaries, topo, params, group_kind)
    return fast, slow


@pytest.mark.parametrize("seed", range(120))
def test_detect_l3_finds_the_same_as_the_reference(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    fast, slow = _both(*_job(seed), monkeypatch=monkeypatch)
    _same_results(fast, slow)


@pytest.mark.slow
def test_detect_l3_cases_with_findings_are_covered(monkeypatch: pytest.MonkeyPatch) -> None:
    """The random cases above include findings of every kind (else they would compare empty lists)."""
    kinds = set()
    for seed in range(120):
        fast, _ = _both(*_job(seed), monkeypatch=monkeypatch)
        kinds |= {r.kind for r in fast}
    assert {l3_kernels.FindingKind.KERNEL_DEGRADED, l3_kernels.FindingKind.LINK_DEGRADED,
            l3_kernels.FindingKind.LATE_ARRIVAL} <= kinds


def test_detect_l3_edge_cases(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(3)
    topo = build_topology("j", 4, 2, 2)
    one_rank = _summaries(_rows(rng, 1, [(100, 1e5)], {}, 0.01, 1), GEMM, 1)
    one_cluster = _summaries(_rows(rng, 16, [(100, 1e5)], {3: 2.0}, 0.01, 1), GEMM, 16)
    identical = _summaries([(r, [(100, 1e5, 1.1e5), (50, 3e5, 3.3e5)]) for r in range(16)], AR, 16)
    ties = _summaries([(r, [(100, 1e5 * (2.0 if r == 5 else 1.0), 1.1e5)]) for r in range(16)], GEMM, 4)
    extremes = _summaries([(r, [(100, 1.0, 1.0), (100, 1e11 * (1 + r / 100), 3e11)]) for r in range(16)], GEMM, 16)
    for case in (one_rank, one_cluster, identical, ties, extremes):
        for t in (topo, None):
            _same_results(*_both(case, t, L3Params(), None, monkeypatch))
    assert detect_l3([]) == []


def test_window_end_key_and_bad_rows_as_record_by_record() -> None:
    rng = np.random.default_rng(8)
    for _ in range(40):
        summaries, _, _, _ = _job(int(rng.integers(0, 2**31)))
        rows = [SimpleNamespace(**{f: getattr(s, f) for f in _FIELDS}) for s in summaries]
        for r in rows:
            if rng.random() < 0.1:  # a record without rows
                r.window_end_ns, r.rank, r.n_clusters = (), (), ()
                r.cluster_count = r.cluster_p50_ns = r.cluster_p99_ns = r.cluster_sum_ns = ()
        assert kernel_rows.window_end(rows) == max(max(s.window_end_ns, default=0) for s in rows)  # type: ignore
        assert kernel_rows.one_key(rows)  # type: ignore[arg-type]
        if rng.random() < 0.5:
            bad = int(rng.integers(0, len(rows)))
            rows[bad].n_clusters = (*rows[bad].n_clusters, 1)
            if rng.random() < 0.5:
                rows[bad].rank = (*rows[bad].rank, 0)
            first_bad = next(r for r in rows if len(r.n_clusters) != len(r.rank)
                             or sum(r.n_clusters) != len(r.cluster_count))
            first_bad.job_id = "bad"
            with pytest.raises(DetectorError, match="kernel summary bad/"):
                kernel_rows.merge_rows(rows, 10)  # type: ignore[arg-type]
        rows[0].stream = -5
        assert not kernel_rows.one_key(rows) or len(rows) == 1  # type: ignore[arg-type]


_FIELDS = ("job_id", "kernel", "stream", "rank", "window_end_ns", "n_clusters", "cluster_count", "cluster_p50_ns",
           "cluster_p99_ns", "cluster_sum_ns")
