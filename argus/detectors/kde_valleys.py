"""The compiled inner loops of :func:`argus.detectors.kde_clusters.cluster_by_group`: group coding and the
KDE valley cuts of every group of a window in one call.

A window of one rank holds ~20k kernel events in ~15 (kernel, stream) groups. Done with numpy, each group
costs ~25 small array calls (std, linspace, two bincounts, a convolution, scipy's ``find_peaks`` and
``peak_prominences``, a stable argsort): ~0.35 ms of call overhead per group, most of the compression
agent's time. These kernels (numba, compiled once and cached on disk) do the same arithmetic per group
without leaving compiled code: see docs/internals/detectors.md.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import numpy.typing as npt

__all__ = ["KERNEL_SUPPORT", "dense_codes", "radix_sort", "valley_cuts"]

I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]

# The thresholds (bandwidth floor, isolated gap, grid margin) are fields of KdeParams, passed in as arguments;
# the constants below fix the numerics (truncation, discretisation, hashing), not what counts as a cluster.

#: Kernel support in bandwidths, a numerical constant (where the Gaussian is truncated): exp(-12.5) ~ 4e-6 of
#: the peak is far below what moves a valley.
KERNEL_SUPPORT = 5.0
#: Grid points per bandwidth, a numerical constant (the discretisation): enough to resolve the density; small
#: groups (wide h) need few points.
_POINTS_PER_BANDWIDTH = 10.0
#: Integral of the squared standard Gaussian kernel, a mathematical constant: sets the KDE's pointwise variance.
_KERNEL_ROUGHNESS = 1.0 / (2.0 * math.sqrt(math.pi))
#: Fibonacci hashing multiplier (2^64 / golden ratio), a hashing constant for the open-addressing table of
#: dense_codes.
_FIB = np.uint64(0x9E3779B97F4A7C15)


@numba.njit(cache=True, nogil=True)
def _dense_codes(g: I64) -> tuple[I64, I64]:  # pragma: no cover - compiled
    n = g.size
    bits = 4
    while (1 << bits) < 2 * n:
        bits += 1
    size = 1 << bits
    shift = np.uint64(64 - bits)
    keys = np.empty(size, dtype=np.int64)
    used = np.zeros(size, dtype=np.bool_)
    slot_rank = np.full(size, -1, dtype=np.int64)
    slots = np.empty(n, dtype=np.int64)
    distinct = np.empty(n, dtype=np.int64)  # slot of each distinct id, in order of first appearance
    m = 0
    for i in range(n):
        k = g[i]
        s = np.int64((np.uint64(k) * _FIB) >> shift)
        while used[s] and keys[s] != k:
            s = (s + 1) & (size - 1)
        if not used[s]:
            used[s] = True
            keys[s] = k
            distinct[m] = s
            m += 1
        slots[i] = s
    uniq = np.empty(m, dtype=np.int64)
    for j in range(m):
        uniq[j] = keys[distinct[j]]
    uniq.sort()
    for j in range(m):
        s = distinct[j]
        slot_rank[s] = np.searchsorted(uniq, keys[s])
    codes = np.empty(n, dtype=np.int64)
    for i in range(n):
        codes[i] = slot_rank[slots[i]]
    return codes, uniq


def dense_codes(group_ids: I64) -> tuple[I64, I64]:
    """``(codes, uniq)``: the sorted distinct values of ``group_ids`` (int64) and, per entry, the index of its
    value in ``uniq`` (so ``uniq[codes] == group_ids``)."""
    return _dense_codes(np.ascontiguousarray(group_ids, dtype=np.int64))


@numba.njit(cache=True, nogil=True)
def _radix_sort(keys: I64, bits: int) -> I64:  # pragma: no cover - compiled
    digit = 11
    mask = (1 << digit) - 1
    a = keys.copy()
    b = np.empty_like(a)
    count = np.empty(mask + 2, dtype=np.int64)
    shift = 0
    while shift < bits:
        count[:] = 0
        for v in a:
            count[((v >> shift) & mask) + 1] += 1
        for d in range(1, mask + 2):
            count[d] += count[d - 1]
        for v in a:
            d = (v >> shift) & mask
            b[count[d]] = v
            count[d] += 1
        a, b = b, a
        shift += digit
    return a


def radix_sort(keys: I64, bits: int) -> I64:
    """``keys`` (non-negative int64 below ``2**bits``) sorted ascending, by an LSD radix sort of 11-bit digits:
    ``ceil(bits / 11)`` linear passes, where a comparison sort of a window's ~20k keys costs ~30 ns a key."""
    return _radix_sort(np.ascontiguousarray(keys, dtype=np.int64), bits)


@numba.njit(cache=True, nogil=True)
def _scott(y: F64, s: int, e: int, min_bandwidth: float) -> float:  # pragma: no cover - compiled
    """Scott's rule on ``y[s:e]`` (2 or more values): ``std * n ** (-1/5)``, floored at ``min_bandwidth``."""
    n = e - s
    mean = 0.0
    for i in range(s, e):
        mean += y[i]
    mean /= n
    ss = 0.0
    for i in range(s, e):
        d = y[i] - mean
        ss += d * d
    return max(math.sqrt(ss / (n - 1)) * float(n) ** (-0.2), min_bandwidth)


@numba.njit(cache=True, nogil=True)
def _neg_density(y: F64, s: int, e: int, h: float, lo: float, dx: float, points: int) -> F64:  # pragma: no cover
    """Minus the Gaussian KDE (bandwidth ``h``) of sorted ``y[s:e]`` on the grid ``lo + i * dx`` of ``points``
    points, from linear binning and a kernel cut at ``KERNEL_SUPPORT`` bandwidths."""
    n = e - s
    # Linear binning, as two bincounts added (the order numpy adds them in).
    m1 = np.zeros(points)
    m2 = np.zeros(points)
    for i in range(s, e):
        pos = (y[i] - lo) / dx
        left = min(max(math.floor(pos), 0), points - 2)
        frac = pos - left
        m1[left] += 1.0 - frac
        m2[left + 1] += frac
    mass = m1 + m2
    half = min(points - 1, math.ceil(KERNEL_SUPPORT * h / dx))
    step = dx / h
    kern = np.empty(2 * half + 1)
    for j in range(2 * half + 1):
        o = (j - half) * step
        kern[j] = math.exp(-0.5 * o * o)
    norm = n * h * math.sqrt(2.0 * math.pi)
    neg = np.empty(points)
    for i in range(points):
        acc = 0.0
        for j in range(max(0, i - half), min(points, i + half + 1)):
            acc += mass[j] * kern[i - j + half]
        neg[i] = -(acc / norm)
    return neg


@numba.njit(cache=True, nogil=True)
def _peaks(neg: F64) -> tuple[I64, int]:  # pragma: no cover - compiled
    """``scipy.signal.find_peaks(neg)`` without conditions: local maxima, a plateau at its middle (the first
    ``k`` entries of the array returned, with ``k``)."""
    points = neg.size
    peaks = np.empty(points, dtype=np.int64)
    k = 0
    i = 1
    while i < points - 1:
        if neg[i - 1] < neg[i]:
            ahead = i + 1
            while ahead < points - 1 and neg[ahead] == neg[i]:
                ahead += 1
            if neg[ahead] < neg[i]:
                peaks[k] = (i + ahead - 1) // 2
                k += 1
                i = ahead
        i += 1
    return peaks, k


@numba.njit(cache=True, nogil=True)
def _prominence(neg: F64, p: int) -> float:  # pragma: no cover - compiled
    """``scipy.signal.peak_prominences`` of peak ``p``: its height over the higher of the lowest points on each
    side before the curve rises above it."""
    left_min = neg[p]
    i = p
    while i >= 0 and neg[i] <= neg[p]:
        if neg[i] < left_min:
            left_min = neg[i]
        i -= 1
    right_min = neg[p]
    i = p
    while i <= neg.size - 1 and neg[i] <= neg[p]:
        if neg[i] < right_min:
            right_min = neg[i]
        i += 1
    return float(neg[p] - max(left_min, right_min))


@numba.njit(cache=True, nogil=True)
def _spaced(order: I64, pos_v: F64, below: I64, n: int, min_log_gap: float, min_samples: int,
            max_clusters: int) -> tuple[I64, int]:  # pragma: no cover - compiled
    """Valleys taken in ``order`` (at ``pos_v``, ln ns, with ``below`` samples under each, of ``n``) while each
    keeps ``min_log_gap`` and ``min_samples`` from the ones taken, up to ``max_clusters - 1``: the samples
    below each taken valley, ascending (the first entries of the array returned, with their number)."""
    acc_pos = np.empty(max_clusters)
    acc_below = np.empty(max_clusters, dtype=np.int64)
    na = 0
    for v in order:
        pv, c = pos_v[v], below[v]
        at = np.searchsorted(acc_pos[:na], pv)  # bisect_left
        left_pos, left_below = (acc_pos[at - 1], acc_below[at - 1]) if at > 0 else (-math.inf, 0)
        right_pos, right_below = (acc_pos[at], acc_below[at]) if at < na else (math.inf, n)
        if pv - left_pos < min_log_gap or right_pos - pv < min_log_gap:
            continue
        if c - left_below < min_samples or right_below - c < min_samples:
            continue
        for j in range(na, at, -1):
            acc_pos[j] = acc_pos[j - 1]
            acc_below[j] = acc_below[j - 1]
        acc_pos[at] = pv
        acc_below[at] = c
        na += 1
        if na == max_clusters - 1:
            break
    return acc_below, na


@numba.njit(cache=True, nogil=True)
def _group_cuts(xs: I64, y: F64, s: int, e: int, grid_points: int, min_samples: int, min_log_gap: float,
                max_clusters: int, min_valley_z: float, min_bandwidth: float, isolated_gap: float,
                grid_margin: float, out: I64, m: int) -> int:  # pragma: no cover
    """Append to ``out`` (from ``m``) the absolute indices where a new cluster of sorted ``xs[s:e]`` starts,
    in ascending order; returns the new end of ``out``."""
    n = e - s
    if n < 2 * min_samples or xs[s] == xs[e - 1] or max_clusters == 1:
        return m
    h = _scott(y, s, e, min_bandwidth)
    # A few values (fewer than a cluster holds) beyond a gap of isolated_gap bandwidths at either end are
    # bumps of their own, not the spread of the rest: one stray call would widen the bandwidth enough to
    # merge two modes x3 apart. The bandwidth is the rest's.
    lo_k, hi_k = 0, 0
    for i in range(1, min(min_samples, n)):
        if y[s + i] - y[s + i - 1] > isolated_gap * h:
            lo_k = i
        if y[e - i] - y[e - i - 1] > isolated_gap * h:
            hi_k = i
    if lo_k + hi_k > 0 and n - lo_k - hi_k >= 2:
        h = _scott(y, s + lo_k, e - hi_k, min_bandwidth)
    ymin, ymax = y[s], y[e - 1]
    span = (ymax - ymin) / h + 2.0 * grid_margin
    points = min(grid_points, max(16, math.ceil(span * _POINTS_PER_BANDWIDTH) + 1))
    lo = ymin - grid_margin * h
    hi = ymax + grid_margin * h
    dx = (hi - lo) / (points - 1)
    neg = _neg_density(y, s, e, h, lo, dx, points)  # its peaks are the density's valleys
    peaks, k = _peaks(neg)
    if k == 0:
        return m
    pos_v = np.empty(k)
    z = np.empty(k)
    below = np.empty(k, dtype=np.int64)
    ok = np.zeros(k, dtype=np.bool_)
    tiny = np.finfo(np.float64).tiny
    for v in range(k):
        p = peaks[v]
        dip = _prominence(neg, p)
        floor = -neg[p]
        noise = math.sqrt((2.0 * floor + dip) * _KERNEL_ROUGHNESS / (n * h))
        z[v] = dip / max(noise, tiny)
        pos_v[v] = (p * dx + lo) if p < points - 1 else hi  # np.linspace's grid point p
        below[v] = np.searchsorted(y[s:e], pos_v[v])
        ok[v] = (z[v] >= min_valley_z and pos_v[v] - ymin >= min_log_gap and ymax - pos_v[v] >= min_log_gap
                 and below[v] >= min_samples and n - below[v] >= min_samples)
    cand = np.flatnonzero(ok)
    if cand.size == 0:
        return m
    order = cand[np.argsort(-z[cand], kind="mergesort")]  # most significant first; ties in position order
    acc_below, na = _spaced(order, pos_v, below, n, min_log_gap, min_samples, max_clusters)
    for j in range(na):
        out[m] = s + acc_below[j]
        m += 1
    return m


@numba.njit(cache=True, nogil=True)
def _refined_cuts(xs: I64, y: F64, s: int, e: int, grid_points: int, min_samples: int, min_log_gap: float,
                  max_clusters: int, min_valley_z: float, min_bandwidth: float, isolated_gap: float,
                  grid_margin: float, out: I64, m: int) -> int:  # pragma: no cover
    """:func:`_group_cuts` of ``xs[s:e]``, then again inside each cluster found, with the cluster's own
    bandwidth, until none splits or the group has ``max_clusters``; the cuts appended in ascending order.
    A mode far from the others (a collective's waiting calls, 10x its transfers) widens the whole group's
    bandwidth past the valleys between the modes near each other (the transfers before and after a
    slowdown, x2 apart)."""
    m0 = m
    m = _group_cuts(xs, y, s, e, grid_points, min_samples, min_log_gap, max_clusters, min_valley_z, min_bandwidth,
                    isolated_gap, grid_margin, out, m)
    if m == m0:
        return m
    lo = np.empty(2 * max_clusters + 2, dtype=np.int64)
    hi = np.empty(2 * max_clusters + 2, dtype=np.int64)
    top = 0
    prev = s
    for j in range(m0, m):
        lo[top], hi[top] = prev, out[j]
        top += 1
        prev = out[j]
    lo[top], hi[top] = prev, e
    top += 1
    while top > 0 and m - m0 < max_clusters - 1:
        top -= 1
        a, b = lo[top], hi[top]
        k = m
        m = _group_cuts(xs, y, a, b, grid_points, min_samples, min_log_gap, max_clusters - (m - m0),
                        min_valley_z, min_bandwidth, isolated_gap, grid_margin, out, m)
        prev = a
        for j in range(k, m):
            lo[top], hi[top] = prev, out[j]
            top += 1
            prev = out[j]
        if m > k:
            lo[top], hi[top] = prev, b
            top += 1
    done = np.sort(out[m0:m])
    out[m0:m] = done
    return m


@numba.njit(cache=True, nogil=True)
def _valley_cuts(xs: I64, y: F64, starts: I64, grid_points: int, min_samples: int, min_log_gap: float,
                 max_clusters: int, min_valley_z: float, min_bandwidth: float, isolated_gap: float,
                 grid_margin: float) -> tuple[I64, I64]:  # pragma: no cover - compiled
    n_groups = starts.size - 1
    # At most max_clusters - 1 cuts per group, and never more than one per event.
    cap = min(xs.size, n_groups * max(max_clusters - 1, 0))
    cuts = np.empty(cap, dtype=np.int64)
    edges = np.empty(n_groups + cap + 1, dtype=np.int64)
    first = np.empty(n_groups + 1, dtype=np.int64)
    m = 0
    for g in range(n_groups):
        first[g] = m
        edges[m] = starts[g]
        m += 1
        c = _refined_cuts(xs, y, starts[g], starts[g + 1], grid_points, min_samples, min_log_gap, max_clusters,
                          min_valley_z, min_bandwidth, isolated_gap, grid_margin, cuts, 0)
        for j in range(c):
            edges[m] = cuts[j]
            m += 1
    first[n_groups] = m
    edges[m] = xs.size
    return edges[: m + 1].copy(), first


def valley_cuts(xs: I64, starts: I64, grid_points: int, min_samples: int, min_log_gap: float, max_clusters: int,
                min_valley_z: float, min_bandwidth: float, isolated_gap: float,
                grid_margin: float) -> tuple[I64, I64]:
    """The cluster edges of every group of ``xs`` (durations in ns, >= 1, sorted within each group; group
    ``g`` is ``xs[starts[g]:starts[g + 1]]``, ``starts[-1] == xs.size``).

    Returns ``(edges, first)``: cluster ``i`` is ``xs[edges[i]:edges[i + 1]]`` (``edges[-1] == xs.size``), and
    group ``g``'s clusters are ``first[g]`` to ``first[g + 1] - 1``. The parameters are those of
    :class:`~argus.detectors.kde_clusters.KdeParams`.
    """
    y = np.log(xs.astype(np.float64))  # numpy's log, as the numpy statement takes it
    # float(): one compiled signature, whatever number type a KdeParams field was given.
    return _valley_cuts(xs, y, starts, grid_points, min_samples, float(min_log_gap), max_clusters,
                        float(min_valley_z), float(min_bandwidth), float(isolated_gap), float(grid_margin))
