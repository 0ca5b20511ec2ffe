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

__all__ = ["ReferenceModes", "mode_quantiles", "reference_modes"]

F64 = npt.NDArray[np.float64]
#: Columns per block of the prefix count in :func:`_count_below`.
_BLOCK = 32


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
    array in ns, interpolated log-linearly between grid points. Vectorized over rows and levels.

    The grid point above level ``q`` is the count of a row's values below ``q`` (clipped to
    ``[1, G - 1]``); for a nondecreasing row (every CDF, unless rounding breaks it) that count is the
    first index whose value reaches ``q``, found by a binary search instead of a pass over the row.
    """
    c = np.asarray(cdf, dtype=np.float64)
    lg = np.log(np.asarray(grid, dtype=np.float64))
    levels = np.asarray(u, dtype=np.float64).reshape(-1)
    rows = np.arange(c.shape[0])[:, None]
    below = _count_below(c, levels)
    hi = np.clip(below, 1, lg.size - 1)
    c0, c1 = c[rows, hi - 1], c[rows, hi]
    t = np.clip((levels - c0) / np.maximum(c1 - c0, 1e-12), 0.0, 1.0)
    out: F64 = np.exp(lg[hi - 1] + t * (lg[hi] - lg[hi - 1]))
    return out


def _count_below(c: F64, levels: F64) -> npt.NDArray[np.int64]:
    """``(c[r] < q).sum()`` per row ``r`` of ``c`` and level ``q``: an ``R x J`` array.

    In a nondecreasing row the values below ``q`` are a prefix, ending in the first block of ``_BLOCK``
    columns whose last value is not below ``q``; a binary search inside that block finds its end. Other
    rows are counted in full."""
    n_rows, g = c.shape
    out = np.zeros((n_rows, levels.size), dtype=np.int64)
    if g == 0 or n_rows == 0 or levels.size == 0:
        return out
    monotone = np.all(c[:, 1:] >= c[:, :-1], axis=1)
    at = np.flatnonzero(monotone)
    last = np.minimum(np.arange(_BLOCK - 1, g + _BLOCK - 1, _BLOCK), g - 1)  # each block's last column
    below = (c[at[:, None], last][:, :, None] < levels).sum(axis=1)  # (rows, J): blocks wholly below
    lo = np.minimum(below * _BLOCK, g)  # a last, shorter block wholly below: all g values
    hi = np.minimum(lo + _BLOCK, g)
    flat, base = c.reshape(-1), (at * g)[:, None]
    for _ in range(_BLOCK.bit_length()):  # lo ends at the block's first value >= q (hi: none in the row)
        mid = (lo + hi) >> 1
        less = flat[base + np.minimum(mid, g - 1)] < levels
        open_ = lo < hi
        lo = np.where(open_ & less, mid + 1, lo)
        hi = np.where(open_ & ~less, mid, hi)
    out[at] = lo
    rest = np.flatnonzero(~monotone)
    if rest.size:
        sub = c[rest]
        out[rest] = np.stack([(sub < q).sum(axis=1) for q in levels.tolist()], axis=1)  # level by level: R x G
    return out
