"""Compiled decoding of packed integer columns (:mod:`argus.schemas.column_packing`): one pass per column.

The numpy statement of :func:`~argus.schemas.column_packing.unpack_column` costs ~15 array calls per column
(a transposed copy of the byte planes, widening, patches, and for a gap-coded column a stable argsort by
group, a cumulative sum and a scatter); a kernel batch of ~4,000 events has five columns, so decoding was a
quarter of the compression agent's time. These kernels (numba, compiled once and cached on disk) read the
byte planes straight into int64 values and run the per-group sums in event order, which gives the same
values: the sums wrap modulo 2^64 on both paths, and a wrapping sum does not depend on its order.

Imported only where batches are decoded (the stream worker, the sink, the tools), not by the rank-side
tracer, which only encodes: importing numba costs ~0.3 s and its compiler's memory.
The caller validates the header (method, width, lengths); these functions trust it.
"""

from __future__ import annotations

import numba
import numpy as np
import numpy.typing as npt

__all__ = ["DENSE_GROUP_SPAN", "gap_values", "offset_values"]

U8 = npt.NDArray[np.uint8]
I64 = npt.NDArray[np.int64]

#: Gap-coded columns whose groups (streams) span at most this many values are decoded here (a table of one
#: running value per group value); wider ones take the numpy path.
DENSE_GROUP_SPAN = 1 << 16


@numba.njit(cache=True, nogil=True)
def _codes(data: U8, header: int, width: int, n: int, n_patched: int) -> npt.NDArray[np.uint64]:  # pragma: no cover
    """The ``n`` codes of a column: byte plane ``b`` holds byte ``b`` of every code; then the patches."""
    out = np.zeros(n, dtype=np.uint64)
    for b in range(width):
        plane = header + b * n
        shift = np.uint64(8 * b)
        for i in range(n):
            out[i] |= np.uint64(data[plane + i]) << shift
    at = header + n * width
    for j in range(n_patched):
        p = at + 4 * j
        idx = (np.int64(data[p]) | (np.int64(data[p + 1]) << 8) | (np.int64(data[p + 2]) << 16)
               | (np.int64(data[p + 3]) << 24))
        if idx >= n:
            return out[:0]  # the caller reports the bad patch
        q = at + 4 * n_patched + 8 * j
        code = np.uint64(0)
        for b in range(8):
            code |= np.uint64(data[q + b]) << np.uint64(8 * b)
        out[idx] = code
    return out


@numba.njit(cache=True, nogil=True)
def _offset(data: U8, header: int, width: int, n: int, n_patched: int, base: int) -> I64:  # pragma: no cover
    codes = _codes(data, header, width, n, n_patched)
    if codes.size != n:
        return np.empty(0, dtype=np.int64)
    return (codes + np.uint64(base)).view(np.int64)  # wraps modulo 2^64, as the writer's subtraction did


@numba.njit(cache=True, nogil=True)
def _gap(data: U8, header: int, width: int, n: int, n_patched: int, base: int, groups: I64, after: I64,
         has_after: bool, low: int, span: int) -> I64:  # pragma: no cover - compiled
    codes = _codes(data, header, width, n, n_patched)
    if codes.size != n:
        return np.empty(0, dtype=np.int64)
    one = np.uint64(1)
    # Per group value: the running value of its previous event plus that event's ``after`` (0 before any).
    run = np.zeros(span, dtype=np.uint64)
    out = np.empty(n, dtype=np.uint64)
    b = np.uint64(base)
    for i in range(n):
        c = codes[i]
        d = (c >> one) ^ (np.uint64(0) - (c & one))  # zigzag
        g = groups[i] - low
        v = run[g] + d
        out[i] = v + b
        run[g] = v + (np.uint64(after[i]) if has_after else np.uint64(0))
    return out.view(np.int64)


def offset_values(data: bytes, header: int, width: int, n: int, n_patched: int, base: int) -> I64 | None:
    """An ``OFFSET`` column's values; ``None`` when a patch names an event beyond ``n``."""
    out = _offset(np.frombuffer(data, dtype=np.uint8), header, width, n, n_patched, base)
    return out if out.size == n else None


def gap_values(data: bytes, header: int, width: int, n: int, n_patched: int, base: int, groups: I64,
               after: I64 | None, low: int, span: int) -> I64 | None:
    """A ``GAP`` column's values (``groups`` within ``[low, low + span)``, ``span <= DENSE_GROUP_SPAN``);
    ``None`` when a patch names an event beyond ``n``."""
    has_after = after is not None
    out = _gap(np.frombuffer(data, dtype=np.uint8), header, width, n, n_patched, base,
               np.ascontiguousarray(groups, dtype=np.int64),
               np.ascontiguousarray(after if has_after else groups[:0], dtype=np.int64), has_after, low, span)
    return out if out.size == n else None
