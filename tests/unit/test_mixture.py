"""Unit and property tests of argus.detectors.mixture (log-normal mixtures and 1-Wasserstein distances)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import wasserstein_distance

from argus.core.errors import DetectorError
from argus.detectors import (
    Mixture,
    MixtureBatch,
    cluster_durations,
    geometric_grid,
    mixture_cdf,
    w1_distance,
    w1_matrix,
    w1_to_reference,
)
from argus.detectors.mixture import MIN_SIGMA, Z99

PROPERTY = settings(max_examples=50, deadline=None)


def _single(median_ns: float, sigma: float, count: float = 1.0) -> Mixture:
    return Mixture([count], [median_ns], [median_ns * math.exp(sigma * Z99)])


def _sample(m: Mixture, n: int, rng: np.random.Generator) -> np.ndarray:
    mu = np.log(m.p50_ns)
    sigma = np.maximum((np.log(m.p99_ns) - mu) / Z99, MIN_SIGMA)
    k = rng.choice(len(m), size=n, p=m.counts / m.counts.sum())
    return np.exp(rng.normal(mu[k], sigma[k]))


# --- the CDF --------------------------------------------------------------------------------------


def test_cdf_of_one_component_hits_its_percentiles() -> None:
    f = mixture_cdf([10], [50_000], [80_000], [50_000, 80_000])
    np.testing.assert_allclose(f, [0.5, 0.99], atol=1e-12)


def test_cdf_is_a_weighted_sum_of_components() -> None:
    grid = np.geomspace(1e3, 1e7, 200)
    f = mixture_cdf([1, 3], [2e4, 5e5], [3e4, 9e5], grid)
    parts = [mixture_cdf([1], [2e4], [3e4], grid), mixture_cdf([1], [5e5], [9e5], grid)]
    np.testing.assert_allclose(f, 0.25 * parts[0] + 0.75 * parts[1], atol=1e-15)
    assert np.all(np.diff(f) >= 0) and f[0] < 1e-6 and f[-1] > 1 - 1e-6


def test_cdf_batch_rows_match_single_mixtures_and_padding_is_ignored() -> None:
    grid = np.geomspace(1e3, 1e7, 64)
    batch = mixture_cdf([[1, 3], [2, 0]], [[2e4, 5e5], [7e4, 1.0]], [[3e4, 9e5], [9e4, 1.0]], grid)
    np.testing.assert_allclose(batch[0], mixture_cdf([1, 3], [2e4, 5e5], [3e4, 9e5], grid))
    np.testing.assert_allclose(batch[1], mixture_cdf([2], [7e4], [9e4], grid))


def test_cdf_handles_zero_in_the_grid_and_p99_equal_p50() -> None:
    f = mixture_cdf([1], [1000], [1000], [0.0, 990.0, 1000.0, 1010.0])  # sigma floors at 0.1 %
    np.testing.assert_allclose(f, [0.0, 0.0, 0.5, 1.0], atol=1e-12)


@pytest.mark.parametrize(
    ("counts", "p50", "p99", "grid"),
    [
        ([], [], [], [1.0]),
        ([1, 2], [1e3], [2e3], [1.0]),
        ([0], [1e3], [2e3], [1.0]),
        ([-1, 2], [1e3, 1e4], [2e3, 2e4], [1.0]),
        ([1], [0.0], [2e3], [1.0]),
        ([1], [2e3], [1e3], [1.0]),
        ([1], [np.nan], [1e3], [1.0]),
        ([1], [1e3], [2e3], [-1.0]),
        ([1], [1e3], [2e3], [np.nan]),
    ],
)
def test_cdf_rejects_bad_components(
    counts: list[float], p50: list[float], p99: list[float], grid: list[float]
) -> None:
    with pytest.raises(DetectorError):
        mixture_cdf(counts, p50, p99, grid)


# --- W1 ---------------------------------------------------------------------------------------------


def test_w1_of_a_mixture_with_itself_is_zero() -> None:
    a = Mixture([2000, 2000], [5e4, 4e5], [6e4, 5e5])
    assert w1_distance(a, a) == 0.0


def test_w1_of_shifted_lognormals_is_the_mean_difference() -> None:
    # Equal sigma: one CDF lies below the other everywhere, so W1 = E[B] - E[A] exactly.
    sigma = 0.3
    a, b = _single(100_000, sigma), _single(130_000, sigma)
    expected = (130_000 - 100_000) * math.exp(sigma**2 / 2)
    assert w1_distance(a, b) == pytest.approx(expected, rel=1e-4)


def test_w1_of_two_steps_is_their_distance() -> None:
    assert w1_distance(Mixture([5], [1e5], [1e5]), Mixture([1], [3e5], [3e5])) == pytest.approx(2e5, rel=1e-3)


def test_w1_grows_with_tail_growth() -> None:
    base = Mixture([900, 100], [50_000, 400_000], [60_000, 450_000])
    tails = [Mixture(base.counts, base.p50_ns, base.p99_ns * f) for f in (1.0, 1.2, 1.5, 2.0, 3.0)]
    w = [w1_distance(base, t) for t in tails]
    assert w[0] == 0.0
    assert all(lo < hi for lo, hi in itertools.pairwise(w))


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (
            Mixture([2000, 2000], [5e4, 4e5], [6e4, 5e5]),
            Mixture([1000, 3000, 50], [5.5e4, 4e5, 1e6], [8e4, 7e5, 1.2e6]),
        ),
        (Mixture([1], [1e5], [1.3e5]), Mixture([1], [1e5], [3e5])),
    ],
)
def test_w1_matches_monte_carlo(a: Mixture, b: Mixture) -> None:
    rng = np.random.default_rng(12345)
    n = 200_000
    # Four independent estimates halve the Monte Carlo noise to well under 1 %.
    mc = np.mean([wasserstein_distance(_sample(a, n, rng), _sample(b, n, rng)) for _ in range(4)])
    assert w1_distance(a, b) == pytest.approx(mc, rel=0.01)


def test_default_grid_is_fine_enough() -> None:
    a = Mixture([2000, 2000], [5e4, 4e5], [6e4, 5e5])
    b = Mixture([1000, 3000, 50], [5.5e4, 4e5, 1e6], [8e4, 7e5, 1.2e6])
    fine = geometric_grid(a, b, points=100_000)
    assert w1_distance(a, b) == pytest.approx(w1_distance(a, b, grid=fine), rel=1e-4)


def test_geometric_grid_covers_every_component() -> None:
    a, b = _single(1e4, 0.1), _single(1e6, 0.2)
    g = geometric_grid(a, b, points=50)
    assert g.size == 50
    assert g[0] == pytest.approx(1e4 * math.exp(-0.5))
    assert g[-1] == pytest.approx(1e6 * math.exp(1.0))
    np.testing.assert_allclose(np.diff(np.log(g)), np.log(g[1] / g[0]))


def test_w1_rejects_bad_grid() -> None:
    a, b = _single(1e4, 0.1), _single(2e4, 0.1)
    for grid in ([1.0], [3.0, 2.0, 4.0], [[1.0, 2.0]], [1.0, np.inf]):
        with pytest.raises(DetectorError):
            w1_distance(a, b, grid=grid)


# --- many ranks -----------------------------------------------------------------------------------


def _ranks(rng: np.random.Generator, n: int) -> list[Mixture]:
    out = []
    for _ in range(n):
        p50 = rng.uniform(4e4, 6e4) * np.array([1.0, 3.0, 9.0])
        out.append(Mixture(rng.integers(1, 1000, 3), p50, p50 * rng.uniform(1.05, 1.5, 3)))
    return out


def test_w1_matrix_matches_pairwise_distances() -> None:
    ranks = _ranks(np.random.default_rng(0), 12)
    ranks[3] = Mixture([5], [7e4], [9e4])  # a rank with fewer components
    grid = geometric_grid(*ranks)
    m = w1_matrix(ranks, grid=grid)
    assert m.shape == (12, 12)
    np.testing.assert_array_equal(m, m.T)
    np.testing.assert_allclose(np.diag(m), 0.0, atol=1e-9)
    for i in range(12):
        for j in range(12):
            assert m[i, j] == pytest.approx(w1_distance(ranks[i], ranks[j], grid=grid), rel=1e-12, abs=1e-9)
    np.testing.assert_allclose(w1_matrix(MixtureBatch.from_mixtures(ranks), grid=grid), m)


def test_w1_to_reference_with_an_explicit_reference() -> None:
    ranks = _ranks(np.random.default_rng(1), 7)
    ref = _single(1e5, 0.2)
    grid = geometric_grid(*ranks, ref)
    d = w1_to_reference(ranks, ref, grid=grid)
    np.testing.assert_allclose(d, [w1_distance(r, ref, grid=grid) for r in ranks], rtol=1e-12)


def test_w1_to_median_reference_singles_out_the_slow_rank() -> None:
    healthy = Mixture([900, 100], [50_000, 400_000], [60_000, 450_000])
    slow = Mixture([900, 100], [65_000, 400_000], [90_000, 450_000])
    ranks = [healthy] * 9 + [slow]
    d = w1_to_reference(ranks)
    assert d.shape == (10,)
    np.testing.assert_allclose(d[:9], 0.0, atol=1e-9)
    assert d[9] == pytest.approx(w1_distance(healthy, slow), rel=1e-6)


def test_batch_from_long_packs_and_pads() -> None:
    batch = MixtureBatch.from_long(
        [2, 0, 2, 1, 2], [1, 2, 3, 4, 5], [10, 20, 30, 40, 50], [11, 21, 31, 41, 51]
    )
    assert len(batch) == 3 and batch.counts.shape == (3, 3)
    np.testing.assert_array_equal(batch.counts, [[2, 0, 0], [4, 0, 0], [1, 3, 5]])
    np.testing.assert_array_equal(batch.p50_ns[2], [10, 30, 50])
    with pytest.raises(DetectorError):
        MixtureBatch.from_long([0, 2], [1, 1], [10, 10], [11, 11])  # mixture 1 has no components
    with pytest.raises(DetectorError):
        MixtureBatch.from_long([0, 3], [1, 1], [10, 10], [11, 11], n_owners=2)
    with pytest.raises(DetectorError):
        MixtureBatch.from_mixtures([])


def test_mixture_from_clusters() -> None:
    rng = np.random.default_rng(8)
    x = np.concatenate([rng.lognormal(np.log(5e4), 0.1, 2000), rng.lognormal(np.log(4e5), 0.1, 2000)])
    cs = cluster_durations(x)
    m = Mixture.from_clusters(cs)
    np.testing.assert_array_equal(m.counts, cs.count)
    np.testing.assert_array_equal(m.p99_ns, cs.p99_ns)
    # The rebuilt mixture stays close to the raw sample it summarises (well under 1 % of the mean).
    assert wasserstein_distance(x, _sample(m, 200_000, rng)) < 0.01 * x.mean()


# --- properties -----------------------------------------------------------------------------------


@st.composite
def mixtures(draw: st.DrawFn) -> Mixture:
    k = draw(st.integers(1, 4))
    counts = draw(st.lists(st.integers(1, 10_000), min_size=k, max_size=k))
    log_p50 = np.array(draw(st.lists(st.floats(6.0, 16.0), min_size=k, max_size=k)))
    sigma = np.array(draw(st.lists(st.floats(0.0, 1.0), min_size=k, max_size=k)))
    p50 = np.exp(log_p50)
    return Mixture(counts, p50, p50 * np.exp(sigma * Z99))


@PROPERTY
@given(mixtures(), mixtures())
def test_property_symmetric_and_non_negative(a: Mixture, b: Mixture) -> None:
    ab, ba = w1_distance(a, b), w1_distance(b, a)
    assert ab >= 0.0
    assert ab == pytest.approx(ba, rel=1e-12, abs=1e-9)


@PROPERTY
@given(mixtures(), mixtures(), mixtures())
def test_property_triangle_inequality(a: Mixture, b: Mixture, c: Mixture) -> None:
    grid = geometric_grid(a, b, c)
    ac = w1_distance(a, c, grid=grid)
    assert ac <= w1_distance(a, b, grid=grid) + w1_distance(b, c, grid=grid) + 1e-9 * max(ac, 1.0)


@PROPERTY
@given(mixtures(), st.floats(1.01, 100.0))
def test_property_scaling_durations_scales_w1(a: Mixture, factor: float) -> None:
    b = Mixture(a.counts, a.p50_ns * 1.3, a.p99_ns * 1.3)
    scaled = w1_distance(
        Mixture(a.counts, a.p50_ns * factor, a.p99_ns * factor),
        Mixture(b.counts, b.p50_ns * factor, b.p99_ns * factor),
    )
    assert scaled == pytest.approx(factor * w1_distance(a, b), rel=1e-6)


@PROPERTY
@given(st.lists(mixtures(), min_size=2, max_size=6))
def test_property_reference_and_matrix_agree(ms: list[Mixture]) -> None:
    grid = geometric_grid(*ms)
    m = w1_matrix(ms, grid=grid)
    to_first = w1_to_reference(ms, ms[0], grid=grid)
    np.testing.assert_allclose(to_first, m[0], rtol=1e-9, atol=1e-6)
