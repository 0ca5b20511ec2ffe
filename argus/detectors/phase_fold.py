"""The per-id sums and the nested blocking time of many phase batches of one layout at once.

:meth:`argus.detectors.phase_layout.PhaseLayout.fold_rows` asks, per batch, the sum of its durations per
phase id and, per compute phase, how much of it the batch's blocking collectives cover. Batches of one layout
run their phases at nearly the same offsets from their step's start, so most (phase, collective) pairs
overlap in no batch: only the pairs whose ranges over all batches meet need evaluating (any other pair adds
0). Two evaluations give the same integers (ns, exact in int64):

* :func:`fold_rows` (compiled, numba): one pass over the batches' ``batches x columns`` arrays where they lie
  (no transposed copies, no ``pairs x batches`` temporaries; numpy's version was ~70 ms a step at 10,240
  ranks): the per-id sums, the overlaps of the pairs it is given, and the ranges of every column, from which
  the caller sees whether the pairs it gave cover every pair that meets;
* :func:`overlaps` (numpy): phase-major, pairwise for few pairs, by coverage (:class:`_Coverage`) where
  too many meet (very different timelines), where the compiled loop would evaluate too many pairs.
"""

from __future__ import annotations

import numba
import numpy as np
import numpy.typing as npt

__all__ = ["FoldedRows", "fold_rows", "overlaps", "pair_lists", "pairs_covered", "store_own_times"]

I64 = npt.NDArray[np.int64]
#: Per row and id the summed durations and the nested blocking time; per compute column the least and greatest
#: start and end, per collective column the least start and the greatest end (starts relative to each row's
#: first phase; an end is the start plus the duration, or plus 0 where it is negative); the greatest end of
#: either; the least and greatest duration.
FoldedRows = tuple[I64, I64, I64, I64, I64, I64, I64, I64, int, int, int]


@numba.njit(cache=True, nogil=True)
def _fold(start: I64, s_at: int, dur: I64, d_at: int, inverse: I64, n_ids: int, outer: I64, block: I64, ptr: I64,
          pair_block: I64) -> FoldedRows:  # pragma: no cover - compiled
    rows, width = dur.shape[0], inverse.size
    big, small = np.iinfo(np.int64).max, np.iinfo(np.int64).min
    sums = np.zeros((rows, n_ids), dtype=np.int64)
    nested = np.zeros((rows, n_ids), dtype=np.int64)
    # Per column, the least and greatest relative start and end over the rows: kept for every column, in
    # contiguous passes the compiler vectorizes; those of the compute and collective columns are returned.
    lo_s, hi_s = np.full(width, big), np.full(width, small)
    lo_e, hi_e = np.full(width, big), np.full(width, small)
    # One row's relative starts and ends, read by the pairs that hold them.
    rel, ends = np.empty(width, dtype=np.int64), np.empty(width, dtype=np.int64)
    pair_col = block[pair_block]
    # Per pair, its compute phase's position in outer and its column: one loop over all pairs (a loop per
    # compute phase over its few pairs mispredicts its every exit).
    pair_of = np.empty(pair_block.size, dtype=np.int64)
    for i in range(outer.size):
        pair_of[ptr[i]:ptr[i + 1]] = i
    pair_out = outer[pair_of]
    acc = np.zeros(outer.size, dtype=np.int64)
    d_lo, d_hi = big, small
    for r in range(rows):
        s_row, d_row = start[r, s_at:s_at + width], dur[r, d_at:d_at + width]
        first, lo, hi = s_row[0], d_lo, d_hi
        for c in range(width):
            first = min(first, s_row[c])
            lo, hi = min(lo, d_row[c]), max(hi, d_row[c])
        d_lo, d_hi = lo, hi
        for c in range(width):
            s = s_row[c] - first
            e = s + max(d_row[c], 0)
            rel[c], ends[c] = s, e
            lo_s[c], hi_s[c] = min(lo_s[c], s), max(hi_s[c], s)
            lo_e[c], hi_e[c] = min(lo_e[c], e), max(hi_e[c], e)
        sums_r, nested_r = sums[r], nested[r]
        for c in range(width):
            sums_r[inverse[c]] += d_row[c]
        acc[:] = 0
        for k in range(pair_col.size):
            c, b = pair_out[k], pair_col[k]
            acc[pair_of[k]] += max(min(ends[c], ends[b]) - max(rel[c], rel[b]), 0)
        for i in range(outer.size):
            c = outer[i]
            nested_r[inverse[c]] += min(acc[i], d_row[c])
    end = small
    for i in range(outer.size):
        end = max(end, hi_e[outer[i]])
    for j in range(block.size):
        end = max(end, hi_e[block[j]])
    return (sums, nested, lo_s[outer], hi_s[outer], lo_e[outer], hi_e[outer], lo_s[block], hi_e[block], end,
            d_lo, d_hi)


@numba.njit(cache=True, nogil=True)
def _covered(lo_so: I64, hi_so: I64, lo_eo: I64, hi_eo: I64, lo_sc: I64, hi_ec: I64, pairs: npt.NDArray[np.bool_],
             most: int) -> bool:  # pragma: no cover - compiled
    crossing = 0
    for i in range(lo_so.size):
        for j in range(lo_sc.size):
            if max(lo_so[i], lo_sc[j]) < min(hi_eo[i], hi_ec[j]):
                if not pairs[i, j]:
                    return False
                if not (hi_so[i] <= lo_sc[j] and hi_ec[j] <= lo_eo[i]):
                    crossing += 1
    return crossing <= most


def pairs_covered(ranges: tuple[I64, I64, I64, I64, I64, I64], pairs: npt.NDArray[np.bool_], most: int) -> bool:
    """Whether the (compute, collective) ``pairs`` evaluated hold every pair whose ranges (:data:`FoldedRows`: the
    compute columns' least and greatest start and end, the collectives' least start and greatest end) meet, and
    at most ``most`` of those cross (meet without one inside the other in every row): then the overlaps
    :func:`fold_rows` gave with them are the whole answer. One compiled pass over the pairs."""
    return bool(_covered(*ranges, pairs, int(most)))


def pair_lists(pairs: npt.NDArray[np.bool_]) -> tuple[I64, I64]:
    """``pairs`` (``compute x collective`` columns) as :func:`fold_rows` takes them: per compute column ``i``
    its collectives' positions ``pair_block[ptr[i]:ptr[i + 1]]``."""
    po, pc = np.nonzero(pairs)  # row-major: grouped by compute column
    ptr = np.zeros(pairs.shape[0] + 1, dtype=np.int64)
    np.cumsum(np.bincount(po, minlength=pairs.shape[0]), out=ptr[1:])
    return ptr, pc.astype(np.int64)


def fold_rows(start: I64, dur: I64, inverse: I64, n_ids: int, outer: I64, block: I64, ptr: I64,
              pair_block: I64, *, start_at: int = 0, dur_at: int = 0) -> FoldedRows:
    """One pass over ``start`` and ``dur`` (``batches x columns``, ns; the ``inverse.size`` columns from
    ``start_at`` and from ``dur_at`` on, at least one; both may be one array, as packed times are: starts then
    durations per row; ``start`` matters to the overlaps only, none where ``block`` is empty): per row the
    durations summed per id (``inverse``: each column's id position), and each compute column ``outer[i]``'s
    overlap with the collective columns ``block[pair_block[ptr[i]:ptr[i + 1]]]`` (:func:`pair_lists`), capped at
    its duration and summed into its id; then the ranges of the columns (see :data:`FoldedRows`). Sums wrap
    beyond int64, as numpy's. Raises ``ValueError`` where the columns do not fit the arrays."""
    width = inverse.size
    if start.ndim != 2 or dur.ndim != 2 or start.shape[0] != dur.shape[0] or width == 0 \
            or not (0 <= start_at <= start.shape[1] - width and 0 <= dur_at <= dur.shape[1] - width):
        raise ValueError(f"fold_rows: {width} columns from {start_at} / {dur_at} do not fit arrays of shapes "
                         f"{start.shape} / {dur.shape}")
    # Rows read in place as contiguous slices of C-ordered arrays (what the compiled loops vectorize): one buffer
    # of packed times is not split into strided views, nor copied.
    return _fold(np.ascontiguousarray(start), int(start_at), np.ascontiguousarray(dur), int(dur_at), inverse,
                 int(n_ids), outer, block, ptr, pair_block)


@numba.njit(cache=True, nogil=True)
def _store(column: npt.NDArray[np.int32] | I64, limit: int, offsets: I64, raw_offsets: I64, duration: I64,
           nested: I64, nests: I64) -> bool:  # pragma: no cover - compiled
    for r in range(duration.shape[0]):
        at = offsets[r]
        for i in range(duration.shape[1]):
            v = max(duration[r, i] - nested[r, i], 0)
            if v > limit:
                return False
            column[at + i] = v
        at = raw_offsets[r]
        for j in range(nests.size):
            v = max(duration[r, nests[j]], 0)
            if v > limit:
                return False
            column[at + j] = v
    return True


def store_own_times(column: npt.NDArray[np.int32] | I64, offsets: I64, raw_offsets: I64, duration: I64,
                    nested: I64, nests: I64) -> bool:
    """Write folded rows into a step's ``column`` of cells: row ``r``'s own times (``duration - nested``, ns, at
    least 0) into the cells from ``offsets[r]`` on, its durations at the positions ``nests`` (at least 0) into
    those from ``raw_offsets[r]`` on. One compiled pass. ``False`` (some cells written) where a value exceeds
    what ``column``'s dtype holds."""
    return bool(_store(column, int(np.iinfo(column.dtype).max), offsets, raw_offsets, duration, nested, nests))


def overlaps(s_o: I64, e_o: I64, s_c: I64, e_c: I64, span: int, max_pairs_per_phase: int) -> I64:
    """Per column (a batch), each interval ``[s_o, e_o)``'s summed overlap with the intervals ``[s_c, e_c)``
    (ns, exact); phase-major arrays (``phases x batches``); ``span``: above every end. Pairwise over the
    pairs whose ranges meet, by coverage where more than ``max_pairs_per_phase`` per phase do."""
    lo_so, hi_so, lo_eo, hi_eo = s_o.min(axis=1), s_o.max(axis=1), e_o.min(axis=1), e_o.max(axis=1)
    lo_sc, hi_ec = s_c.min(axis=1), e_c.max(axis=1)
    meets = np.maximum(lo_so[:, None], lo_sc[None, :]) < np.minimum(hi_eo[:, None], hi_ec[None, :])
    # A collective inside the phase in every batch (a forward around its layers' all-reduces) overlaps it by
    # its length: those pairs are summed by one product (integers below 2**52, exact), the others pairwise.
    inside = (hi_so[:, None] <= lo_sc[None, :]) & (hi_ec[None, :] <= lo_eo[:, None])
    po, pc = np.nonzero(meets & ~inside)  # pairs grouped by phase (row-major)
    if po.size > max_pairs_per_phase * s_o.shape[0]:
        covered = _Coverage(s_c.T, e_c.T, span)
        out: I64 = (covered.at(np.ascontiguousarray(e_o.T)) - covered.at(np.ascontiguousarray(s_o.T))).T
        return out
    out = _inside_sums(inside, e_c - s_c)
    if po.size == 0:
        return out
    ov = np.minimum(e_o[po], e_c[pc])
    ov -= np.maximum(s_o[po], s_c[pc])
    np.maximum(ov, 0, out=ov)
    phases, first = np.unique(po, return_index=True)
    out[phases] += np.add.reduceat(ov, first, axis=0)
    return out


def _inside_sums(inside: npt.NDArray[np.bool_], length: I64) -> I64:
    """Per phase (row of ``inside``), the summed ``length`` (``collectives x batches``) of the collectives it
    holds: a run of consecutive collectives (the usual case) by a difference of prefix sums, else summed."""
    n_o, n_c = inside.shape
    out = np.zeros((n_o, length.shape[1]), dtype=np.int64)
    cnt = inside.sum(axis=1)
    if not cnt.any():
        return out
    lo = np.argmax(inside, axis=1)
    last = n_c - 1 - np.argmax(inside[:, ::-1], axis=1)
    run = (cnt > 0) & (last - lo + 1 == cnt)
    prefix = np.zeros((n_c + 1, length.shape[1]), dtype=np.int64)
    np.cumsum(length, axis=0, out=prefix[1:])
    out[run] = prefix[(lo + cnt)[run]] - prefix[lo[run]]
    for i in np.flatnonzero((cnt > 0) & ~run).tolist():
        out[i] = length[inside[i]].sum(axis=0)
    return out


class _Coverage:
    """Per row, ``C(x) = sum over intervals [s, e) of |[s, e) ∩ (-inf, x)|``: the time the row's intervals
    cover before ``x``, with multiplicity. The overlap of ``[a, b)`` (``a <= b``) with them all is
    ``C(b) - C(a)``. Rows are searched at once: row ``r``'s values are offset by ``r * span``."""

    def __init__(self, s: I64, e: I64, span: int) -> None:
        rows, m = s.shape
        self._m, self._span = m, span
        self._off = (np.arange(rows, dtype=np.int64) * span)[:, None]
        self._s, self._e = np.sort(s, axis=1), np.sort(e, axis=1)
        zero = np.zeros((rows, 1), dtype=np.int64)
        self._ps = np.concatenate([zero, np.cumsum(self._s, axis=1)], axis=1)
        self._pe = np.concatenate([zero, np.cumsum(self._e, axis=1)], axis=1)
        self._flat_s, self._flat_e = (self._s + self._off).ravel(), (self._e + self._off).ravel()

    def at(self, x: I64) -> I64:
        """``C(x)`` for ``x`` of shape ``rows x n`` (times in ``[0, span)``), exact in int64."""
        rows = np.arange(x.shape[0])[:, None]
        key = x + self._off
        n_s = np.searchsorted(self._flat_s, key, side="right") - rows * self._m  # starts <= x
        n_e = np.searchsorted(self._flat_e, key, side="right") - rows * self._m  # ends <= x
        out: I64 = (n_s * x - self._ps[rows, n_s]) - (n_e * x - self._pe[rows, n_e])
        return out
