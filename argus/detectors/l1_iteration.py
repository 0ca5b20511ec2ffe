"""L1 diagnosis: the job's iteration time per step, its spikes and its step regressions.

The job iteration time of a step is the maximum of :attr:`~argus.schemas.records.Step.wall_ns` over the ranks
(a synchronous job is as slow as its slowest rank); the GPU time is the maximum of ``gpu_ns``. Two
detectors run on that series: spikes (``iteration_spike``, a step far above the medians on both sides of
it) and step regressions (``step_regression``, a lasting shift of ``ln(iteration time)`` found by binary
segmentation). Thresholds are :class:`L1Params`; the rules and their calibration: docs/internals/detectors.md.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
from numpy.lib.stride_tricks import sliding_window_view

from argus.core.errors import DetectorError
from argus.core.kinds import FindingKind
from argus.detectors.l2_groups import MAD_SCALE
from argus.schemas.records import Level, Step

__all__ = ["IterationSeries", "L1Params", "L1Result", "detect_l1"]

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
_MS = 1e6
#: Critical value of the standardized mean-shift statistic: _Z_A + _Z_B * ln(ln(steps)), calibrated by simulation.
_Z_A, _Z_B = 3.25, 0.42


@dataclass(frozen=True)
class L1Params:
    """Thresholds of :func:`detect_l1` (defaults in brackets).

    ``window``: steps of context around a step, half before and half after [10]. ``min_context``: the
    fewest steps needed on each side before a step is judged a spike [3]. ``spike_ratio``: a spike's
    iteration time over both neighbouring medians [2.0]. ``min_spike_ratio``, ``spike_sigmas``: the least
    such ratio of a spike that is also ``spike_sigmas`` noise levels of the log iteration time [1.5, 6.0].
    ``host_stall_gpu_ratio``: a spike whose GPU
    time is below this multiple of its neighbours' is called host-side [1.2]. ``min_segment``: fewest
    steps on each side of a change point, dropped pauses included, at least 2 of them kept [5].
    ``min_shift``: smallest ratio of the geometric means after and before a change point that counts as a
    regression (the effect size) [1.04]. ``penalty``:
    multiplier of the squared calibrated critical value (1 = false regressions <= 0.5 % per call) [1.0].
    ``smooth``: width of the two-sided window whose side medians judge a step an outlier (pause, spike)
    before the change-point search, odd, 1 = keep every step [11]. ``max_change_points``: at most this
    many splits [8]. ``warmup``: leading steps judged against later steps only [3]. ``outlier_sigmas``:
    distance from both side medians, in noise levels, beyond which a step is left out [4.0].
    ``max_drift``: largest healthy slow drift, as a fraction, that a regression must stand out from, over a
    series of ``drift_steps`` steps or more [0.05].

    Raises :class:`DetectorError` for out-of-range values.
    """

    window: int = 10
    min_context: int = 3
    spike_ratio: float = 2.0
    min_spike_ratio: float = 1.5
    spike_sigmas: float = 6.0
    host_stall_gpu_ratio: float = 1.2
    min_segment: int = 5
    min_shift: float = 1.04
    penalty: float = 1.0
    smooth: int = 11
    max_change_points: int = 8
    warmup: int = 3
    outlier_sigmas: float = 4.0
    max_drift: float = 0.05
    #: Steps over which a healthy drift may reach ``max_drift``: a healthy drift builds up step by step, so a
    #: shorter series allows proportionally less (a job that slows 5 % within 20 steps has regressed) [200].
    drift_steps: int = 200
    #: Least noise level of ``ln(iteration time)`` (natural-log units; 1e-3 is 0.1 %): below it, noise is no
    #: longer what limits the test (timer resolution, rounding) [1e-3].
    sigma_floor: float = 1e-3
    #: Most segments one binary segmentation examines (a count; it bounds the search's cost) [64].
    max_looks: int = 64

    def __post_init__(self) -> None:
        if self.window < 2 or not 1 <= self.min_context <= self.window // 2:
            raise DetectorError(f"need window >= 2 and 1 <= min_context <= window // 2, got {self.window}, "
                                f"{self.min_context}")
        for name in ("spike_ratio", "min_spike_ratio", "host_stall_gpu_ratio", "min_shift"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 1.0):
                raise DetectorError(f"{name} must be finite and > 1, got {value}")
        if self.min_segment < 2 or self.max_change_points < 1:
            raise DetectorError("min_segment must be >= 2 and max_change_points >= 1")
        if not (math.isfinite(self.penalty) and self.penalty >= 0.0):
            raise DetectorError(f"penalty must be finite and >= 0, got {self.penalty}")
        if self.smooth < 1 or self.smooth % 2 == 0:
            raise DetectorError(f"smooth must be odd and >= 1, got {self.smooth}")
        if not (self.min_spike_ratio <= self.spike_ratio and math.isfinite(self.spike_sigmas)
                and self.spike_sigmas >= 0.0):
            raise DetectorError(f"need min_spike_ratio <= spike_ratio and spike_sigmas >= 0, got "
                                f"{self.min_spike_ratio}, {self.spike_ratio}, {self.spike_sigmas}")
        if self.warmup < 0:
            raise DetectorError(f"warmup must be >= 0, got {self.warmup}")
        if not (math.isfinite(self.max_drift) and self.max_drift >= 0.0):
            raise DetectorError(f"max_drift must be finite and >= 0, got {self.max_drift}")
        if not (math.isfinite(self.outlier_sigmas) and self.outlier_sigmas > 0.0):
            raise DetectorError(f"outlier_sigmas must be finite and > 0, got {self.outlier_sigmas}")
        if not (math.isfinite(self.sigma_floor) and self.sigma_floor > 0.0):
            raise DetectorError(f"sigma_floor must be finite and > 0, got {self.sigma_floor}")
        if self.max_looks < 1:
            raise DetectorError(f"max_looks must be >= 1, got {self.max_looks}")
        if self.drift_steps < 1:
            raise DetectorError(f"drift_steps must be >= 1, got {self.drift_steps}")


@dataclass(frozen=True)
class L1Result:
    """One L1 finding.

    ``steps``: the spike's steps (consecutive spike steps form one result) or ``(onset,)`` of a regression.
    ``score``: a spike's iteration time over its neighbours' median, or a regression's ratio of the
    geometric means after and before the onset, pauses excluded (unitless, > 1). ``evidence``: the numbers
    behind it, units in the key names (``*_ms``, ``*_ratio``). ``delay_ns_per_step``: the extra iteration
    time per affected step, ns (a regression: median after the onset minus median before, pauses excluded;
    a spike: mean excess of its steps over their neighbours' median). ``steps_affected``: a regression's
    steps from the onset up to the next change point or the end of the series; a spike's steps. Their
    product is the time the finding cost the job so far.
    """

    kind: FindingKind
    steps: tuple[int, ...]
    score: float
    evidence: dict[str, Any] = field(default_factory=dict)
    delay_ns_per_step: float = 0.0
    steps_affected: int = 0

    @property
    def level(self) -> Level:
        return self.kind.level


@dataclass(frozen=True, eq=False)
class IterationSeries:
    """The job's per-step series, ascending by step: ``step``, iteration ``wall_ns`` and ``gpu_ns``.

    ``gpu_ns`` is NaN where no rank reported a GPU time. Build it with :meth:`from_arrays` or
    :meth:`from_steps`.
    """

    step: I64
    wall_ns: F64
    gpu_ns: F64

    @classmethod
    def from_arrays(cls, steps: npt.ArrayLike, wall_ns: npt.ArrayLike,
                    gpu_ns: npt.ArrayLike | None = None) -> IterationSeries:
        """Reduce per-(rank, step) values to the job series: max over the entries of each step.

        ``gpu_ns`` may hold NaN for unknown values (ignored by the max). Raises :class:`DetectorError`
        for mismatched lengths, non-integer steps, or negative or non-finite wall times.
        """
        s = np.asarray(steps)
        w = np.asarray(wall_ns, dtype=np.float64)
        g = np.full(w.shape, np.nan) if gpu_ns is None else np.asarray(gpu_ns, dtype=np.float64)
        if s.ndim != 1 or s.dtype.kind not in "iu" or w.shape != s.shape or g.shape != s.shape:
            raise DetectorError("steps (integers), wall_ns and gpu_ns must be equally long 1-D arrays")
        if not np.all(np.isfinite(w)) or np.any(w < 0.0) or np.any(g < 0.0):
            raise DetectorError("wall_ns must be finite and >= 0, gpu_ns >= 0 or NaN")
        uniq, inv = np.unique(s.astype(np.int64), return_inverse=True)
        wall = np.full(uniq.size, -np.inf)
        np.maximum.at(wall, inv, w)
        gpu = np.full(uniq.size, -np.inf)
        np.maximum.at(gpu, inv, np.where(np.isnan(g), -np.inf, g))
        return cls(uniq, wall, np.where(np.isinf(gpu), np.nan, gpu))

    @classmethod
    def from_steps(cls, records: Iterable[Step]) -> IterationSeries:
        """The job series of :class:`~argus.schemas.records.Step` records (any ranks, any order)."""
        rows = [(r.step, r.wall_ns, math.nan if r.gpu_ns is None else r.gpu_ns) for r in records]
        if not rows:
            return cls(np.empty(0, np.int64), np.empty(0), np.empty(0))
        cols = list(zip(*rows, strict=True))
        return cls.from_arrays(np.array(cols[0], dtype=np.int64), np.array(cols[1], dtype=np.float64),
                               np.array(cols[2], dtype=np.float64))

    def __len__(self) -> int:
        return int(self.step.size)


def detect_l1(steps: npt.ArrayLike | IterationSeries, wall_ns: npt.ArrayLike | None = None,
              gpu_ns: npt.ArrayLike | None = None, params: L1Params | None = None) -> list[L1Result]:
    """Spikes and step regressions of the job iteration time (see the module docstring).

    Pass an :class:`IterationSeries`, or ``steps`` with ``wall_ns`` (and optionally ``gpu_ns``), in ns,
    either one value per step or one per (rank, step): entries of the same step are reduced by max.
    ``params`` defaults to ``L1Params()``. Returns spikes (in step order) then regressions (by onset).
    Too short a series gives no result. Raises :class:`DetectorError` for malformed input.
    """
    p = params if params is not None else L1Params()
    if isinstance(steps, IterationSeries):
        series = steps
    else:
        if wall_ns is None:
            raise DetectorError("wall_ns is required unless an IterationSeries is given")
        series = IterationSeries.from_arrays(steps, wall_ns, gpu_ns)
    wall = np.maximum(series.wall_ns, 1.0)
    return _spikes(series.step, wall, series.gpu_ns, p) + _regressions(series.step, wall, series.gpu_ns, p)


def _side_medians(x: F64, half: int, min_context: int) -> tuple[F64, F64]:
    """Per index: median of up to ``half`` values before it and after it, NaN values ignored (NaN with
    fewer than ``min_context`` of them)."""
    n = x.size
    pad = np.full(half, np.nan)
    views = sliding_window_view(np.concatenate([pad, x, pad]), half)
    return _row_medians(views[:n], min_context), _row_medians(views[half + 1:half + 1 + n], min_context)


def _row_medians(rows: F64, min_context: int) -> F64:
    """Median of each row ignoring NaN (sorted to the end), NaN for rows with fewer than ``min_context``."""
    s = np.sort(rows, axis=1)
    count = np.sum(~np.isnan(s), axis=1)
    r = np.arange(s.shape[0])
    lo, hi = np.maximum(count - 1, 0) // 2, count // 2
    med = 0.5 * (s[r, lo] + s[r, np.minimum(hi, s.shape[1] - 1)])
    med[count < max(min_context, 1)] = np.nan
    return med


def _spikes(step: I64, wall: F64, gpu: F64, p: L1Params) -> list[L1Result]:
    half = p.window // 2
    if wall.size < 2 * p.min_context + 1:
        return []
    wb, wa = _side_medians(wall, half, p.min_context)
    base = np.fmax(wb, wa)
    judged = ~np.isnan(wb) & ~np.isnan(wa)
    ratio = np.where(judged, wall / np.where(judged, base, 1.0), np.nan)
    sigma = _mad_sigma(np.log(wall))
    with np.errstate(invalid="ignore", divide="ignore"):
        quiet = (ratio >= p.min_spike_ratio) & (np.log(ratio) >= p.spike_sigmas * sigma)
    hit = judged & ((ratio >= p.spike_ratio) | quiet)
    if not hit.any():
        return []
    gb, ga = _side_medians(gpu, half, p.min_context)
    gbase = np.fmax(gb, ga)
    span = sliding_window_view(np.concatenate([np.full(half, np.nan), wall, np.full(half, np.nan)]), 2 * half + 1)
    out: list[L1Result] = []
    idx = np.flatnonzero(hit)
    runs = np.split(idx, np.flatnonzero(np.diff(idx) > 1) + 1)
    for run in runs:
        peak = int(run[np.argmax(ratio[run])])
        g, gref = float(gpu[peak]), float(gbase[peak])
        gpu_ratio = g / gref if math.isfinite(g) and math.isfinite(gref) and gref > 0 else None
        window = span[peak]
        excess = float(np.mean(wall[run] - base[run]))
        out.append(L1Result(
            kind=FindingKind.ITERATION_SPIKE,
            steps=tuple(int(s) for s in step[run]),
            score=float(ratio[peak]),
            evidence={
                "spike_ratio": float(ratio[peak]),
                "wall_ms": float(wall[peak]) / _MS,
                "baseline_wall_ms": float(base[peak]) / _MS,
                "window_max_min_ratio": float(np.nanmax(window) / np.nanmin(window)),
                "gpu_ms": g / _MS if math.isfinite(g) else None,
                "baseline_gpu_ms": gref / _MS if math.isfinite(gref) else None,
                "gpu_ratio": gpu_ratio,
                "host_side": None if gpu_ratio is None else bool(gpu_ratio < p.host_stall_gpu_ratio),
                "peak_step": int(step[peak]),
            },
            delay_ns_per_step=excess,
            steps_affected=int(run.size),
        ))
    return out


def _outliers(y: F64, sigma: float, p: L1Params) -> npt.NDArray[np.bool_]:
    """Steps far (``outlier_sigmas`` noise levels) above or below the medians of the ``smooth // 2`` steps
    on *both* sides: pauses and spikes, not the edges of a lasting change (one side agrees with an edge).
    The first ``warmup`` steps are judged by the steps after them only, the last step by those before."""
    half = p.smooth // 2
    n = y.size
    if half == 0 or n < 3:
        return np.zeros(n, dtype=bool)
    mb, ma = _side_medians(y, half, 1)
    # The distance to a side median carries that median's own noise, ~pi sigma**2 / (2 m) for m steps: near
    # the ends a side has few steps (one, for the last but one) and noise alone would pass a fixed threshold,
    # biasing the levels near the ends and moving onsets. So the threshold grows with that noise,
    # normalised to stay ``outlier_sigmas * sigma`` with full context (the calibrated case).
    i = np.arange(n)
    m_b, m_a = np.maximum(np.minimum(i, half), 1), np.maximum(np.minimum(n - 1 - i, half), 1)
    full = 1.0 + math.pi / (2.0 * half)
    thr_b = p.outlier_sigmas * sigma * np.sqrt((1.0 + math.pi / (2.0 * m_b)) / full)
    thr_a = p.outlier_sigmas * sigma * np.sqrt((1.0 + math.pi / (2.0 * m_a)) / full)
    no_b, no_a = np.isnan(mb), np.isnan(ma)
    d_b, d_a = np.where(no_b, 0.0, y - mb), np.where(no_a, 0.0, y - ma)
    warm = np.arange(n) < p.warmup  # slow warm-up steps: high above what follows, whatever came before
    up = (no_b | warm | (d_b > thr_b)) & (no_a | (d_a > thr_a)) & ~(no_a & (no_b | warm))
    down = (no_b | (d_b < -thr_b)) & (no_a | (d_a < -thr_a)) & ~(no_a & no_b)
    return up | down


def _mad_sigma(y: F64) -> float:
    """Robust noise level of ``y``: MAD of first differences, scaled to a Gaussian sigma."""
    if y.size < 3:
        return 0.0
    return MAD_SCALE * float(np.median(np.abs(np.diff(y)))) / math.sqrt(2.0)


def _test_sigma(z: F64, mad_sigma: float, p: L1Params) -> float:
    """Noise level for the test: RMS of first differences / sqrt(2), each difference winsorized at four of
    its robust standard deviations (so level shifts count little, moderately heavy tails fully), floored at
    ``p.sigma_floor``."""
    if z.size < 3:
        return p.sigma_floor
    d = np.diff(z)
    lim = 4.0 * math.sqrt(2.0) * max(mad_sigma, p.sigma_floor)
    return max(math.sqrt(float(np.mean(np.clip(d, -lim, lim) ** 2)) / 2.0), p.sigma_floor)


def threshold_z(n: int) -> float:
    """Calibrated critical value of the standardized mean-shift statistic for a series of ``n`` steps
    (false regressions <= 0.5 % per healthy job; see the module docstring)."""
    return _Z_A + _Z_B * math.log(math.log(max(n, 3)))


def _best_split(z: F64) -> tuple[int, float]:
    """Split index (start of the right part) maximising the drop of the sum of squares ``k (n-k)/n d**2``,
    and ``d`` = mean of the right part minus mean of the left part."""
    n = z.size
    c = np.cumsum(z - z.mean())[:-1]
    k = np.arange(1, n)
    w = n / (k * (n - k))
    best = int(np.argmax(c * c * w))
    return best + 1, float(-c[best] * w[best])


@dataclass(frozen=True)
class _Test:
    """The acceptance test of a change between two adjacent runs of ``n1`` and ``n2`` kept steps."""

    sigma: float  # noise level of ln(iteration time)
    z_crit: float  # calibrated critical value (times sqrt(penalty))
    gate: float  # ln(min_shift)
    # ln(1 + max_drift) / (2 max(n, drift_steps)): the bias a healthy drift may put on a mean shift
    drift_per_step: float

    def z(self, n1: npt.ArrayLike, n2: npt.ArrayLike, delta: npt.ArrayLike) -> F64:
        """Standardized shift of the means beyond what a healthy drift explains."""
        n1f, n2f = np.asarray(n1, np.float64), np.asarray(n2, np.float64)
        excess = np.abs(np.asarray(delta, np.float64)) - self.drift_per_step * (n1f + n2f)
        return np.asarray(excess / (self.sigma * np.sqrt(1.0 / n1f + 1.0 / n2f)), np.float64)

    def ok(self, n1: npt.ArrayLike, n2: npt.ArrayLike, delta: npt.ArrayLike) -> npt.NDArray[np.bool_]:
        return (self.z(n1, n2, delta) >= self.z_crit) & (np.abs(np.asarray(delta, np.float64)) >= self.gate)


def _change_points(y: F64, keep: I64, test: _Test, p: L1Params) -> list[int]:
    """Binary segmentation of the kept steps ``z = y[keep]`` (see the module docstring); change points as
    indices into ``z``. ``min_segment`` counts series steps, left-out ones included (see :func:`_onset`)."""
    z = y[keep]
    n, m = z.size, p.min_segment
    found: list[int] = []
    stack = [(0, n, 0, y.size)]  # kept steps [a, b), series steps [ra, rb)
    looks = 0
    while stack and len(found) < p.max_change_points and looks < p.max_looks:
        a, b, ra, rb = stack.pop()
        if b - a < 4 or rb - ra < 2 * m:
            continue
        looks += 1
        k, delta = _best_split(z[a:b])
        c = a + k
        left = float(np.mean(z[a:c]))
        r = _onset(y, keep, c, left, left + delta)
        # Too close to an end to judge yet (fewer than min_segment steps, or a single kept one): look past it.
        # Sides count series steps: a pause, or a step its noise set apart, left out near the end of the
        # series must not hide a change that min_segment steps already show (the test weighs the kept ones).
        if k < 2 or r - ra < m:
            stack.append((c, b, r, rb))
            continue
        if b - c < 2 or rb - r < m:
            stack.append((a, c, ra, r))
            continue
        if not test.ok(k, b - c, delta):
            continue
        found.append(c)
        stack += [(a, c, ra, r), (c, b, r, rb)]
    return _prune(z, sorted(found), test)


def _segment_stats(z: F64, cps: list[int]) -> tuple[I64, I64, F64]:
    """Per change point: the kept steps before and after it up to its neighbours, and the shift of the means."""
    bounds = np.array([0, *cps, z.size])
    c = np.concatenate(([0.0], np.cumsum(z)))
    lo, mid, hi = bounds[:-2], bounds[1:-1], bounds[2:]
    n1, n2 = mid - lo, hi - mid
    return n1, n2, (c[hi] - c[mid]) / n2 - (c[mid] - c[lo]) / n1


def _prune(z: F64, cps: list[int], test: _Test) -> list[int]:
    """Drop, weakest first, change points that fail the test against their final neighbouring segments."""
    while cps:
        n1, n2, delta = _segment_stats(z, cps)
        ok = test.ok(n1, n2, delta)
        if ok.all():
            break
        weakest = int(np.argmin(np.where(ok, np.inf, test.z(n1, n2, delta))))
        cps = cps[:weakest] + cps[weakest + 1:]
    return cps


def _onset(y: F64, keep: I64, c: int, old: float, new: float) -> int:
    """Series index of the first step of the level that starts at kept step ``c``, given the mean ``ln``
    iteration times ``old`` and ``new`` of the levels before and after it.

    Steps left out between the last kept step of the old level and ``keep[c]`` belong to the level their
    value is nearer to: the first step of a change, left out because its noise put it beyond the new level's
    neighbours, is the onset, and so is a pause right before a slowdown (nearer the higher level); a step
    that only its noise set apart from the old level stays before the onset."""
    onset = int(keep[c])
    first = int(keep[c - 1]) + 1 if c > 0 else 0
    while onset > first and abs(y[onset - 1] - new) < abs(y[onset - 1] - old):
        onset -= 1
    return onset


def _regressions(step: I64, wall: F64, gpu: F64, p: L1Params) -> list[L1Result]:
    n, m = wall.size, p.min_segment
    if n < 2 * m:
        return []
    y = np.log(wall)
    mad = _mad_sigma(y)
    keep = np.flatnonzero(~_outliers(y, max(mad, p.sigma_floor), p))
    z = y[keep]
    if z.size < 4:  # min_segment counts series steps (already checked); a mean and a noise need >= 2 each
        return []
    test = _Test(sigma=_test_sigma(z, mad, p), z_crit=threshold_z(z.size) * math.sqrt(p.penalty),
                 gate=math.log(p.min_shift),
                 drift_per_step=math.log1p(p.max_drift) / (2.0 * max(z.size, p.drift_steps)))
    cps = _change_points(y, keep, test, p)
    if not cps:
        return []
    n1s, n2s, deltas = _segment_stats(z, cps)
    zs = test.z(n1s, n2s, deltas)
    bounds = [0, *cps, z.size]
    means = [float(np.mean(z[lo:hi])) for lo, hi in itertools.pairwise(bounds)]
    onsets = [0, *(_onset(y, keep, cp, means[i], means[i + 1]) for i, cp in enumerate(cps)), n]
    out: list[L1Result] = []
    for i, cp in enumerate(cps):
        delta = float(deltas[i])
        if delta <= 0.0:  # a recovery is no finding
            continue
        lo, hi = bounds[i], bounds[i + 2]
        k_before, k_after = keep[lo:cp], keep[cp:hi]
        before, after = float(np.median(wall[k_before])), float(np.median(wall[k_after]))
        g_before, g_after = gpu[k_before], gpu[k_after]
        gpu_ratio = None
        if np.any(~np.isnan(g_before)) and np.any(~np.isnan(g_after)):
            gpu_ratio = float(np.nanmedian(g_after) / max(float(np.nanmedian(g_before)), 1.0))
        start, onset, end = onsets[i], onsets[i + 1], onsets[i + 2]  # end: the next onset or of the series
        ratio = math.exp(delta)
        out.append(L1Result(
            kind=FindingKind.STEP_REGRESSION,
            steps=(int(step[onset]),),
            score=ratio,
            evidence={
                "shift_ratio": ratio,
                "median_shift_ratio": after / before,
                "before_wall_ms": before / _MS,
                "after_wall_ms": after / _MS,
                "gpu_shift_ratio": gpu_ratio,
                "before_first_step": int(step[start]),
                "after_last_step": int(step[end - 1]),
                "steps_after_onset": end - onset,
                "z_score": float(zs[i]),
                "z_threshold": test.z_crit,
                "noise_sigma_ratio": math.exp(test.sigma),
                "outlier_steps_excluded": int(n - z.size),
                "onset_uncertainty_steps": max(2, math.ceil(11.0 * (test.sigma / delta) ** 2)),
            },
            delay_ns_per_step=after - before,
            steps_affected=end - onset,
        ))
    return out
