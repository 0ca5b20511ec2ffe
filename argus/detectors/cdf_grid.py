"""Log-normal mixture CDFs on a shared grid, and the per-rank reductions L3 reads from them, compiled.

L3 evaluates ``R`` mixtures (one per rank, ``K`` components each) on one grid of ``G`` points: the
pointwise median of the CDFs is the reference, and each rank's 1-Wasserstein distance and signed shift to
it and its quantiles at given levels are read off its CDF. At 10,240 ranks x 512 points that is ~10 M
component terms per (kernel, window); scipy's ``ndtr`` costs ~20 ns a term and numpy's median over the
rank axis ~20 ns a value, which kept numpy alone near half a second per window against a 100 ms budget.
These kernels (numba, compiled once per process and cached on disk) do the same arithmetic:
see docs/internals/detectors.md.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import numpy.typing as npt
from scipy.special import ndtr

from argus.core.errors import DetectorError

__all__ = [
    "MEDIAN_SAMPLE",
    "grid_cdfs",
    "median_sample",
    "pointwise_median",
    "quantiles_at",
    "sample_reference",
    "score_against",
]

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]

#: ``ndtr(z)`` rounds to exactly 1.0 from z ~ 8.29 on; above this bound a component's term is its weight.
_Z_HIGH = 8.375
#: ``ndtr(-8.375) ~ 3e-17``: below it a term is under half an ulp of 1.0 of the weight, and left out.
_Z_LOW = -8.375
#: Table steps per unit of z (a power of two: the table's z values are exact binary fractions).
_CELLS_PER_Z = 1024
#: Rows per tile of the reference kernel (its scratch, 32 x G float64, stays in cache).
_TILE = 32
#: The reference median reads at most this many ranks (a fixed sample of larger sets, see median_sample).
MEDIAN_SAMPLE = 513
# The interpolation's multiply-adds may be fused (one rounding instead of two); nothing is reordered.
_FAST = {"contract"}


def _hermite_table() -> F64:
    """Per table step ``[z_i, z_i + 1/_CELLS_PER_Z)``: the cubic ``c0 + f (c1 + f (c2 + f c3))`` in the step's
    fraction ``f`` that matches ``ndtr`` and its derivative at both ends (an ``(N, 4)`` array)."""
    z = _Z_LOW + np.arange(round((_Z_HIGH - _Z_LOW) * _CELLS_PER_Z) + 2) / _CELLS_PER_Z
    phi = ndtr(z)
    slope = np.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi) / _CELLS_PER_Z  # d ndtr / d f
    out = np.empty((z.size - 1, 4))
    out[:, 0], out[:, 1] = phi[:-1], slope[:-1]
    out[:, 2] = 3.0 * (phi[1:] - phi[:-1]) - 2.0 * slope[:-1] - slope[1:]
    out[:, 3] = 2.0 * (phi[:-1] - phi[1:]) + slope[:-1] + slope[1:]
    return out


_HERMITE = _hermite_table()
#: "No reference" for :func:`_row_cdf`.
_NONE = np.empty(0)


@numba.njit(cache=True, nogil=True, fastmath=_FAST)
def _row_cdf(row: F64, log_grid: F64, mu: F64, sigma: F64, weight: F64, coef: F64, ref: F64,
             trap: F64) -> tuple[float, float]:  # pragma: no cover - compiled
    """``row`` = the CDF of one mixture (``K`` components) at ``log_grid`` (increasing). Each component is
    evaluated in its window only, and its weight added to every point above the window; the row is then made
    nondecreasing. With a reference CDF ``ref`` (else empty) it integrates ``|ref - row| @ trap`` and
    ``(ref - row) @ trap``.

    Every pass but the Hermite windows runs without a loop-carried chain the compiler cannot split (they set
    the cost of a row): the weights are added point by point, the row is only checked for order (a running
    maximum, one serial pass, runs only where rounding left a value below its neighbour), and the integrals
    are summed in four interleaved partial sums."""
    g = log_grid.size
    top = coef.shape[0] - 1
    row[:] = 0.0
    for k in range(mu.size):
        w = weight[k]
        if w == 0.0:
            continue
        m, s = mu[k], sigma[k]
        inv = 1.0 / s
        ja = np.searchsorted(log_grid, m + _Z_LOW * s)
        jb = np.searchsorted(log_grid, m + _Z_HIGH * s, side="right")
        for j in range(ja, jb):
            z = (log_grid[j] - m) * inv
            if z > _Z_HIGH:
                row[j] += w
            elif z >= _Z_LOW:
                t = (z - _Z_LOW) * _CELLS_PER_Z
                i = min(int(t), top)
                f = t - i
                row[j] += w * (coef[i, 0] + f * (coef[i, 1] + f * (coef[i, 2] + f * coef[i, 3])))
        for j in range(jb, g):
            row[j] += w
    ordered = row[0] >= 0.0
    for j in range(1, g):
        ordered &= row[j] >= row[j - 1]
    if not ordered:
        last = 0.0
        for j in range(g):
            last = max(row[j], last)
            row[j] = last
    if ref.size == 0:
        return 0.0, 0.0
    a0, a1, a2, a3, b0, b1, b2, b3 = 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
    full = g - g % 4
    for j in range(0, full, 4):
        d0, d1, d2, d3 = ref[j] - row[j], ref[j + 1] - row[j + 1], ref[j + 2] - row[j + 2], ref[j + 3] - row[j + 3]
        a0, a1 = a0 + abs(d0) * trap[j], a1 + abs(d1) * trap[j + 1]
        a2, a3 = a2 + abs(d2) * trap[j + 2], a3 + abs(d3) * trap[j + 3]
        b0, b1 = b0 + d0 * trap[j], b1 + d1 * trap[j + 1]
        b2, b3 = b2 + d2 * trap[j + 2], b3 + d3 * trap[j + 3]
    for j in range(full, g):
        d = ref[j] - row[j]
        a0 += abs(d) * trap[j]
        b0 += d * trap[j]
    return (a0 + a1) + (a2 + a3), (b0 + b1) + (b2 + b3)


@numba.njit(cache=True, nogil=True)
def _row_quantiles(row: F64, log_grid: F64, levels: F64, out: F64, monotone: bool) -> None:  # pragma: no cover
    """``out[q]``: the log-quantile (ln ns) of one row of CDF values at ``levels[q]``, linear between grid points
    (the callers exponentiate a whole array at once, by numpy's vectorized exp).
    The grid point above a level is the count of the row's values below it, clipped to ``[1, G - 1]``: in a
    nondecreasing row the first value not below it, by binary search; otherwise counted in full.
    ``monotone``: the row is known to be nondecreasing (else it is checked)."""
    g = row.size
    if not monotone:
        monotone = True
        for j in range(1, g):
            if row[j] < row[j - 1]:
                monotone = False
                break
    for q in range(levels.size):
        u = levels[q]
        if monotone:
            # The count lies in [base, base + n]; halved without a branch (which the levels mispredict).
            base, n = 0, g
            while n > 1:
                half = n >> 1
                base += half * (row[base + half] < u)
                n -= half
            below = base + (row[base] < u)
        else:
            below = 0
            for j in range(g):
                if row[j] < u:
                    below += 1
        at = min(max(below, 1), g - 1)
        c0, c1 = row[at - 1], row[at]
        t = min(max((u - c0) / max(c1 - c0, 1e-12), 0.0), 1.0)
        out[q] = log_grid[at - 1] + t * (log_grid[at] - log_grid[at - 1])  # ln ns: exponentiated by the caller


@numba.njit(cache=True, nogil=True)
def _cdf_kernel(out: F64, log_grid: F64, mu: F64, sigma: F64, weight: F64,
                coef: F64) -> None:  # pragma: no cover - compiled
    for r in range(mu.shape[0]):
        _row_cdf(out[r], log_grid, mu[r], sigma[r], weight[r], coef, _NONE, _NONE)


@numba.njit(cache=True, nogil=True)
def _score_kernel(log_grid: F64, mu: F64, sigma: F64, weight: F64, coef: F64, ref: F64, w: F64, levels: F64,
                  w1: F64, shift: F64, quant: F64) -> None:  # pragma: no cover - compiled
    row = np.empty(log_grid.size)
    for r in range(mu.shape[0]):
        w1[r], shift[r] = _row_cdf(row, log_grid, mu[r], sigma[r], weight[r], coef, ref, w)
        _row_quantiles(row, log_grid, levels, quant[r], True)  # _row_cdf's rows never decrease


@numba.njit(cache=True, nogil=True)
def _quantile_kernel(cdf: F64, log_grid: F64, levels: F64, out: F64) -> None:  # pragma: no cover - compiled
    for r in range(cdf.shape[0]):
        _row_quantiles(cdf[r], log_grid, levels, out[r], False)


@numba.njit(cache=True, nogil=True)
def _reference_points(log_grid: F64, mu: F64, sigma: F64, weight: F64, coef: F64,
                      rows: I64) -> F64:  # pragma: no cover - compiled
    """The mixtures' CDFs of ``rows`` at ``log_grid``, grid-major (``G x rows``: each point's values contiguous):
    built a tile of ``_TILE`` rows at a time."""
    n, g = rows.size, log_grid.size
    by_point = np.empty((g, n))
    tile = np.empty((_TILE, g))
    for q0 in range(0, n, _TILE):
        m = min(n, q0 + _TILE) - q0
        for t in range(m):
            r = rows[q0 + t]
            _row_cdf(tile[t], log_grid, mu[r], sigma[r], weight[r], coef, _NONE, _NONE)
        for j in range(g):
            for t in range(m):
                by_point[j, q0 + t] = tile[t, j]
    return by_point


def _row_medians(by_point: F64) -> F64:
    """Per row of ``by_point``, its median as ``np.median`` gives it: the middle order statistics from numpy's
    partition (vectorized; ~2.5x a compiled selection), averaged as ``np.median`` averages them."""
    n = by_point.shape[1]
    if n == 0 or np.isnan(by_point).any():
        out: F64 = np.median(by_point, axis=1)
        return out
    half = n // 2
    part = np.partition(by_point, [half - 1, half] if n % 2 == 0 else [half], axis=1)
    if n % 2:
        return np.ascontiguousarray(part[:, half])
    mid: F64 = np.mean(part[:, half - 1:half + 1], axis=1)
    return mid


def grid_cdfs(mu: F64, sigma: F64, weight: F64, log_grid: F64) -> F64:
    """CDFs of ``R`` log-normal mixtures (``(R, K)`` log-medians, log-sigmas > 0 and weights summing to 1
    per row; zero weights are padding) at ``log_grid`` (``G`` values of ln ns, any order): ``(R, G)``."""
    c = np.ascontiguousarray
    lg = c(log_grid, dtype=np.float64)
    order = None
    if lg.size > 1 and bool(np.any(lg[1:] < lg[:-1])):  # the kernel's windows need an increasing grid
        order = np.argsort(lg, kind="stable")
        lg = lg[order]
    out = np.empty((mu.shape[0], lg.size))
    _cdf_kernel(out, lg, c(mu, dtype=np.float64), c(sigma, dtype=np.float64), c(weight, dtype=np.float64),
                _HERMITE)
    if order is not None:
        back = np.empty_like(out)
        back[:, order] = out
        out = back
    return out


def score_against(mu: F64, sigma: F64, weight: F64, log_grid: F64, ref: F64, weights: F64,
                  levels: F64) -> tuple[F64, F64, F64]:
    """Per mixture (arguments as :func:`grid_cdfs`; ``log_grid`` increasing): its W1 to the CDF ``ref`` on
    the grid (``|ref - F| @ weights``, ns with trapezoid ``weights``), its signed shift (``(ref - F) @
    weights``, > 0: slower than ``ref``) and its quantiles (ns) at ``levels`` (``(R, J)``, as
    :func:`quantiles_at` reads them). Raises :class:`DetectorError` for a grid that is not increasing."""
    c = np.ascontiguousarray
    lg = c(log_grid, dtype=np.float64)
    if lg.size < 2 or bool(np.any(lg[1:] <= lg[:-1])):
        raise DetectorError("score_against needs an increasing grid of at least 2 points")
    lv = c(levels, dtype=np.float64).reshape(-1)
    n = mu.shape[0]
    w1, shift, quant = np.empty(n), np.empty(n), np.empty((n, lv.size))
    _score_kernel(lg, c(mu, dtype=np.float64), c(sigma, dtype=np.float64), c(weight, dtype=np.float64),
                  _HERMITE, c(ref, dtype=np.float64), c(weights, dtype=np.float64), lv, w1, shift, quant)
    return w1, shift, np.exp(quant, out=quant)


def sample_reference(mu: F64, sigma: F64, weight: F64, log_grid: F64, rows: I64) -> F64:
    """The pointwise median over ``rows`` of the mixtures' CDFs (arguments as :func:`grid_cdfs`,
    ``log_grid`` increasing), as ``np.median(grid_cdfs(...)[rows], axis=0)`` gives it, without the array."""
    c = np.ascontiguousarray
    return _row_medians(_reference_points(c(log_grid, dtype=np.float64), c(mu, dtype=np.float64),
                                          c(sigma, dtype=np.float64), c(weight, dtype=np.float64), _HERMITE,
                                          c(rows, dtype=np.int64).reshape(-1)))


def median_sample(n_rows: int, limit: int = MEDIAN_SAMPLE) -> I64:
    """The rows a reference median reads: all ``n_rows`` up to ``limit``, else a fixed sample of ``limit``.

    The sample depends on ``n_rows`` only (a seeded permutation), so one input always gives one answer;
    random rather than strided, so it cannot alias with a topology's period (every 8th rank one TP position).
    The sample median's standard error is ~1.25 / sqrt(limit) of the ranks' spread (~6 % at 513): the
    job's typical CDF, at a fixed cost per grid point however many ranks there are.
    """
    if n_rows <= limit:
        return np.arange(n_rows, dtype=np.int64)
    pick = np.random.default_rng(n_rows).choice(n_rows, size=limit, replace=False)
    return np.sort(pick).astype(np.int64)


def pointwise_median(cdf: F64) -> F64:
    """Per grid point (column of the ``(R, G)`` ``cdf``), the median over the rows, as ``np.median(cdf,
    axis=0)`` gives it."""
    return _row_medians(np.ascontiguousarray(np.asarray(cdf, dtype=np.float64).T))


def quantiles_at(cdf: F64, log_grid: F64, levels: F64) -> F64:
    """Per row of the ``(R, G)`` ``cdf`` its quantiles (ns) at ``levels``: an ``(R, J)`` array, log-linear
    between grid points (see :func:`_row_quantiles`)."""
    lv = np.ascontiguousarray(levels, dtype=np.float64).reshape(-1)
    c = np.ascontiguousarray(cdf, dtype=np.float64)
    out = np.empty((c.shape[0], lv.size))
    _quantile_kernel(c, np.ascontiguousarray(log_grid, dtype=np.float64), lv, out)
    return np.exp(out, out=out)
