"""L1: iteration-time spikes and step regressions (argus.detectors.l1_iteration)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from argus.core.errors import DetectorError
from argus.core.kinds import FindingKind
from argus.detectors import IterationSeries, L1Params, detect_l1
from argus.schemas.records import Level, Step

PROPERTY = settings(max_examples=60, deadline=None)
BASE_NS = 200e6


def _noise(n: int, sigma: float, seed: int) -> np.ndarray:
    return BASE_NS * np.exp(sigma * np.random.default_rng(seed).standard_normal(n))


def _kinds(results: list) -> list[FindingKind]:
    return [r.kind for r in results]


# -- healthy series -----------------------------------------------------------------------------------


@PROPERTY
@given(n=st.integers(1, 300), sigma=st.floats(0.0, 0.01), seed=st.integers(0, 2**31))
def test_flat_noise_gives_nothing(n: int, sigma: float, seed: int) -> None:
    # Up to 1 % noise is silent for every seed (the 4 % effect gate is >= 6 standard errors away); noisier
    # healthy series are silent up to the calibrated false-alarm rate (test_l1_power.py).
    wall = _noise(n, sigma, seed)
    assert detect_l1(np.arange(n), wall, wall * 0.98) == []


def test_constant_series_gives_nothing() -> None:
    assert detect_l1(np.arange(50), np.full(50, 1e8)) == []


# -- spikes ------------------------------------------------------------------------------------------


@PROPERTY
@given(n=st.integers(20, 120), pos_frac=st.floats(0.0, 1.0), factor=st.floats(2.3, 50.0),
       seed=st.integers(0, 2**31), gpu_spikes=st.booleans())
def test_single_spike_found_exactly(n: int, pos_frac: float, factor: float, seed: int, gpu_spikes: bool) -> None:
    p = L1Params()
    lo, hi = p.min_context, n - 1 - p.min_context
    pos = lo + round(pos_frac * (hi - lo))
    wall = _noise(n, 0.02, seed)
    gpu = wall * 0.97
    wall[pos] *= factor
    if gpu_spikes:
        gpu[pos] *= factor
    res = detect_l1(np.arange(n) + 100, wall, gpu)
    assert _kinds(res) == [FindingKind.ITERATION_SPIKE]
    spike = res[0]
    assert spike.steps == (pos + 100,)
    assert spike.score == pytest.approx(factor, rel=0.1)
    assert spike.evidence["host_side"] is (not gpu_spikes)
    assert spike.evidence["window_max_min_ratio"] >= 2.0
    assert spike.level is Level.L1


def test_spike_at_the_edges_waits_for_context() -> None:
    wall = _noise(30, 0.01, 1)
    wall[1] *= 5
    wall[-2] *= 5
    assert detect_l1(np.arange(30), wall) == []  # fewer than min_context neighbours on one side
    wall = _noise(30, 0.01, 1)
    wall[3] *= 5
    assert [r.steps for r in detect_l1(np.arange(30), wall)] == [(3,)]


def test_two_step_spike_is_one_result_and_no_regression() -> None:
    wall = _noise(40, 0.01, 2)
    wall[20:22] *= 4
    res = detect_l1(np.arange(40), wall)
    assert [(r.kind, r.steps) for r in res] == [(FindingKind.ITERATION_SPIKE, (20, 21))]
    assert res[0].evidence["gpu_ratio"] is None  # no GPU time given


def test_spike_below_ratio_is_ignored() -> None:
    wall = _noise(40, 0.0, 3)
    wall[20] *= 1.45  # under min_spike_ratio, however quiet the job
    assert detect_l1(np.arange(40), wall) == []
    noisy = _noise(40, 0.10, 3)
    noisy[20] = 1.6 * BASE_NS  # over 1.5x, but under 6 noise levels of a 10 % noisy job (1.82x)
    assert detect_l1(np.arange(40), noisy) == []


@PROPERTY
@given(n=st.integers(12, 40), sigma=st.floats(0.0, 0.05), factor=st.floats(1.75, 2.2), pos_frac=st.floats(0, 1),
       seed=st.integers(0, 2**31))
def test_a_stall_under_2x_is_a_spike_where_it_stands_out_of_the_noise(n: int, sigma: float, factor: float,
                                                                       pos_frac: float, seed: int) -> None:
    # A host stall of 2x measured against the larger of two noisy medians reads under 2x about half the time.
    p = L1Params()
    pos = p.min_context + round(pos_frac * (n - 1 - 2 * p.min_context))
    wall = _noise(n, sigma, seed)
    wall[pos] = factor * BASE_NS
    assert [(r.kind, r.steps) for r in detect_l1(np.arange(n), wall)] == [(FindingKind.ITERATION_SPIKE, (pos,))]


@settings(max_examples=200, deadline=None)
@given(n=st.integers(7, 300), sigma=st.floats(0.03, 0.10), seed=st.integers(0, 2**31))
def test_healthy_gaussian_noise_makes_no_spike(n: int, sigma: float, seed: int) -> None:
    res = detect_l1(np.arange(n), _noise(n, sigma, seed))
    assert not [r for r in res if r.kind is FindingKind.ITERATION_SPIKE]


# -- regressions -------------------------------------------------------------------------------------


@PROPERTY
@given(n=st.integers(20, 150), onset_frac=st.floats(0.0, 1.0), factor=st.floats(1.5, 30.0),
       sigma=st.floats(0.0, 0.03), seed=st.integers(0, 2**31))
def test_step_regression_onset_exact(n: int, onset_frac: float, factor: float, sigma: float, seed: int) -> None:
    p = L1Params()
    lo, hi = p.min_segment, n - p.min_segment
    onset = lo + round(onset_frac * (hi - lo))
    wall = _noise(n, sigma, seed)
    wall[onset:] *= factor
    res = detect_l1(np.arange(n), wall, wall)
    assert _kinds(res) == [FindingKind.STEP_REGRESSION], res
    assert res[0].steps == (onset,)
    assert res[0].score == pytest.approx(factor, rel=0.1)
    assert res[0].evidence["gpu_shift_ratio"] == pytest.approx(factor, rel=0.1)


def test_small_shift_and_speedup_are_not_regressions() -> None:
    wall = _noise(60, 0.01, 4)
    wall[30:] *= 1.03  # under the 4 % effect size
    assert detect_l1(np.arange(60), wall) == []
    wall = _noise(60, 0.01, 4)
    wall[30:] *= 1.2  # was below the old 1.3x floor; a sustained >= 5 % slowdown is now a regression
    assert [(r.kind, r.steps) for r in detect_l1(np.arange(60), wall)] == [(FindingKind.STEP_REGRESSION, (30,))]
    wall = _noise(60, 0.01, 4)
    wall[30:] /= 3.0  # a recovery is no finding
    assert detect_l1(np.arange(60), wall) == []


def test_regression_then_recovery_then_regression() -> None:
    wall = _noise(90, 0.01, 5)
    wall[30:50] *= 3
    wall[70:] *= 2
    res = detect_l1(np.arange(90), wall)
    assert [(r.kind, r.steps) for r in res] == [(FindingKind.STEP_REGRESSION, (30,)),
                                                (FindingKind.STEP_REGRESSION, (70,))]
    assert res[1].score == pytest.approx(2.0, rel=0.1)  # measured against the recovered baseline


def test_spikes_do_not_make_change_points_and_regression_is_no_spike() -> None:
    wall = _noise(60, 0.01, 6)
    wall[25:] *= 10
    wall[[10, 45]] *= 4
    res = detect_l1(np.arange(60), wall)
    assert [(r.kind, r.steps) for r in res] == [
        (FindingKind.ITERATION_SPIKE, (10,)), (FindingKind.ITERATION_SPIKE, (45,)),
        (FindingKind.STEP_REGRESSION, (25,))]


def test_regression_needs_min_segment_after_onset() -> None:
    wall = _noise(30, 0.01, 7)
    wall[27:] *= 5
    assert all(r.kind is FindingKind.ITERATION_SPIKE for r in detect_l1(np.arange(30), wall))
    wall = _noise(30, 0.01, 7)
    wall[25:] *= 5
    assert [r.steps for r in detect_l1(np.arange(30), wall)] == [(25,)]


# -- input handling ----------------------------------------------------------------------------------


def test_per_rank_entries_reduce_by_max_and_series_from_steps() -> None:
    walls = _noise(30, 0.01, 8)
    walls[15] *= 3
    recs = [Step("j", r, s, 0, int(walls[s] * (1.0 if r == 2 else 0.9)), None if r == 0 else int(walls[s] * 0.5))
            for s in range(30) for r in range(4)]
    series = IterationSeries.from_steps(reversed(recs))
    assert len(series) == 30
    np.testing.assert_array_equal(series.step, np.arange(30))
    np.testing.assert_allclose(series.wall_ns, walls.astype(np.int64))
    res = detect_l1(series)
    assert [r.steps for r in res] == [(15,)]
    assert res[0].evidence["host_side"] is False
    arrays = detect_l1([s.step for s in recs], [s.wall_ns for s in recs])
    assert [r.steps for r in arrays] == [(15,)]
    assert len(IterationSeries.from_steps([])) == 0
    assert detect_l1(IterationSeries.from_steps([])) == []


def test_bad_input_and_params_raise() -> None:
    with pytest.raises(DetectorError):
        detect_l1(np.arange(3), np.ones(4))
    with pytest.raises(DetectorError):
        detect_l1(np.arange(3), np.array([1.0, -1.0, 1.0]))
    with pytest.raises(DetectorError):
        detect_l1(np.arange(3.0), np.ones(3))
    with pytest.raises(DetectorError):
        detect_l1(np.arange(3))
    for bad in ({"window": 1}, {"min_context": 6}, {"spike_ratio": 1.0}, {"min_spike_ratio": 2.5},
                {"spike_sigmas": -1.0}, {"min_shift": float("nan")},
                {"min_segment": 1}, {"penalty": -1.0}, {"smooth": 4}, {"max_change_points": 0}, {"warmup": -1},
                {"outlier_sigmas": 0.0}):
        with pytest.raises(DetectorError):
            L1Params(**bad)  # type: ignore[arg-type]


def test_sigma_floor_and_max_looks_are_used() -> None:
    """Two 20 % steps: one look finds one of them; a noise floor of 50 % hides both."""
    wall = _noise(120, 0.01, 3)
    wall[40:] *= 1.2
    wall[80:] *= 1.2
    assert [r.steps for r in detect_l1(np.arange(120), wall)] == [(40,), (80,)]
    assert len(detect_l1(np.arange(120), wall, params=L1Params(max_looks=1))) == 1
    assert detect_l1(np.arange(120), wall, params=L1Params(sigma_floor=0.5)) == []


@pytest.mark.parametrize("bad", [{"sigma_floor": 0.0}, {"sigma_floor": -1e-3}, {"sigma_floor": float("nan")},
                                 {"sigma_floor": float("inf")}, {"max_looks": 0}])
def test_bad_sigma_floor_or_max_looks_raises(bad: dict[str, float]) -> None:
    with pytest.raises(DetectorError, match=next(iter(bad))):
        L1Params(**bad)  # type: ignore[arg-type]
