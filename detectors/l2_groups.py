"""Group statistics of L2 (:mod:`detectors.l2_phases`): per-cell and leave-one-out medians, and the
late arrivals that are victims of a straggler rather than stragglers themselves."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from argus.errors import DetectorError
from schemas.records import JobTopology

__all__ = ["cell_median", "loo_median", "waiting_victims"]

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
#: Groups whose collectives block the compute stream mid-step: waiting there delays all that follows.
_BLOCKING_COLUMNS = ("tp_group", "pp_group", "ep_group")


def cell_median(cell: I64, values: F64, size: int) -> F64:
    """Median of ``values`` per integer ``cell`` in ``[0, size)``; NaN for empty cells. Vectorized."""
    order = np.lexsort((values, cell))
    c, v = cell[order], values[order]
    cells = np.arange(size)
    lo, hi = np.searchsorted(c, cells, "left"), np.searchsorted(c, cells, "right")
    n = hi - lo
    if v.size == 0:
        return np.full(size, np.nan)
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
    n = v.size
    if n < 2:
        return np.full(n, np.nan)
    order = np.argsort(v, kind="stable")
    s = v[order]
    pos = np.empty(n, dtype=np.int64)
    pos[order] = np.arange(n)

    def remaining(j: int) -> F64:  # j-th smallest value once the entry at sorted position pos is removed
        out: F64 = np.where(j < pos, s[min(j, n - 1)], s[min(j + 1, n - 1)])
        return out

    m = n - 1
    if m % 2:
        return remaining((m - 1) // 2)
    return 0.5 * (remaining(m // 2 - 1) + remaining(m // 2))


def waiting_victims(stragglers: set[int], late: set[int], topology: JobTopology) -> set[int]:
    """The ``late`` arrivals that waited for a straggler: those sharing a TP, PP or EP group with one of
    ``stragglers`` (e.g. its TP partner, held up in their blocking TP all-reduce and so late to its DP
    all-reduce), then those sharing one with such a victim (e.g. the victim's next pipeline stage), and
    so on. A shared DP group is no link: the DP all-reduce ends the step, nothing waits behind it.
    ``stragglers`` themselves are never victims."""
    pos = {r: i for i, r in enumerate(topology.rank)}
    columns = [np.asarray(getattr(topology, c)) for c in _BLOCKING_COLUMNS]

    def shares(r: int, s: int) -> bool:
        return any(col[pos[s]] == col[pos[r]] for col in columns)

    victims: set[int] = set()
    frontier = set(stragglers)
    while frontier:
        frontier = {r for r in late - stragglers - victims if any(shares(r, s) for s in frontier)}
        victims |= frontier
    return victims
