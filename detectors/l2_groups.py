"""Group statistics of L2 (:mod:`argus.detectors.l2_phases`): per-cell and leave-one-out medians, and the
late arrivals that are victims of a straggler rather than stragglers themselves."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from argus.core.errors import DetectorError

__all__ = ["cell_median", "loo_median", "loo_median_rows"]

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
#: Groups whose collectives block the compute stream mid-step: waiting there delays all that follows.


def cell_median(cell: I64, values: F64, size: int) -> F64:
    """Median of ``values`` per integer ``cell`` in ``[0, size)``; NaN for empty cells. Vectorized.

    When every non-empty cell holds equally many values (a value per step, the usual table), the cells
    are grouped by a stable sort of the cells alone (the table lists them in runs, one per step) and the
    medians taken along the rows of a ``cells x values`` array; otherwise by a sort of (cell, value)."""
    if values.size == 0:
        return np.full(size, np.nan)
    order = np.argsort(cell, kind="stable")
    c = cell[order]
    if int(c[0]) >= 0 and int(c[-1]) < size:
        n = np.bincount(c, minlength=size)
        filled = n > 0
        per = n[filled]
        if int(per.min()) == int(per.max()):
            out = np.full(size, np.nan)
            out[filled] = np.median(values[order].reshape(-1, int(per[0])), axis=1)
            return out
    order = np.lexsort((values, cell))
    c, v = cell[order], values[order]
    cells = np.arange(size)
    lo, hi = np.searchsorted(c, cells, "left"), np.searchsorted(c, cells, "right")
    n = hi - lo
    a = v[np.clip(lo + (n - 1) // 2, 0, v.size - 1)]
    b = v[np.clip(lo + n // 2, 0, v.size - 1)]
    return np.where(n > 0, (a + b) / 2.0, np.nan)


def loo_median(values: npt.ArrayLike) -> F64:
    """Leave-one-out medians: ``out[i]`` is the median of ``values`` without entry ``i`` (NaN if n < 2).

    O(n log n) via one sort. Raises :class:`DetectorError` for a non-1-D input.
    """
    v = np.asarray(values, dtype=np.float64)
    if v.ndim != 1:
        raise DetectorError("loo_median needs a 1-D array")
    out: F64 = loo_median_rows(v[None, :])[0]
    return out


def loo_median_rows(values: npt.ArrayLike) -> F64:
    """:func:`loo_median` of each row of a 2-D array, at once (the same values row by row).

    Raises :class:`DetectorError` for a non-2-D input.
    """
    v = np.asarray(values, dtype=np.float64)
    if v.ndim != 2:
        raise DetectorError("loo_median_rows needs a 2-D array")
    n = v.shape[1]
    if n < 2:
        return np.full(v.shape, np.nan)
    m = n - 1
    lo = (m - 1) // 2 if m % 2 else m // 2 - 1
    # Only the order statistics around the middle are read: the j-th smallest value once an entry is removed is
    # the (j + 1)-th of the row where the entry is at most the j-th (ties give the same value either way), else
    # the j-th. NaN sorts last and compares false: the same values as a full sort.
    kth = list(range(lo, min(lo + 3, n)))
    s = np.partition(v, kth, axis=1)

    def remaining(j: int) -> F64:
        out: F64 = np.where(v <= s[:, j, None], s[:, min(j + 1, n - 1), None], s[:, j, None])
        return out

    if m % 2:
        return remaining(lo)
    return 0.5 * (remaining(lo) + remaining(lo + 1))
