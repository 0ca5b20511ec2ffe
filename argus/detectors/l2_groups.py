"""Group statistics of L2 (:mod:`argus.detectors.l2_phases`): per-cell and leave-one-out medians, and the
late arrivals that are victims of a straggler rather than stragglers themselves."""

from __future__ import annotations

import numba
import numpy as np
import numpy.typing as npt

from argus.core.errors import DetectorError

__all__ = ["MAD_SCALE", "cell_median", "loo_median", "loo_median_rows", "row_spreads"]

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
#: The median absolute deviation's consistency constant for a normal (1 / Phi^-1(3/4)): MAD x it estimates sigma.
MAD_SCALE = 1.4826
#: Longest row row_spreads sorts by insertion (beyond, numpy's partitions along the rows cost less).
_SHORT_ROW = 48


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


def row_spreads(values: F64) -> tuple[F64, F64, F64]:
    """Per row of ``values`` (2-D, float64, at least 2 columns): the leave-one-out medians
    (:func:`loo_median_rows`), the median and the median absolute deviation from it (``rows x 1`` each), the
    very values numpy gives (``np.median``). Short rows without NaN (the TP and PP groups of a table of times:
    thousands of rows of a few members) in one compiled pass, sorted by insertion; numpy's partitions
    otherwise (a row's statistic in a vectorized call costs less there)."""
    if values.ndim != 2 or values.shape[1] < 2:
        raise DetectorError("row_spreads needs a 2-D array of at least 2 columns")
    v = np.ascontiguousarray(values, dtype=np.float64)
    if v.shape[1] > _SHORT_ROW or np.isnan(v).any():
        med = np.median(v, axis=1, keepdims=True)
        return loo_median_rows(v), med, np.median(np.abs(v - med), axis=1, keepdims=True)
    loo, med, mad = _row_spreads(v)
    return loo, med[:, None], mad[:, None]


@numba.njit(cache=True, nogil=True)
def _sorted_into(out: F64, row: F64) -> None:  # pragma: no cover - compiled
    """``row`` (no NaN, a few values) sorted into ``out``, by insertion."""
    for i in range(row.size):
        x = row[i]
        j = i
        while j > 0 and out[j - 1] > x:
            out[j] = out[j - 1]
            j -= 1
        out[j] = x


@numba.njit(cache=True, nogil=True)
def _row_spreads(v: F64) -> tuple[F64, F64, F64]:  # pragma: no cover - compiled
    rows, n = v.shape
    loo = np.empty((rows, n))
    med, mad = np.empty(rows), np.empty(rows)
    m = n - 1
    lo = (m - 1) // 2 if m % 2 else m // 2 - 1
    s, dev, d = np.empty(n), np.empty(n), np.empty(n)
    for r in range(rows):
        row = v[r]
        _sorted_into(s, row)
        # As np.median: the mean of the middle two (their sum halved), or the middle one.
        mid = (s[(n - 1) // 2] + s[n // 2]) / 2.0 if n % 2 == 0 else s[n // 2]
        med[r] = mid
        # As loo_median_rows: the j-th smallest once an entry is removed is the (j + 1)-th where the entry is
        # at most the j-th, else the j-th.
        for i in range(n):
            x = row[i]
            a = s[lo + 1] if x <= s[lo] else s[lo]
            if m % 2:
                loo[r, i] = a
            else:
                b = s[min(lo + 2, n - 1)] if x <= s[lo + 1] else s[lo + 1]
                loo[r, i] = 0.5 * (a + b)
        for i in range(n):
            dev[i] = abs(row[i] - mid)
        _sorted_into(d, dev)
        mad[r] = (d[(n - 1) // 2] + d[n // 2]) / 2.0 if n % 2 == 0 else d[n // 2]
    return loo, med, mad
