"""Log-normal mixtures rebuilt from cluster summaries, and 1-Wasserstein distances between them.

A window's kernel durations on a rank are stored only as clusters (see :mod:`argus.detectors.kde_clusters`).
Each cluster becomes one log-normal component: weight = its count, median = its p50, and a spread
that puts the component's 99th percentile at the cluster's p99, i.e. ``mu = ln p50`` and
``sigma = (ln p99 - ln p50) / z_0.99``. The 1-Wasserstein distance between two such mixtures is
``integral |F_a(x) - F_b(x)| dx`` over durations, so it is in nanoseconds: "how many ns of work per
kernel would have to move" to turn one rank's distribution into another's. It grows both with a
shifted median and with a fattened tail, which is what fail-slow looks like.

Integrals are trapezoids on a shared geometric grid (default 1024 points) that spans every
component's ``median * exp(+-5 sigma)``; CDF mass outside that range (< 3e-7 per component) is
ignored, and the relative resolution is ``ln(hi / lo) / points``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias

import numpy as np
import numpy.typing as npt
from scipy.special import ndtri

from argus.core.errors import DetectorError
from argus.detectors.cdf_grid import grid_cdfs, median_sample, pointwise_median
from argus.detectors.kde_clusters import ClusterSet

__all__ = [
    "GRID_POINTS",
    "MIN_SIGMA",
    "TAIL_SIGMAS",
    "Z99",
    "Mixture",
    "MixtureBatch",
    "geometric_grid",
    "log_normal_components",
    "mixture_cdf",
    "trapezoid_weights",
    "w1_distance",
    "w1_matrix",
    "w1_to_reference",
]

F64 = npt.NDArray[np.float64]

#: The standard normal's 99th percentile (2.3263...).
Z99 = float(ndtri(0.99))
#: Floor of a component's log-space sigma (0.1 %): a cluster with p99 == p50 would be a step.
MIN_SIGMA = 1e-3
#: The default grid spans each component's median * exp(+-TAIL_SIGMAS * sigma).
TAIL_SIGMAS = 5.0
#: Default number of points of the shared geometric grid.
GRID_POINTS = 1024
# Bounds the (rows, ranks, grid) temporary of w1_matrix to ~32 MiB of float64.
_PAIRWISE_BLOCK_ELEMENTS = 1 << 22


@dataclass(frozen=True, eq=False)
class Mixture:
    """One log-normal mixture: 1-D float64 arrays of component weights, medians and p99s (ns).

    Raises :class:`DetectorError` unless the arrays are non-empty, equally long and finite, weights
    are ``>= 0`` with a positive total, ``p50_ns > 0`` and ``p99_ns >= p50_ns``.
    """

    counts: F64
    p50_ns: F64
    p99_ns: F64

    def __post_init__(self) -> None:
        cols = [_readonly(np.array(getattr(self, n), dtype=np.float64)) for n in _COMPONENT_FIELDS]
        if any(c.ndim != 1 for c in cols) or len({c.size for c in cols}) != 1 or cols[0].size == 0:
            raise DetectorError("a Mixture needs equally long, non-empty 1-D counts/p50_ns/p99_ns")
        _check_components(*cols)
        for name, col in zip(_COMPONENT_FIELDS, cols, strict=True):
            object.__setattr__(self, name, col)

    @classmethod
    def from_clusters(cls, clusters: ClusterSet) -> Mixture:
        """The mixture with one component per cluster of ``clusters``."""
        f64 = np.float64
        return cls(clusters.count.astype(f64), clusters.p50_ns.astype(f64), clusters.p99_ns.astype(f64))

    def __len__(self) -> int:
        return int(self.counts.size)


@dataclass(frozen=True, eq=False)
class MixtureBatch:
    """``R`` mixtures as ``(R, K)`` float64 arrays; rows with fewer components pad with zero counts.

    Build it with :meth:`from_mixtures` or, straight from columnar cluster rows, :meth:`from_long`.
    ``len()`` is ``R``. Raises :class:`DetectorError` under the rules of :class:`Mixture`, per row.
    """

    counts: F64
    p50_ns: F64
    p99_ns: F64

    def __post_init__(self) -> None:
        cols = [_readonly(np.array(getattr(self, n), dtype=np.float64)) for n in _COMPONENT_FIELDS]
        if any(c.ndim != 2 for c in cols) or len({c.shape for c in cols}) != 1 or cols[0].size == 0:
            raise DetectorError("a MixtureBatch needs equally shaped, non-empty (R, K) arrays")
        _check_components(*cols)
        for name, col in zip(_COMPONENT_FIELDS, cols, strict=True):
            object.__setattr__(self, name, col)

    @classmethod
    def from_mixtures(cls, mixtures: Sequence[Mixture]) -> MixtureBatch:
        """Stack ``mixtures`` (at least one) row by row."""
        if len(mixtures) == 0:
            raise DetectorError("no mixtures given")
        owner = np.repeat(np.arange(len(mixtures)), [len(m) for m in mixtures])
        return cls.from_long(
            owner,
            np.concatenate([m.counts for m in mixtures]),
            np.concatenate([m.p50_ns for m in mixtures]),
            np.concatenate([m.p99_ns for m in mixtures]),
            n_owners=len(mixtures),
        )

    @classmethod
    def from_long(
        cls,
        owner: npt.ArrayLike,
        counts: npt.ArrayLike,
        p50_ns: npt.ArrayLike,
        p99_ns: npt.ArrayLike,
        n_owners: int | None = None,
    ) -> MixtureBatch:
        """Pack component rows (``owner[i]`` = the mixture of component ``i``, 0-based) into a batch.

        ``n_owners`` defaults to ``max(owner) + 1``. Raises :class:`DetectorError` for mismatched
        lengths, owners outside ``[0, n_owners)`` or an owner without components.
        """
        o = np.asarray(owner)
        c, p50, p99 = (np.asarray(a, dtype=np.float64) for a in (counts, p50_ns, p99_ns))
        if o.ndim != 1 or o.size == 0 or o.dtype.kind not in "iu":
            raise DetectorError("owner must be a non-empty 1-D integer array")
        if not (c.shape == p50.shape == p99.shape == o.shape):
            raise DetectorError("owner, counts, p50_ns and p99_ns must be equally long 1-D arrays")
        rows = int(o.max()) + 1 if n_owners is None else n_owners
        if int(o.min()) < 0 or int(o.max()) >= rows:
            raise DetectorError(f"owner values must lie in [0, {rows})")
        per_owner = np.bincount(o, minlength=rows)
        if np.any(per_owner == 0):
            raise DetectorError(f"mixture {int(np.argmin(per_owner))} has no components")
        order = np.argsort(o, kind="stable")
        os_ = o[order]
        slot = np.arange(o.size) - (np.cumsum(per_owner) - per_owner)[os_]
        shape = (rows, int(per_owner.max()))
        out_c, out_p50, out_p99 = np.zeros(shape), np.ones(shape), np.ones(shape)
        out_c[os_, slot] = c[order]
        out_p50[os_, slot] = p50[order]
        out_p99[os_, slot] = p99[order]
        return cls(out_c, out_p50, out_p99)

    def __len__(self) -> int:
        return int(self.counts.shape[0])


_COMPONENT_FIELDS = ("counts", "p50_ns", "p99_ns")
#: What the many-mixture functions accept.
Mixtures: TypeAlias = Sequence[Mixture] | MixtureBatch


def mixture_cdf(
    counts: npt.ArrayLike, p50_ns: npt.ArrayLike, p99_ns: npt.ArrayLike, grid_ns: npt.ArrayLike
) -> F64:
    """CDF of the log-normal mixture(s) at ``grid_ns`` (ns, non-negative).

    Components are given as arrays of shape ``(K,)`` (one mixture, result ``(G,)``) or ``(R, K)``
    (``R`` mixtures, result ``(R, G)``); the weight of a component is its count. Raises
    :class:`DetectorError` as :class:`Mixture` does, or for a negative or non-finite grid.
    """
    c, p50, p99 = (np.asarray(a, dtype=np.float64) for a in (counts, p50_ns, p99_ns))
    m = Mixture(c, p50, p99) if c.ndim == 1 else MixtureBatch(c, p50, p99)
    g = np.asarray(grid_ns, dtype=np.float64)
    if g.ndim != 1 or g.size == 0 or not np.all(np.isfinite(g)) or np.any(g < 0.0):
        raise DetectorError("grid_ns must be a non-empty 1-D array of finite, non-negative ns")
    return _cdfs(m.counts, m.p50_ns, m.p99_ns, g)


def geometric_grid(*mixtures: Mixture | MixtureBatch, points: int = GRID_POINTS) -> F64:
    """A log-spaced grid (ns) covering every component's ``p50 * exp(+-TAIL_SIGMAS * sigma)``.

    Zero-weight (padding) components are ignored. Raises :class:`DetectorError` for no mixtures or
    fewer than 2 points.
    """
    if not mixtures or points < 2:
        raise DetectorError("geometric_grid needs at least one mixture and 2 points")
    lo, hi = math.inf, -math.inf
    for m in mixtures:
        mu, sigma = _log_params(m.p50_ns, m.p99_ns)
        used = m.counts > 0
        lo = min(lo, float(np.min((mu - TAIL_SIGMAS * sigma)[used])))
        hi = max(hi, float(np.max((mu + TAIL_SIGMAS * sigma)[used])))
    return np.exp(np.linspace(lo, hi, points))


def w1_distance(a: Mixture, b: Mixture, grid: npt.ArrayLike | None = None) -> float:
    """1-Wasserstein distance (ns) between two mixtures: ``integral |F_a - F_b| dx``.

    ``grid`` (ns, increasing) defaults to :func:`geometric_grid` of both mixtures. Raises
    :class:`DetectorError` for an invalid grid.
    """
    g = _grid(grid, a, b)
    fa = _cdfs(a.counts, a.p50_ns, a.p99_ns, g)
    fb = _cdfs(b.counts, b.p50_ns, b.p99_ns, g)
    return float(np.abs(fa - fb) @ trapezoid_weights(g))


def w1_matrix(mixtures: Mixtures, grid: npt.ArrayLike | None = None) -> F64:
    """Pairwise 1-Wasserstein distances (ns) of ``R`` mixtures, an ``(R, R)`` symmetric array.

    All CDFs are evaluated once on one shared grid (default :func:`geometric_grid` of all of them),
    then every pair is integrated: O(R^2 * G) time, ~4 s for 1k ranks and 100x that for 10k; use
    :func:`w1_to_reference` for whole-job scans. Memory stays ~32 MiB by working in row blocks.
    """
    batch = _as_batch(mixtures)
    g = _grid(grid, batch)
    cdf = _cdfs(batch.counts, batch.p50_ns, batch.p99_ns, g)
    w = trapezoid_weights(g)
    rows = cdf.shape[0]
    out = np.empty((rows, rows))
    block = max(1, _PAIRWISE_BLOCK_ELEMENTS // (rows * g.size))
    for start in range(0, rows, block):
        stop = min(rows, start + block)
        out[start:stop] = np.abs(cdf[start:stop, None, :] - cdf[None, :, :]) @ w
    # Row blocks compute both triangles; averaging removes the last-bit asymmetry of float sums.
    return 0.5 * (out + out.T)


def w1_to_reference(
    mixtures: Mixtures, reference: Mixture | None = None, grid: npt.ArrayLike | None = None
) -> F64:
    """1-Wasserstein distance (ns) of each of ``R`` mixtures to one reference, an ``(R,)`` array.

    ``reference`` defaults to the pointwise median of the ``R`` CDFs (itself a CDF; of a fixed sample
    of 513 of them beyond that many, :func:`~argus.detectors.cdf_grid.median_sample`): a consensus
    that a minority of slow ranks cannot drag, so each rank's distance says how far it strays from
    the job's typical behaviour. O(R * K * G) time and O(R * G) memory, the scalable choice for 10k
    ranks where :func:`w1_matrix` is O(R^2 * G). ``grid`` defaults to :func:`geometric_grid` of
    all mixtures and the reference.
    """
    batch = _as_batch(mixtures)
    g = _grid(grid, batch) if reference is None else _grid(grid, batch, reference)
    cdf = _cdfs(batch.counts, batch.p50_ns, batch.p99_ns, g)
    if reference is None:
        ref = pointwise_median(cdf[median_sample(cdf.shape[0])])
    else:
        ref = _cdfs(reference.counts, reference.p50_ns, reference.p99_ns, g)
    out: F64 = np.abs(cdf - ref) @ trapezoid_weights(g)
    return out


def _as_batch(mixtures: Mixtures) -> MixtureBatch:
    return mixtures if isinstance(mixtures, MixtureBatch) else MixtureBatch.from_mixtures(mixtures)


def _grid(grid: npt.ArrayLike | None, *mixtures: Mixture | MixtureBatch) -> F64:
    if grid is None:
        return geometric_grid(*mixtures)
    g = np.asarray(grid, dtype=np.float64)
    if g.ndim != 1 or g.size < 2 or not np.all(np.isfinite(g)) or np.any(g < 0.0):
        raise DetectorError("grid must be a 1-D array of at least 2 finite, non-negative ns")
    if np.any(np.diff(g) <= 0.0):
        raise DetectorError("grid must be strictly increasing")
    return g


def log_normal_components(counts: F64, p50_ns: F64, p99_ns: F64) -> tuple[F64, F64, F64]:
    """The components' log-space medians ``ln p50``, sigmas ``(ln p99 - ln p50) / Z99`` (at least
    :data:`MIN_SIGMA`) and weights (counts over each mixture's total), for ``(..., K)`` arrays."""
    mu, sigma = _log_params(p50_ns, p99_ns)
    return mu, sigma, counts / counts.sum(axis=-1, keepdims=True)


def trapezoid_weights(grid: F64) -> F64:
    """Weights ``w`` such that ``f @ w`` is the trapezoid integral over ``grid`` (ns) of values ``f`` on it."""
    step = np.diff(grid)
    w = np.zeros(grid.size)
    w[:-1] += 0.5 * step
    w[1:] += 0.5 * step
    return w


def _log_params(p50_ns: F64, p99_ns: F64) -> tuple[F64, F64]:
    mu = np.log(p50_ns)
    sigma = np.maximum((np.log(p99_ns) - mu) / Z99, MIN_SIGMA)
    return mu, sigma


def _cdfs(counts: F64, p50_ns: F64, p99_ns: F64, grid: F64) -> F64:
    """CDFs on ``grid`` of mixtures given as ``(..., K)`` arrays; result ``(..., G)`` (evaluated as
    :func:`argus.detectors.cdf_grid.grid_cdfs` does)."""
    # ln(0) = -inf is the right limit (F = 0) but warns; the smallest normal float gives the same F.
    log_grid = np.log(np.maximum(grid, np.finfo(np.float64).tiny))
    lead, k_comp = counts.shape[:-1], counts.shape[-1]
    mu, sigma, weight = (a.reshape(-1, k_comp) for a in log_normal_components(counts, p50_ns, p99_ns))
    out = grid_cdfs(mu, sigma, weight, log_grid)
    return out.reshape(*lead, grid.size)


def _check_components(counts: F64, p50_ns: F64, p99_ns: F64) -> None:
    if not (np.all(np.isfinite(counts)) and np.all(np.isfinite(p50_ns)) and np.all(np.isfinite(p99_ns))):
        raise DetectorError("mixture components contain NaN or infinite values")
    if np.any(counts < 0.0) or np.any(counts.sum(axis=-1) <= 0.0):
        raise DetectorError("component counts must be >= 0 with a positive total per mixture")
    if np.any(p50_ns <= 0.0):
        raise DetectorError("component p50_ns must be > 0")
    if np.any(p99_ns < p50_ns):
        raise DetectorError("component p99_ns must be >= p50_ns")


def _readonly(a: F64) -> F64:
    a.flags.writeable = False
    return a
