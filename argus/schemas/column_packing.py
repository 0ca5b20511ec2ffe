"""Packed integer columns: the per-event columns of ``kernel_batch`` v2 on the wire.

A kernel event of the v1 layout costs 28 bytes (fixed ``u4 u4 i8 i8 i4`` columns), most of them always zero:
a batch names a few hundred kernels at most, uses a handful of streams and steps, and its kernels run for
microseconds to milliseconds. A packed column stores each value's *code* in the narrowest unsigned width
(1, 2, 4 or 8 bytes) that holds nearly all of the batch's codes; the few codes too wide for it (a pause of
seconds between two kernels of one stream, say) are stored apart, whole ("patched frame of reference"). The
bytes of equal significance are stored together ("byte shuffle") so the Kafka producer's compressor (zstd)
sees long runs of equal high bytes. Codes, by method: see docs/internals/schemas.md.
"""

from __future__ import annotations

import enum
from typing import Any

import numpy as np
import numpy.typing as npt

from argus.core.errors import SchemaError

__all__ = ["HEADER_BYTES", "PackMethod", "pack_column", "unpack_column"]

#: Bytes before the codes of a packed column: method, width, base, number of patches.
HEADER_BYTES = 14
_WIDTHS = (1, 2, 4, 8)
#: Bytes a patched code costs (its index and its whole code).
_PATCH_BYTES = 12
_U64_1 = np.uint64(1)


class PackMethod(enum.IntEnum):
    """How the values of a packed column are coded (byte 0 of the column)."""

    OFFSET = 0
    GAP = 1


def _group_order(groups: npt.NDArray[np.int64]) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.bool_]]:
    """A stable order that puts each group's events together (in event order), and where each group starts."""
    keys: npt.NDArray[Any] = groups
    if groups.size:
        low = int(groups.min())
        if int(groups.max()) - low < 1 << 16:  # a few streams: numpy's stable sort of 16-bit keys is a radix sort
            keys = (groups - low).astype(np.uint16)
    order = np.argsort(keys, kind="stable")
    g = keys[order]
    first = np.ones(g.size, dtype=bool)
    first[1:] = g[1:] != g[:-1]
    return order, first


def _previous(values: npt.NDArray[np.int64], first: npt.NDArray[np.bool_]) -> npt.NDArray[np.int64]:
    """Each (group-ordered) event's predecessor in its group; 0 for the first of a group."""
    prev = np.empty_like(values)
    prev[0:1] = 0
    prev[1:] = values[:-1]
    prev[first] = 0
    return prev


def _width(coded: npt.NDArray[np.uint64]) -> tuple[int, npt.NDArray[np.bool_]]:
    """The width that makes the column smallest, and which codes are patched at it."""
    best: tuple[int, int, npt.NDArray[np.bool_]] | None = None
    for w in _WIDTHS:
        wide = coded >= np.uint64(1 << (8 * w)) if w < 8 else np.zeros(coded.shape, dtype=bool)
        size = coded.size * w + int(wide.sum()) * _PATCH_BYTES
        if best is None or size < best[0]:
            best = (size, w, wide)
    assert best is not None
    return best[1], best[2]


def pack_column(values: npt.ArrayLike, groups: npt.ArrayLike | None = None,
                after: npt.ArrayLike | None = None) -> bytes:
    """``values`` (integers, int64 range) as a packed column.

    Without ``groups`` each value is coded as an offset from the column's minimum (``OFFSET``). With
    ``groups`` (one per value, e.g. the stream) as the ``GAP`` from the previous value of its group plus
    that event's ``after`` (one per value, e.g. the duration; default 0).

    Raises:
        SchemaError: ``groups`` or ``after`` of another length than ``values``.
    """
    v = np.ascontiguousarray(values, dtype=np.int64)
    for name, other in (("groups", groups), ("after", after)):
        if other is not None and np.shape(other) != v.shape:
            raise SchemaError(f"{v.size} values to pack with {np.size(other)} {name}")
    base = int(v.min()) if v.size else 0
    if groups is None:
        method = PackMethod.OFFSET
        with np.errstate(over="ignore"):
            coded = (v - np.int64(base)).view(np.uint64)
    else:
        method = PackMethod.GAP
        order, first = _group_order(np.ascontiguousarray(groups, dtype=np.int64))
        s = v[order]
        add = np.zeros_like(s) if after is None else np.ascontiguousarray(after, dtype=np.int64)[order]
        with np.errstate(over="ignore"):
            d = s - _previous(s + add, first)
            d[first] = s[first] - np.int64(base)
            z = (d.view(np.uint64) << _U64_1) ^ (d >> np.int64(63)).view(np.uint64)  # zigzag
        coded = np.empty_like(z)
        coded[order] = z
    width, wide = _width(coded)
    patched = np.flatnonzero(wide)
    narrow = np.where(wide, np.uint64(0), coded).astype(f"<u{width}")
    planes = narrow.view(np.uint8).reshape(v.size, width).T
    return b"".join((bytes((method, width)), base.to_bytes(8, "little", signed=True),
                     patched.size.to_bytes(4, "little"), planes.tobytes(), patched.astype("<u4").tobytes(),
                     coded[patched].astype("<u8").tobytes()))


def _compiled(data: bytes, method: int, width: int, n: int, n_patched: int, base: int,
              groups: npt.NDArray[np.int64] | None, after: npt.NDArray[np.int64] | None
              ) -> npt.NDArray[np.int64] | None:
    """The column decoded by :mod:`argus.schemas.column_unpacking`, or ``None`` where the numpy statement must
    answer (a bad patch, groups or ``after`` of another length, groups spanning too many values)."""
    # Imported here, not at the top: the rank-side tracer imports this module to encode only (numba: ~0.3 s).
    from argus.schemas import column_unpacking as cu

    if method == PackMethod.OFFSET:
        return cu.offset_values(data, HEADER_BYTES, width, n, n_patched, base)
    if groups is None or groups.shape != (n,) or (after is not None and after.shape != (n,)):
        return None
    low, high = int(groups.min()), int(groups.max())
    if high - low >= cu.DENSE_GROUP_SPAN:
        return None
    return cu.gap_values(data, HEADER_BYTES, width, n, n_patched, base, groups, after, low, high - low + 1)


def unpack_column(data: bytes, name: str, groups: npt.NDArray[np.int64] | None = None,
                  after: npt.NDArray[np.int64] | None = None) -> npt.NDArray[np.int64]:
    """The int64 values of a packed column (see the module docstring).

    ``groups`` and ``after``: the decoded columns the column was packed with; ``groups`` is required for a
    ``GAP`` column.

    Raises:
        SchemaError: a header, length or patch that is not a packed column's, or a ``GAP`` column without
            ``groups`` (or ``after``) of its length.
    """
    if len(data) < HEADER_BYTES:
        raise SchemaError(f"column {name}: {len(data)} bytes is shorter than a packed column's header")
    method, width = data[0], data[1]
    if method not in (PackMethod.OFFSET, PackMethod.GAP) or width not in _WIDTHS:
        raise SchemaError(f"column {name}: unknown packing (method {method}, width {width})")
    n_patched = int.from_bytes(data[10:HEADER_BYTES], "little")
    payload = len(data) - HEADER_BYTES - n_patched * _PATCH_BYTES
    if payload < 0 or payload % width:
        raise SchemaError(f"column {name}: {len(data)} bytes do not hold whole codes of width {width} and "
                          f"{n_patched} patches")
    n = payload // width
    base = np.int64(int.from_bytes(data[2:10], "little", signed=True))
    fast = _compiled(data, method, width, n, n_patched, int(base), groups, after) if n else None
    if fast is not None:
        return fast
    # The numpy statement: empty columns, groups too wide for the compiled table, and every error.
    planes = np.frombuffer(data, dtype=np.uint8, count=payload, offset=HEADER_BYTES).reshape(width, n)
    coded = np.ascontiguousarray(planes.T).view(f"<u{width}").reshape(n).astype(np.uint64)
    if n_patched:
        at = HEADER_BYTES + payload
        idx = np.frombuffer(data, dtype="<u4", count=n_patched, offset=at)
        if int(idx.max()) >= n:
            raise SchemaError(f"column {name}: patch of event {int(idx.max())} beyond its {n} events")
        coded[idx] = np.frombuffer(data, dtype="<u8", count=n_patched, offset=at + 4 * n_patched)
    with np.errstate(over="ignore"):
        if method == PackMethod.OFFSET:
            return coded.view(np.int64) + base
        for what, col in (("groups", groups), ("after", after)):
            if (col is None and what == "groups") or (col is not None and col.shape != (n,)):
                raise SchemaError(f"column {name}: a gap-coded column of {n} values needs {n} {what}, got "
                                  f"{None if col is None else col.size}")
        d = ((coded >> _U64_1) ^ (np.uint64(0) - (coded & _U64_1))).view(np.int64)
        if n == 0:
            return d
        assert groups is not None
        order, first = _group_order(groups)
        step = d[order]
        if after is not None:
            step = step + _previous(after[order], first)
        # A running sum per group: the running sum over all, less the total of the groups before it.
        run = np.cumsum(step)
        starts = np.flatnonzero(first)
        before = np.zeros(starts.size, dtype=np.int64)
        before[1:] = run[starts[1:] - 1]
        run -= np.repeat(before, np.diff(np.append(starts, n)))
        out = np.empty(n, dtype=np.int64)
        out[order] = run + base
        return out
