"""Duration modes of one kernel, matched across ranks: compare a multimodal kernel mode by mode.

One kernel name often runs at several shapes (a GEMM for the QKV projection, the MLP and the output
projection; an all-reduce of activations and one of gradient buckets), so its durations are multimodal. A
whole-mixture distance dilutes a slowdown of one mode by the mode's share of the calls: one shape ×1.35 on
one rank moves the rank's W1 score by a few percent only. Ranks of one comparison set run the same calls,
so a mode is matched across ranks by **position in the quantile function**: the calls of the k-th mode sit
at the same cumulative fractions ``u`` on every rank, whatever their durations.

:func:`reference_modes` finds the modes of the reference CDF (the pointwise median of the ranks' CDFs)
as the rises between its plateaus on the log grid, as ``u`` intervals; :func:`mode_quantiles` reads every
rank's duration at each mode's middle ``u`` (its median call of that mode). The ratio of a rank's mode
quantile to the reference's is the slowdown of that mode on that rank, undiluted by the other modes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from argus.detectors.cdf_grid import quantiles_at

__all__ = ["ReferenceModes", "mode_quantiles", "reference_modes"]

F64 = npt.NDArray[np.float64]


@dataclass(frozen=True, eq=False)
class ReferenceModes:
    """Modes of a reference CDF: per mode its ``u`` interval ``[lo, hi)`` and middle ``mid`` (share of
    the calls below the mode's median call), and its share of the calls ``width``."""

    lo: F64
    hi: F64

    @property
    def mid(self) -> F64:
        out: F64 = 0.5 * (self.lo + self.hi)
        return out

    @property
    def width(self) -> F64:
        out: F64 = self.hi - self.lo
        return out

    def __len__(self) -> int:
        return int(self.lo.size)


def reference_modes(ref_cdf: npt.ArrayLike, grid: npt.ArrayLike, min_gap_log: float = 0.1,
                    min_width: float = 0.02, flat: float = 1e-3) -> ReferenceModes:
    """The modes of ``ref_cdf`` (values on the increasing ``grid``, ns).

    A plateau is a run of grid cells where the CDF rises by less than ``flat`` (share of calls) per cell,
    spanning at least ``min_gap_log`` in ``ln(ns)`` (0.1: 10 %); the CDF's rises between plateaus are the
    modes. Modes holding less than ``min_width`` of the calls are merged into their neighbour (they are
    too few calls to compare). Always at least one mode, ``[0, 1)``.
    """
    cdf = np.asarray(ref_cdf, dtype=np.float64)
    g = np.log(np.asarray(grid, dtype=np.float64))
    rise = np.diff(cdf)
    empty = rise < flat
    cuts: list[float] = []
    i, n = 0, rise.size
    while i < n:
        if not empty[i]:
            i += 1
            continue
        j = i
        while j < n and empty[j]:
            j += 1
        if g[j] - g[i] >= min_gap_log and 0.0 < cdf[i] < 1.0 - min_width:
            cuts.append(float(cdf[i]))
        i = j
    bounds = [0.0]
    for c in cuts:
        if c - bounds[-1] >= min_width:
            bounds.append(c)
    if 1.0 - bounds[-1] < min_width and len(bounds) > 1:
        bounds.pop()
    bounds.append(1.0)
    b = np.asarray(bounds)
    return ReferenceModes(b[:-1], b[1:])


def mode_quantiles(cdf: npt.ArrayLike, grid: npt.ArrayLike, u: npt.ArrayLike) -> F64:
    """Per row of ``cdf`` (``R x G`` on ``grid``) its quantiles at levels ``u`` (``J``): an ``R x J``
    array in ns, interpolated log-linearly between grid points.

    The grid point above level ``q`` is the count of a row's values below ``q`` (clipped to
    ``[1, G - 1]``); for a nondecreasing row (every CDF) that count is the first index whose value reaches
    ``q``, found in one pass over the grid for every row and level (:func:`~argus.detectors.cdf_grid.
    quantiles_at`).
    """
    lg = np.log(np.asarray(grid, dtype=np.float64))
    return quantiles_at(np.asarray(cdf, dtype=np.float64), lg, np.asarray(u, dtype=np.float64))
