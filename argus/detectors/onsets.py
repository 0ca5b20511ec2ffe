"""Onsets of ranks that became slow inside the traced steps: where the affected steps begin.

An L3 result carries the excess time of a rank over the judged data (a window, or the whole job); its impact
spreads that excess over the steps it was measured on (:mod:`argus.detectors.impact`). A fault whose onset
falls inside that data costs only the steps from the onset on: spread over every step, a fault costing 2 %
of each affected step reads as 1 % when it began half way, and falls under the impact bar. Kernel summaries
hold no steps (a window's calls are pooled), but the phase records do: each rank's own compute time per step
(:meth:`~argus.detectors.l2_history.PhaseHistory.compute_own`, forward, backward and optimizer phases less
their nested blocking collectives), where the job annotates its phases, and its time in each collective phase:
a degraded link slows its members' collectives from its onset on, while a rank slow in its own work arrives
later and waits less in them (no upward shift).

Details and reasoning: docs/internals/detectors.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from scipy.special import ndtri

from argus.core.errors import DetectorError
from argus.detectors.l2_groups import MAD_SCALE

__all__ = ["OnsetParams", "rank_onsets"]

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]


@dataclass(frozen=True)
class OnsetParams:
    """Thresholds of :func:`rank_onsets` (defaults in brackets): ``alpha`` the family-wise false-onset rate over ranks
    x splits [1e-3]; ``min_t`` the least t statistic whatever the family [5.0]; ``min_shift`` the least shift of
    the log own compute time (0.01: 1 %) [0.01]; ``min_segment`` the fewest steps on each side [4];
    ``max_steps`` the most recent steps searched [64] (the cost is rows x steps: at 10,240 ranks x 3 phases,
    under a second a pass over 64 steps; an onset before them is not found, which only leaves the excess spread
    over every step, as without onsets).

    Raises :class:`DetectorError` for out-of-range values."""

    alpha: float = 1e-3
    min_t: float = 5.0
    min_shift: float = 0.01
    min_segment: int = 4
    max_steps: int = 64
    #: Least noise of a log time ratio (natural-log units; 2e-3 is 0.2 %): identical steps give no infinite t
    #: [2e-3].
    noise_floor: float = 2e-3

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha < 1.0:
            raise DetectorError(f"alpha must be in (0, 1), got {self.alpha}")
        if not self.min_t > 0.0 or not self.min_shift > 0.0:
            raise DetectorError(f"min_t and min_shift must be > 0, got {self.min_t}, {self.min_shift}")
        if self.min_segment < 2 or self.max_steps < 2 * self.min_segment + 1:
            raise DetectorError(f"need min_segment >= 2 and max_steps > 2 * min_segment, got {self.min_segment}, "
                                f"{self.max_steps}")
        if not (math.isfinite(self.noise_floor) and self.noise_floor > 0.0):
            raise DetectorError(f"noise_floor must be finite and > 0, got {self.noise_floor}")


def rank_onsets(own_ns: npt.ArrayLike, phase: npt.ArrayLike | None = None,
                params: OnsetParams | None = None) -> I64:
    """Per row of ``own_ns`` (one rank's own time in one phase, rows x steps in step order, ns; NaN or
    <= 0 where unknown), the index of the step it shifted up at, -1 where there is no such onset (see the
    module docstring). ``phase``: each row's phase id (rows of one phase are compared with each other; None:
    all rows one phase). Steps some row lacks are left out; phases of fewer than two rows, or fewer than
    ``2 * min_segment`` steps: no onset. Raises :class:`DetectorError` for inconsistent shapes."""
    p = params if params is not None else OnsetParams()
    own = np.asarray(own_ns, dtype=np.float64)
    if own.ndim != 2:
        raise DetectorError(f"own_ns must be rows x steps, got shape {own.shape}")
    ph = np.zeros(own.shape[0], np.int64) if phase is None else np.asarray(phase, dtype=np.int64)
    if ph.shape != (own.shape[0],):
        raise DetectorError(f"phase must give one id per row ({own.shape[0]}), got shape {ph.shape}")
    out = np.full(own.shape[0], -1, dtype=np.int64)
    keep = np.flatnonzero((np.isfinite(own) & (own > 0)).all(axis=0))[-p.max_steps:]
    n_rows, n = own.shape[0], keep.size
    if n_rows < 2 or n < 2 * p.min_segment:
        return out
    x = np.log(own[:, keep])
    for g in np.unique(ph).tolist():
        rows = ph == g
        x[rows] -= np.median(x[rows], axis=0, keepdims=True) if rows.sum() >= 2 else np.nan
    splits = np.arange(p.min_segment, n - p.min_segment + 1)
    cum = np.cumsum(x, axis=1)
    total = cum[:, -1:]
    before = cum[:, splits - 1] / splits
    after = (total - cum[:, splits - 1]) / (n - splits)
    shift = after - before
    best = np.argmax(shift / np.sqrt(1.0 / splits + 1.0 / (n - splits)), axis=1)
    k = splits[best]
    rows = np.arange(n_rows)
    # The noise about the chosen split's two segments, robustly (one outlier step moves no onset).
    lo, hi = _seg_median(x, k, lower=True), _seg_median(x, k, lower=False)
    resid = np.where(np.arange(n)[None, :] < k[:, None], x - lo[:, None], x - hi[:, None])
    own_noise = MAD_SCALE * np.median(np.abs(resid), axis=1)
    # A row's few steps may happen to lie close together: its noise is at least its phase's typical one.
    typical = np.zeros(n_rows)
    for g in np.unique(ph).tolist():
        typical[ph == g] = np.nanmedian(own_noise[ph == g])
    noise = np.maximum(np.maximum(own_noise, typical), p.noise_floor)
    # The shift judged is the segments' medians': one outlier step (a host stall, a pause) in a short segment
    # moves the means, not a level.
    d = np.minimum(shift[rows, best], hi - lo)
    t = d / (noise * np.sqrt(1.0 / k + 1.0 / (n - k)))
    bound = max(p.min_t, float(ndtri(1.0 - p.alpha / (n_rows * splits.size))))
    # A best split at the first one allowed may stand for an earlier onset the segments cannot resolve: taken
    # as an onset it would spread the excess over too few steps (more impact than there was), so it is none.
    hit = np.isfinite(t) & (t >= bound) & (d >= math.log1p(p.min_shift)) & (k > p.min_segment)
    out[hit] = keep[k[hit]]
    return out


def _seg_median(x: F64, k: I64, lower: bool) -> F64:
    """Per row of ``x``, the median of its first ``k`` values (``lower``) or of the rest; one median per
    distinct split (rows sharing a split at once: a row-wise masked median is ~100x slower at 30k rows)."""
    out = np.empty(x.shape[0])
    for split in np.unique(k).tolist():
        rows = k == split
        out[rows] = np.median(x[rows, :split] if lower else x[rows, split:], axis=1)
    return out
