"""L1 diagnosis: the job's iteration time per step, its spikes and its step regressions.

The job iteration time of a step is the maximum of :attr:`~schemas.records.Step.wall_ns` over the ranks
(a synchronous job is as slow as its slowest rank); the GPU time is the maximum of ``gpu_ns``. Two
detectors run on that series:

* **Spikes** (:attr:`L1Kind.ITERATION_SPIKE`): a step whose iteration time is at least
  ``spike_ratio`` (2x) times the median of the ``window // 2`` steps before it *and* of those after it.
  Asking both sides keeps the first steps of a lasting regression from looking like spikes, and the
  medians ignore other spikes nearby. The GPU time of the same step says where the time went: a spike
  whose GPU time stays flat is a host-side stall (JIT compilation, data loading, Python GC).
* **Step regressions** (:attr:`L1Kind.STEP_REGRESSION`): binary segmentation of ``ln(iteration time)``
  (Vostrikov 1981; Truong, Oudre & Vayatis 2020, "Selective review of offline change point detection
  methods", section 5.2.2) after a running median of ``smooth`` steps, which erases spikes shorter than
  ``smooth // 2 + 1`` steps but keeps step edges exactly where they are. A segment is split at the index
  that most reduces the sum of squared deviations from the segment means if the reduction beats a
  BIC-like penalty ``penalty * sigma**2 * ln(n)`` (``sigma``: robust noise level of the log series from
  the median absolute first difference) and the medians of the two parts differ by at least
  ``min_shift`` (1.3x). If that index is fewer than ``min_segment`` steps from an end, the change cannot
  be judged yet and the search goes on in the rest of the segment. Only slowdowns are reported; a recovery still
  splits the series so that later regressions are measured against the right baseline.

A flat series of healthy noise gives no result: a 2x spike or a 1.3x shift of a 5-step median is far
outside it. Decisions need context: a spike at step ``t`` is judged once ``min_context`` later steps
exist, a regression once ``min_segment`` steps follow its onset.
"""

from __future__ import annotations

import enum
import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
from numpy.lib.stride_tricks import sliding_window_view
from scipy.ndimage import median_filter

from argus.errors import DetectorError
from schemas.records import Level, Step

__all__ = ["IterationSeries", "L1Kind", "L1Params", "L1Result", "detect_l1"]

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
_MS = 1e6


class L1Kind(enum.Enum):
    """What L1 found."""

    ITERATION_SPIKE = "iteration_spike"
    STEP_REGRESSION = "step_regression"


@dataclass(frozen=True)
class L1Params:
    """Thresholds of :func:`detect_l1` (defaults in brackets).

    ``window``: steps of context around a step, half before and half after [10]. ``min_context``: the
    fewest steps needed on each side before a step is judged a spike [3]. ``spike_ratio``: a spike's
    iteration time over both neighbouring medians [2.0]. ``host_stall_gpu_ratio``: a spike whose GPU
    time is below this multiple of its neighbours' is called host-side [1.2]. ``min_segment``: fewest
    steps on each side of a change point [5]. ``min_shift``: smallest ratio of segment medians that counts
    as a regression [1.3]. ``penalty``: multiplier of the BIC-like split penalty [3.0]. ``smooth``: width
    of the running median applied before the change-point search, odd, 1 = off [5].
    ``max_change_points``: at most this many splits [8].

    Raises :class:`DetectorError` for out-of-range values.
    """

    window: int = 10
    min_context: int = 3
    spike_ratio: float = 2.0
    host_stall_gpu_ratio: float = 1.2
    min_segment: int = 5
    min_shift: float = 1.3
    penalty: float = 3.0
    smooth: int = 5
    max_change_points: int = 8

    def __post_init__(self) -> None:
        if self.window < 2 or not 1 <= self.min_context <= self.window // 2:
            raise DetectorError(f"need window >= 2 and 1 <= min_context <= window // 2, got {self.window}, "
                                f"{self.min_context}")
        for name in ("spike_ratio", "host_stall_gpu_ratio", "min_shift"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 1.0):
                raise DetectorError(f"{name} must be finite and > 1, got {value}")
        if self.min_segment < 2 or self.max_change_points < 1:
            raise DetectorError("min_segment must be >= 2 and max_change_points >= 1")
        if not (math.isfinite(self.penalty) and self.penalty >= 0.0):
            raise DetectorError(f"penalty must be finite and >= 0, got {self.penalty}")
        if self.smooth < 1 or self.smooth % 2 == 0:
            raise DetectorError(f"smooth must be odd and >= 1, got {self.smooth}")


@dataclass(frozen=True)
class L1Result:
    """One L1 finding.

    ``steps``: the spike's steps (consecutive spike steps form one result) or ``(onset,)`` of a regression.
    ``score``: a spike's iteration time over its neighbours' median, or a regression's ratio of the
    median after the onset to the median before it (unitless, > 1). ``evidence``: the numbers behind it,
    units in the key names (``*_ms``, ``*_ratio``).
    """

    kind: L1Kind
    steps: tuple[int, ...]
    score: float
    evidence: dict[str, Any] = field(default_factory=dict)

    @property
    def level(self) -> Level:
        return Level.L1


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
        """The job series of :class:`~schemas.records.Step` records (any ranks, any order)."""
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
    """Per index: median of up to ``half`` values before it and after it (NaN without enough of them)."""
    n = x.size
    pad = np.full(half, np.nan)
    padded = np.concatenate([pad, x, pad])
    views = sliding_window_view(padded, half)
    before, after = views[:n], views[half + 1:half + 1 + n]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN rows (no context) give NaN, as wanted
        mb = np.nanmedian(before, axis=1)
        ma = np.nanmedian(after, axis=1)
    mb[np.sum(~np.isnan(before), axis=1) < min_context] = np.nan
    ma[np.sum(~np.isnan(after), axis=1) < min_context] = np.nan
    return mb, ma


def _spikes(step: I64, wall: F64, gpu: F64, p: L1Params) -> list[L1Result]:
    half = p.window // 2
    if wall.size < 2 * p.min_context + 1:
        return []
    wb, wa = _side_medians(wall, half, p.min_context)
    base = np.fmax(wb, wa)
    judged = ~np.isnan(wb) & ~np.isnan(wa)
    ratio = np.where(judged, wall / np.where(judged, base, 1.0), np.nan)
    hit = judged & (ratio >= p.spike_ratio)
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
        out.append(L1Result(
            kind=L1Kind.ITERATION_SPIKE,
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
        ))
    return out


def _noise_sigma(y: F64) -> float:
    """Robust noise level of ``y``: MAD of first differences, scaled to a Gaussian sigma, floored."""
    if y.size < 3:
        return 1e-3
    mad = float(np.median(np.abs(np.diff(y))))
    return max(1.4826 * mad / math.sqrt(2.0), 1e-3)


def _best_split(y: F64) -> tuple[int, float]:
    """Split index (start of the right part) maximising the drop of the sum of squares, and the drop."""
    n = y.size
    c = np.concatenate(([0.0], np.cumsum(y - y.mean())))
    k = np.arange(1, n)
    gain = c[k] ** 2 * n / (k * (n - k))  # = k (n-k)/n (mean_l - mean_r)^2 for centred data
    best = int(np.argmax(gain))
    return int(k[best]), float(gain[best])


def _change_points(y: F64, p: L1Params) -> list[int]:
    n = y.size
    pen = p.penalty * _noise_sigma(y) ** 2 * math.log(max(n, 2))
    log_shift = math.log(p.min_shift)
    found: list[int] = []
    stack = [(0, n)]
    while stack and len(found) < p.max_change_points:
        a, b = stack.pop()
        if b - a < 2 * p.min_segment:
            continue
        k, gain = _best_split(y[a:b])
        if k < p.min_segment:  # the strongest change is too close to an end to judge yet: look past it
            stack.append((a + k, b))
            continue
        if k > b - a - p.min_segment:
            stack.append((a, a + k))
            continue
        shift = float(np.median(y[a + k:b]) - np.median(y[a:a + k]))
        if gain < pen or abs(shift) < log_shift:
            continue
        found.append(a + k)
        stack += [(a, a + k), (a + k, b)]
    return sorted(found)


def _regressions(step: I64, wall: F64, gpu: F64, p: L1Params) -> list[L1Result]:
    if wall.size < 2 * p.min_segment:
        return []
    y = np.log(wall)
    smoothed = median_filter(y, size=p.smooth, mode="nearest") if p.smooth > 1 else y
    cps = _change_points(smoothed, p)
    bounds = [0, *cps, wall.size]
    out: list[L1Result] = []
    for i, cp in enumerate(cps):
        lo, hi = bounds[i], bounds[i + 2]
        before, after = float(np.median(wall[lo:cp])), float(np.median(wall[cp:hi]))
        ratio = after / before
        if ratio < p.min_shift:
            continue
        g_before, g_after = gpu[lo:cp], gpu[cp:hi]
        gpu_ratio = None
        if np.any(~np.isnan(g_before)) and np.any(~np.isnan(g_after)):
            gpu_ratio = float(np.nanmedian(g_after) / max(float(np.nanmedian(g_before)), 1.0))
        out.append(L1Result(
            kind=L1Kind.STEP_REGRESSION,
            steps=(int(step[cp]),),
            score=ratio,
            evidence={
                "shift_ratio": ratio,
                "before_wall_ms": before / _MS,
                "after_wall_ms": after / _MS,
                "gpu_shift_ratio": gpu_ratio,
                "before_first_step": int(step[lo]),
                "after_last_step": int(step[hi - 1]),
                "steps_after_onset": hi - cp,
            },
        ))
    return out
