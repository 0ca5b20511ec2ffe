"""L1 step regressions: calibration (false alarms on healthy series) and power (detectable region).

The statistical tests run on fixed seeds, so they are deterministic; their bounds sit at what the statistics
allow (see the module docstring of :mod:`argus.detectors.l1_iteration` for the detectable region and the onset
accuracy, both set by ``shift / sigma`` and the number of steps).
"""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from argus.core.kinds import FindingKind
from argus.detectors import L1Params, detect_l1
from argus.detectors.l1_iteration import threshold_z

BASE_NS = 200e6
TAILS = (None, 5, 4)  # Gaussian, Student t5, t4 (scaled to the same standard deviation)


def _series(rng: np.random.Generator, n: int, sigma: float, *, drift: float = 0.0, warmup: bool = True,
            pauses: bool = True) -> np.ndarray:
    """Healthy log-normal-ish iteration times: noise, linear drift, slow first steps, isolated pauses."""
    nu = TAILS[int(rng.integers(len(TAILS)))]
    e = rng.standard_normal(n) if nu is None else rng.standard_t(nu, n) * math.sqrt((nu - 2) / nu)
    y = sigma * e + math.log1p(drift) * np.linspace(0.0, 1.0, n)
    if warmup:
        w = int(rng.integers(0, 4))
        y[:w] += np.log(np.sort(rng.uniform(1.2, 3.0, w))[::-1])
    if pauses:
        hit = rng.random(n) < rng.uniform(0.0, 0.03)
        y[hit] += np.log(rng.uniform(2.0, 5.0, int(hit.sum())))
    return BASE_NS * np.exp(y)


def _healthy_drift(n: int, fraction: float) -> float:
    """A healthy drift of ``fraction`` of ``max_drift`` over ``n`` steps: it builds up over ``drift_steps``."""
    p = L1Params()
    return fraction * p.max_drift * min(1.0, n / p.drift_steps)


def _regressions(wall: np.ndarray, params: L1Params | None = None) -> list:
    return [r for r in detect_l1(np.arange(wall.size), wall, params=params) if r.kind is FindingKind.STEP_REGRESSION]


def _needed_n_eff(shift: float, sigma: float, n: int) -> float:
    """n_eff for 95 % power (module docstring), drift allowance of a change lasting to the end included."""
    p = L1Params()
    excess = math.log(shift) - math.log1p(p.max_drift) / 2.0  # the series are at least drift_steps long
    return ((threshold_z(n) + 1.65) * sigma / excess) ** 2


def _onset_tolerance(shift: float, sigma: float) -> int:
    return max(2, math.ceil(11.0 * (sigma / math.log(shift)) ** 2))


# -- calibration: healthy series stay silent ------------------------------------------------------------


def test_false_regressions_on_healthy_series_at_most_1_percent() -> None:
    rng = np.random.default_rng(20240601)
    alarms = []
    for i in range(400):
        n, sigma = int(rng.integers(20, 301)), float(rng.uniform(0.03, 0.10))
        wall = _series(rng, n, sigma, drift=_healthy_drift(n, float(rng.uniform(-0.98, 0.98))))
        alarms += [(i, n, sigma, r.steps, r.score) for r in _regressions(wall)]
    assert len(alarms) <= 4, alarms  # measured: 0.05 % per series over this mix


def test_least_favourable_drift_stays_near_the_calibrated_rate() -> None:
    # the steepest healthy drift (+4.9 % over 200 steps or more, as much less over fewer) is the healthy
    # series closest to a regression: ~0.5 % per series by calibration
    rng = np.random.default_rng(7)
    alarms = 0
    for _ in range(400):
        n = int(rng.integers(20, 301))
        alarms += bool(_regressions(_series(rng, n, float(rng.uniform(0.03, 0.10)), drift=_healthy_drift(n, 0.98))))
    assert alarms <= 4


def test_a_short_series_allows_a_short_drift_only() -> None:
    # A healthy drift builds up over drift_steps: in a 24-step trace, a 6 % step at sigma 2 % stands out from
    # it (allowing 5 % of drift over the 24 steps, as if each were a whole series, would hide a third of them).
    rng = np.random.default_rng(5)
    found = found_whole_drift = 0
    for _ in range(50):
        wall = _series(rng, 24, 0.02, warmup=False, pauses=False)
        wall[12:] *= 1.06
        found += bool(_regressions(wall))
        found_whole_drift += bool(_regressions(wall, L1Params(drift_steps=1)))
    assert found >= 45
    assert found_whole_drift <= 40


def test_slow_drift_under_5_percent_is_silent_when_precise() -> None:
    rng = np.random.default_rng(3)
    for _ in range(30):
        wall = _series(rng, 500, 0.03, drift=0.049)
        assert _regressions(wall) == []


def test_shift_under_3_percent_is_never_reported() -> None:
    # the effect size (4 %) is >= 5 standard errors above any of these estimates
    rng = np.random.default_rng(11)
    for _ in range(100):
        n1, n2 = int(rng.integers(100, 301)), int(rng.integers(100, 301))
        wall = _series(rng, n1 + n2, float(rng.uniform(0.005, 0.015)))
        wall[n1:] *= 1.0 + float(rng.uniform(0.0, 0.03))
        assert _regressions(wall) == []


# -- power: sustained regressions are found, with their onset --------------------------------------------


def test_regressions_in_the_detectable_region_are_found() -> None:
    """Shifts of 5-10 %, sigma 3-8 %: with enough steps on both sides (n_eff from the docstring's formula,
    at least 40 after the onset) >= 95 % are found, >= 90 % with their onset within the 95 % tolerance
    max(2, 11 (sigma / delta)**2). (At 5 % and sigma 8 % that takes ~350 effective steps, ~500 after the
    onset with ~1000 before.)"""
    rng = np.random.default_rng(99)
    found = placed = 0
    runs = 200
    for _ in range(runs):
        shift, sigma = float(rng.uniform(1.05, 1.10)), float(rng.uniform(0.03, 0.08))
        n1 = int(rng.integers(50, 201))
        need = _needed_n_eff(shift, sigma, 1000)
        n1 = max(n1, math.ceil(2.0 * need))
        n2 = max(40, math.ceil(1.0 / (1.0 / need - 1.0 / n1)))
        wall = _series(rng, n1 + n2, sigma)
        wall[n1:] *= shift
        res = _regressions(wall)
        found += bool(res)
        placed += any(abs(r.steps[0] - n1) <= _onset_tolerance(shift, sigma) for r in res)
    assert found >= 0.95 * runs
    assert placed >= 0.90 * runs


def test_clear_regressions_have_their_onset_within_2_steps() -> None:
    """delta / sigma >= 2.5 (e.g. 10 % with sigma <= 3.8 %), >= 40 steps after the onset and 100 before:
    >= 95 % found with the onset within +-2 steps."""
    rng = np.random.default_rng(5)
    hits = 0
    runs = 200
    for _ in range(runs):
        shift = float(rng.uniform(1.05, 1.10))
        sigma = float(rng.uniform(0.005, math.log(shift) / 2.5))
        n1, n2 = int(rng.integers(100, 201)), int(rng.integers(40, 121))
        wall = _series(rng, n1 + n2, sigma)
        wall[n1:] *= shift
        hits += any(abs(r.steps[0] - n1) <= 2 for r in _regressions(wall))
    assert hits >= 0.95 * runs


PROPERTY = settings(max_examples=60, deadline=None)


@PROPERTY
@given(n1=st.integers(5, 100), n2=st.integers(5, 100), shift=st.floats(1.06, 3.0), sigma=st.floats(0.0, 0.005),
       seed=st.integers(0, 2**31))
# a +3.5 sigma draw at the last but one step, judged against the one step after it, was left out as a pause:
# 4 kept steps after the onset, fewer than min_segment, and no finding
@example(n1=75, n2=5, shift=2.0, sigma=0.00390625, seed=225414777)
# the onset step, a +3.1 sigma draw, left out: the onset was reported one step late
@example(n1=57, n2=8, shift=2.55, sigma=0.00148, seed=1775886387)
# the last step before the onset, a -3 sigma draw in a short series (noise level underestimated), left out
@example(n1=5, n2=7, shift=2.396, sigma=0.00218, seed=1372803650)
def test_low_noise_regression_exact_with_its_cost(n1: int, n2: int, shift: float, sigma: float, seed: int) -> None:
    wall = BASE_NS * np.exp(sigma * np.random.default_rng(seed).standard_normal(n1 + n2))
    wall[n1:] *= shift
    (r,) = detect_l1(np.arange(n1 + n2) + 7, wall)
    assert (r.kind, r.steps) == (FindingKind.STEP_REGRESSION, (n1 + 7,))
    assert r.score == pytest.approx(shift, rel=0.02)
    assert r.steps_affected == n2
    assert r.delay_ns_per_step == pytest.approx((shift - 1.0) * BASE_NS, rel=0.1, abs=0.01 * BASE_NS)
    assert r.evidence["z_score"] >= r.evidence["z_threshold"]


def test_warmup_and_pauses_do_not_hide_or_fake_a_regression() -> None:
    rng = np.random.default_rng(1)
    wall = BASE_NS * np.exp(0.02 * rng.standard_normal(200))
    wall[:3] *= [3.0, 2.0, 1.5]  # warm-up
    wall[[30, 70, 150]] *= 4.0  # GC / checkpoint pauses
    healthy = detect_l1(np.arange(200), wall)
    assert [(r.kind, r.steps) for r in healthy] == [(FindingKind.ITERATION_SPIKE, (s,)) for s in (30, 70, 150)]
    wall[100:] *= 1.08
    res = detect_l1(np.arange(200), wall)
    assert [(r.kind, r.steps) for r in res] == [
        *((FindingKind.ITERATION_SPIKE, (s,)) for s in (30, 70, 150)), (FindingKind.STEP_REGRESSION, (100,))]
    reg = res[-1]
    assert reg.score == pytest.approx(1.08, rel=0.01)
    assert reg.steps_affected == 100
    assert reg.delay_ns_per_step == pytest.approx(0.08 * BASE_NS, rel=0.2)
    assert reg.evidence["outlier_steps_excluded"] >= 4  # the three pauses and the first warm-up step
    assert res[0].delay_ns_per_step == pytest.approx(3.0 * BASE_NS, rel=0.1) and res[0].steps_affected == 1


def test_spike_cost_covers_every_spike_step() -> None:
    wall = BASE_NS * np.exp(0.01 * np.random.default_rng(2).standard_normal(40))
    wall[20:22] *= 4.0
    (r,) = detect_l1(np.arange(40), wall)
    assert (r.kind, r.steps, r.steps_affected) == (FindingKind.ITERATION_SPIKE, (20, 21), 2)
    assert r.delay_ns_per_step == pytest.approx(3.0 * BASE_NS, rel=0.1)


def test_regression_then_recovery_costs_only_its_own_steps() -> None:
    wall = BASE_NS * np.exp(0.01 * np.random.default_rng(4).standard_normal(120))
    wall[40:80] *= 1.1
    (r,) = detect_l1(np.arange(120), wall)
    assert (r.kind, r.steps, r.steps_affected) == (FindingKind.STEP_REGRESSION, (40,), 40)


def test_no_drift_tolerance_is_more_sensitive() -> None:
    rng = np.random.default_rng(8)
    wall = _series(rng, 400, 0.05, warmup=False, pauses=False)
    wall[200:] *= 1.05  # z ~ 9.8 against noise, ~4.9 beyond a 5 % drift
    assert [r.steps for r in _regressions(wall, L1Params(max_drift=0.0))] == [(200,)]


def test_speed() -> None:
    rng = np.random.default_rng(0)
    walls = [_series(rng, 500, 0.08) for _ in range(20)]
    t0 = time.perf_counter()
    for w in walls:
        detect_l1(np.arange(500), w, w * 0.9)
    per_call = (time.perf_counter() - t0) / len(walls)
    long = _series(rng, 5000, 0.08)
    t0 = time.perf_counter()
    detect_l1(np.arange(5000), long, long * 0.9)
    assert per_call < 0.02 and time.perf_counter() - t0 < 0.1  # measured ~1 ms and ~4 ms
