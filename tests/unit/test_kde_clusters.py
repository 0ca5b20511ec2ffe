"""Unit and property tests of argus.detectors.kde_clusters (KDE valley clustering of kernel durations)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import gaussian_kde

from argus.core.errors import DetectorError
from argus.detectors import ClusterSet, ClusterSummary, KdeParams, binned_kde, cluster_by_group, cluster_durations

PROPERTY = settings(max_examples=50, deadline=None)


def _lognormal(rng: np.random.Generator, median_ns: float, sigma: float, n: int) -> np.ndarray:
    return np.rint(rng.lognormal(np.log(median_ns), sigma, n)).astype(np.int64)


def _assert_well_formed(cs: ClusterSet, durations: np.ndarray) -> None:
    """Every structural invariant a ClusterSet of ``durations`` must satisfy."""
    x = np.maximum(np.asarray(durations, dtype=np.int64), 1)
    assert len(cs) >= 1
    assert cs.count.sum() == x.size
    assert np.all(cs.count >= 1)
    assert cs.sum_ns.sum() == x.sum()
    assert np.all(cs.min_ns <= cs.p50_ns)
    assert np.all(cs.p50_ns <= cs.p99_ns)
    assert np.all(cs.p99_ns <= cs.max_ns)
    # Disjoint, sorted duration ranges: a value never lands in two clusters.
    assert np.all(cs.max_ns[:-1] < cs.min_ns[1:])
    assert np.all(np.diff(cs.p50_ns) > 0)


def _members(cs: ClusterSet, durations: np.ndarray) -> list[np.ndarray]:
    x = np.sort(np.maximum(np.asarray(durations, dtype=np.int64), 1))
    return [x[(x >= lo) & (x <= hi)] for lo, hi in zip(cs.min_ns, cs.max_ns, strict=True)]


# --- mixtures found and not found -----------------------------------------------------------------


def test_bimodal_gives_two_clusters_near_the_true_medians() -> None:
    rng = np.random.default_rng(7)
    x = np.concatenate([_lognormal(rng, 50_000, 0.1, 2000), _lognormal(rng, 400_000, 0.1, 2000)])
    cs = cluster_durations(x)
    assert len(cs) == 2
    assert cs.count.tolist() == [2000, 2000]
    np.testing.assert_allclose(cs.p50_ns, [50_000, 400_000], rtol=0.02)
    _assert_well_formed(cs, x)


@pytest.mark.parametrize("n", [10, 200, 2000])
def test_unimodal_lognormal_stays_one_cluster(n: int) -> None:
    for seed in range(30):
        rng = np.random.default_rng(1000 + seed)
        for sigma in (0.05, 0.5):
            x = _lognormal(rng, 120_000, sigma, n)
            assert len(cluster_durations(x)) == 1, (seed, sigma)


def test_gemm_at_three_shapes_gives_three_clusters() -> None:
    rng = np.random.default_rng(3)
    parts = [_lognormal(rng, m, 0.04, k) for m, k in ((80_000, 1500), (160_000, 700), (320_000, 300))]
    x = rng.permutation(np.concatenate(parts))
    cs = cluster_durations(x)
    assert cs.count.tolist() == [1500, 700, 300]
    np.testing.assert_allclose(cs.p50_ns, [80_000, 160_000, 320_000], rtol=0.02)
    _assert_well_formed(cs, x)


def test_small_mode_next_to_a_large_one_splits_off() -> None:
    rng = np.random.default_rng(11)
    x = np.concatenate([_lognormal(rng, 50_000, 0.05, 10_000), _lognormal(rng, 400_000, 0.05, 20)])
    assert cluster_durations(x).count.tolist() == [10_000, 20]


def test_max_clusters_keeps_at_most_that_many() -> None:
    rng = np.random.default_rng(5)
    x = np.concatenate([_lognormal(rng, 10_000 * 3**k, 0.03, 200) for k in range(5)])
    assert len(cluster_durations(x)) == 5
    capped = cluster_durations(x, KdeParams(max_clusters=3))
    assert len(capped) == 3
    _assert_well_formed(capped, x)
    assert len(cluster_durations(x, KdeParams(max_clusters=1))) == 1


def test_min_samples_blocks_small_clusters() -> None:
    rng = np.random.default_rng(2)
    x = np.concatenate([_lognormal(rng, 50_000, 0.05, 500), _lognormal(rng, 500_000, 0.05, 8)])
    assert len(cluster_durations(x)) == 2
    assert len(cluster_durations(x, KdeParams(min_samples=9))) == 1


def test_min_log_gap_blocks_close_modes() -> None:
    rng = np.random.default_rng(4)
    x = np.concatenate([_lognormal(rng, 100_000, 0.01, 1000), _lognormal(rng, 150_000, 0.01, 1000)])
    # The valley sits ~0.24 (in ln ns) above the smallest and below the largest sample.
    assert len(cluster_durations(x)) == 2
    assert len(cluster_durations(x, KdeParams(min_log_gap=0.3))) == 1


# --- statistics -----------------------------------------------------------------------------------


def test_statistics_match_numpy_on_each_cluster() -> None:
    rng = np.random.default_rng(9)
    x = np.concatenate([_lognormal(rng, 30_000, 0.2, 777), _lognormal(rng, 900_000, 0.3, 333)])
    cs = cluster_durations(x)
    members = _members(cs, x)
    assert [m.size for m in members] == cs.count.tolist()
    for m, row in zip(members, cs.rows(), strict=True):
        assert row.p50_ns == round(float(np.percentile(m, 50)))
        assert row.p99_ns == round(float(np.percentile(m, 99)))
        assert (row.min_ns, row.max_ns, row.sum_ns) == (m.min(), m.max(), m.sum())


def test_all_equal_is_one_cluster() -> None:
    cs = cluster_durations(np.full(1000, 123_456))
    assert list(cs.rows()) == [ClusterSummary(1000, 123_456, 123_456, 123_456, 123_456, 123_456_000)]


def test_single_sample() -> None:
    cs = cluster_durations([42])
    assert list(cs.rows()) == [ClusterSummary(1, 42, 42, 42, 42, 42)]


def test_non_positive_durations_clamp_to_one_ns() -> None:
    cs = cluster_durations(np.array([0, -5, 3, 0]))
    assert cs.min_ns.tolist() == [1]
    assert cs.sum_ns.tolist() == [6]


def test_float_input_rounds_to_whole_ns() -> None:
    cs = cluster_durations(np.array([1.4, 2.6, 1000.5]))
    assert cs.sum_ns.tolist() == [1 + 3 + 1000]


@pytest.mark.parametrize(
    "bad",
    [
        np.array([], dtype=np.int64),
        np.array([1.0, np.nan]),
        np.array([1.0, np.inf]),
        np.array([[1, 2], [3, 4]]),
        np.array(["1", "2"]),
        np.array([1e30]),
    ],
)
def test_bad_input_raises(bad: np.ndarray) -> None:
    with pytest.raises(DetectorError):
        cluster_durations(bad)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"grid_points": 8},
        {"min_samples": 0},
        {"min_log_gap": -1.0},
        {"min_log_gap": float("nan")},
        {"max_clusters": 0},
        {"min_valley_z": -1.0},
    ],
)
def test_bad_params_raise(kwargs: dict[str, float]) -> None:
    with pytest.raises(DetectorError):
        KdeParams(**kwargs)  # type: ignore[arg-type]


def test_min_bandwidth_is_used() -> None:
    """Two modes x3 apart split, unless the bandwidth floor (2 in ln ns) is wider than their distance."""
    rng = np.random.default_rng(3)
    x = np.concatenate([_lognormal(rng, 1000, 0.05, 500), _lognormal(rng, 3000, 0.05, 500)])
    assert len(cluster_durations(x)) == 2
    assert len(cluster_durations(x, KdeParams(min_bandwidth=2.0))) == 1


@pytest.mark.parametrize("name", ["min_bandwidth", "isolated_gap", "grid_margin"])
@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_bandwidth_floor_gap_or_margin_raises(name: str, bad: float) -> None:
    with pytest.raises(DetectorError, match=name):
        KdeParams(**{name: bad})  # type: ignore[arg-type]


def test_cluster_set_is_read_only_columnar() -> None:
    cs = cluster_durations(np.arange(1, 100))
    assert len(cs) == 1 and cs.total_count == 99
    with pytest.raises(ValueError):
        cs.p50_ns[0] = 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        cs.count = np.array([1])  # type: ignore[misc]
    with pytest.raises(DetectorError):
        ClusterSet([1, 2], [1], [1], [1], [1], [1])


def test_deterministic() -> None:
    rng = np.random.default_rng(21)
    x = np.concatenate([_lognormal(rng, 20_000, 0.3, 3000), _lognormal(rng, 200_000, 0.3, 3000)])
    a, b = cluster_durations(x), cluster_durations(x.copy())
    assert list(a.rows()) == list(b.rows())


# --- the binned KDE -------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
def test_binned_kde_matches_scipy_gaussian_kde(seed: int) -> None:
    rng = np.random.default_rng(seed)
    y = np.log(np.concatenate([_lognormal(rng, 50_000, 0.15, 3000), _lognormal(rng, 300_000, 0.3, 1000)]))
    ref = gaussian_kde(y)  # Scott's rule: the same bandwidth cluster_durations uses
    bandwidth = float(np.sqrt(ref.covariance[0, 0]))
    np.testing.assert_allclose(bandwidth, np.std(y, ddof=1) * y.size ** (-0.2), rtol=1e-12)
    grid, dens = binned_kde(y, bandwidth, 512)
    assert grid[0] == pytest.approx(y.min() - 3 * bandwidth)
    assert grid[-1] == pytest.approx(y.max() + 3 * bandwidth)
    assert binned_kde(y, bandwidth, 512, grid_margin=5.0)[0][0] == pytest.approx(y.min() - 5 * bandwidth)
    exact = ref(grid)
    assert np.max(np.abs(dens - exact)) < 1e-3 * exact.max()
    assert np.trapezoid(dens, grid) == pytest.approx(1.0, abs=1e-4)


def test_binned_kde_rejects_bad_input() -> None:
    with pytest.raises(DetectorError):
        binned_kde([], 0.1)
    with pytest.raises(DetectorError):
        binned_kde([1.0, 2.0], 0.0)
    with pytest.raises(DetectorError):
        binned_kde([1.0, np.nan], 0.1)
    with pytest.raises(DetectorError):
        binned_kde([1.0, 2.0], 0.1, grid_margin=0.0)


# --- many groups at once --------------------------------------------------------------------------


def test_cluster_by_group_equals_per_group_clustering() -> None:
    rng = np.random.default_rng(13)
    groups, durations = [], []
    for gid, n in ((7, 3000), (2, 1), (40, 9), (3, 500), (11, 4000)):
        x = _lognormal(rng, 10_000 * (gid + 1), 0.2, n)
        if gid == 11:  # a two-shape group
            x[: n // 2] *= 6
        groups.append(np.full(n, gid))
        durations.append(x)
    g, d = np.concatenate(groups), np.concatenate(durations)
    perm = rng.permutation(g.size)
    result = cluster_by_group(g[perm], d[perm])
    assert [gid for gid, _ in result] == [2, 3, 7, 11, 40]
    for gid, cs in result:
        expected = cluster_durations(d[g == gid])
        assert list(cs.rows()) == list(expected.rows())
        assert not cs.p50_ns.flags.writeable
    assert len(dict(result)[11]) == 2


def test_cluster_by_group_rejects_bad_input() -> None:
    with pytest.raises(DetectorError):
        cluster_by_group(np.array([1, 2]), np.array([5]))
    with pytest.raises(DetectorError):
        cluster_by_group(np.array([1.0, 2.0]), np.array([5, 6]))
    with pytest.raises(DetectorError):
        cluster_by_group(np.array([], dtype=np.int64), np.array([], dtype=np.int64))


# --- properties -----------------------------------------------------------------------------------

raw_durations = st.lists(st.integers(min_value=-10, max_value=10**10), min_size=1, max_size=300).map(
    lambda v: np.array(v, dtype=np.int64)
)


@st.composite
def mixture_samples(draw: st.DrawFn) -> np.ndarray:
    """Durations drawn from 1-4 log-normal modes, the shape real kernel groups have."""
    seed = draw(st.integers(0, 2**32 - 1))
    modes = draw(
        st.lists(
            st.tuples(st.floats(6.0, 18.0), st.floats(0.005, 0.6), st.integers(1, 400)),
            min_size=1,
            max_size=4,
        )
    )
    rng = np.random.default_rng(seed)
    return np.concatenate([np.rint(np.exp(rng.normal(mu, s, k))).astype(np.int64) for mu, s, k in modes])


@PROPERTY
@given(st.one_of(raw_durations, mixture_samples()))
def test_property_well_formed(x: np.ndarray) -> None:
    cs = cluster_durations(x)
    _assert_well_formed(cs, x)
    assert len(cs) <= KdeParams().max_clusters
    if x.size < 2 * KdeParams().min_samples:
        assert len(cs) == 1
    else:
        assert np.all(cs.count >= KdeParams().min_samples)


@PROPERTY
@given(st.one_of(raw_durations, mixture_samples()), st.randoms(use_true_random=False))
def test_property_input_order_does_not_matter(x: np.ndarray, rnd: object) -> None:
    shuffled = x.copy()
    rnd.shuffle(shuffled)  # type: ignore[attr-defined]
    assert list(cluster_durations(shuffled).rows()) == list(cluster_durations(x).rows())


@PROPERTY
@given(mixture_samples(), st.sampled_from([2, 3, 10, 1000]))
def test_property_scaling_scales_the_percentiles(x: np.ndarray, factor: int) -> None:
    base = cluster_durations(np.maximum(x, 1))
    scaled = cluster_durations(np.maximum(x, 1) * factor)
    # ln(c * d) = ln c + ln d: the KDE just shifts, so the same samples group together.
    assert scaled.count.tolist() == base.count.tolist()
    np.testing.assert_allclose(scaled.p50_ns, base.p50_ns * factor, atol=factor)
    np.testing.assert_allclose(scaled.p99_ns, base.p99_ns * factor, atol=factor)
    np.testing.assert_array_equal(scaled.sum_ns, base.sum_ns * factor)


@PROPERTY
@given(st.lists(mixture_samples(), min_size=1, max_size=5))
def test_property_cluster_by_group_matches_single_groups(parts: list[np.ndarray]) -> None:
    g = np.concatenate([np.full(p.size, i * 3) for i, p in enumerate(parts)])
    d = np.concatenate(parts)
    result = cluster_by_group(g, d)
    assert [gid for gid, _ in result] == [i * 3 for i in range(len(parts))]
    for (_, cs), p in zip(result, parts, strict=True):
        assert list(cs.rows()) == list(cluster_durations(p).rows())


def test_a_stray_call_does_not_merge_two_modes() -> None:
    # One rank's window of a GEMM at two shapes (ms): 18 calls at ~0.5 and 35 at ~1.4-2.3, and one stray
    # call of 10.5. The stray call widened the bandwidth of the whole group enough to merge the modes (x3.4
    # apart) into one cluster, whose modelled spread then put the fast shape's calls at 0.86 ms: a healthy
    # rank's "slow mode" x1.66.
    ms = [0.435, 0.483, 0.488, 0.491, 0.498, 0.504, 0.505, 0.508, 0.512, 0.512, 0.516, 0.519, 0.524, 0.537,
          0.543, 0.571, 0.583, 0.588, 1.37, 1.383, 1.42, 1.435, 1.45, 1.457, 1.501, 1.507, 1.523, 1.535, 1.557,
          1.562, 1.583, 1.596, 1.61, 1.633, 1.672, 1.691, 1.725, 1.796, 1.939, 1.942, 1.948, 1.966, 2.018, 2.03,
          2.054, 2.055, 2.072, 2.075, 2.083, 2.162, 2.199, 2.252, 2.265, 10.483]
    x = np.array(ms) * 1e6
    c = cluster_durations(x)
    assert c.count.tolist() == [18, 36] and c.max_ns[-1] == 10_483_000
    # The stray call stays in its cluster (too few calls for one of its own); without it, the same two.
    assert cluster_durations(x[:-1]).count.tolist() == [18, 35]


def test_modes_near_each_other_split_beside_a_far_one() -> None:
    # A pipeline transfer's calls in one window (us): 12 before a slowdown at ~310, 51 after it at ~670, and
    # 21 calls that waited ~4 ms. The far mode widens the whole group's bandwidth past the valley between the
    # near two; inside the cluster of the near two, with its own bandwidth, that valley shows.
    rng = np.random.default_rng(11)
    x = np.concatenate([rng.normal(311e3, 8e3, 12), rng.normal(670e3, 30e3, 51), rng.normal(4.1e6, 1.5e5, 21)])
    assert cluster_durations(x).count.tolist() == [12, 51, 21]
    # Recursion stays within max_clusters.
    assert cluster_durations(x, KdeParams(max_clusters=2)).count.tolist() == [63, 21]
