"""Compiled reading of a PhaseBatch Avro body (``phase_batch.v1``): one pass over the bytes, integers kept as arrays.

fastavro's schemaless reader builds a Python list of ints per column (~450 ints a batch of ~150 phases) and
resolves the writer's schema against the reader's value by value: ~350 us a batch, and whoever needs the times as
arrays (L2's fold of a step, 10,240 batches at 10,240 ranks) converts the ints once more (~20 ns each). This
kernel (numba, compiled once and cached on disk) walks the v1 layout (the binary encoding of the Avro
specification: zigzag varints, length-prefixed strings, arrays in blocks of a count, a negative count followed
by the block's size in bytes) and returns the long columns as int64 arrays and, for the strings, their byte
ranges, so the caller decodes names only for a layout it has not seen (a layout's bytes name it).

It reads only what fastavro would read the same way: any byte it does not expect (a truncated body, a varint
beyond 64 bits, an enum index outside the symbols, a negative length) makes it answer ``None``, and the caller
decodes with fastavro, which gives the same values or raises the same error as ever.

Imported only where batches are decoded (the stream worker, the sink, the tools), not by the rank-side
tracer, which only encodes: importing numba costs ~0.3 s and its compiler's memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
import numpy.typing as npt

__all__ = ["RawPhaseBatch", "read_phase_batch"]

U8 = npt.NDArray[np.uint8]
I64 = npt.NDArray[np.int64]
#: Positions in the scan's header array (``_HEAD`` values).
_OK, _JOB_LO, _JOB_HI, _RANK, _STEP, _LAYOUT_LO, _LAYOUT_HI, _END = range(8)
_N_COUNTS = 6  # kinds, names, groups, streams, start_ns, duration_ns
_HEAD = 8 + _N_COUNTS


@numba.njit(cache=True, nogil=True)
def _long(data: U8, at: int) -> tuple[int, int]:  # pragma: no cover - compiled
    """One Avro long at ``at``: (value, next position); next -1 past the end or beyond 64 bits."""
    acc = np.uint64(0)
    for k in range(10):
        if at >= data.size:
            return 0, -1
        b = np.uint64(data[at])
        at += 1
        if k == 9 and b > 1:  # the 10th byte holds bit 63 only
            return 0, -1
        acc |= (b & np.uint64(0x7F)) << np.uint64(7 * k)
        if b < 0x80:
            one = np.uint64(1)
            z = (acc >> one) ^ (np.uint64(0) - (acc & one))
            return int(np.int64(z)), at
    return 0, -1


@numba.njit(cache=True, nogil=True)
def _block(data: U8, at: int) -> tuple[int, int]:  # pragma: no cover - compiled
    """The item count of the array block at ``at`` (0: the array's end), its byte size skipped: (count, next)."""
    count, at = _long(data, at)
    if at < 0:
        return 0, -1
    if count < 0:
        count = -count
        size, at = _long(data, at)
        if at < 0 or size < 0:
            return 0, -1
    return count, at


@numba.njit(cache=True, nogil=True)
def _longs(data: U8, at: int, out: I64, lo: int, hi: int, bounded: bool) -> tuple[int, int]:  # pragma: no cover
    """An Avro array of longs (``bounded``: each in ``[lo, hi)``, an enum's indices) into ``out``: (count, next)."""
    n = 0
    while True:
        count, at = _block(data, at)
        if at < 0:
            return 0, -1
        if count == 0:
            return n, at
        if n + count > out.size:
            return 0, -1
        for _ in range(count):
            v, at = _long(data, at)
            if at < 0 or (bounded and not lo <= v < hi):
                return 0, -1
            out[n] = v
            n += 1


@numba.njit(cache=True, nogil=True)
def _string(data: U8, at: int) -> tuple[int, int]:  # pragma: no cover - compiled
    """The byte range of the Avro string at ``at``: (first byte, next position); next -1 when it overruns."""
    size, at = _long(data, at)
    if at < 0 or size < 0 or at + size > data.size:
        return 0, -1
    return at, at + size


@numba.njit(cache=True, nogil=True)
def _scan(data: U8, at: int, n_kinds: int, n_groups: int) -> tuple[I64, I64]:  # pragma: no cover - compiled
    """The v1 body from ``at``: the header (``_HEAD`` values; ``head[_OK]`` 0 where the caller must use
    fastavro) and one buffer: kinds, name ranges (first, end per name), groups, streams, starts, durations,
    their counts in ``head[8:]``."""
    head = np.zeros(_HEAD, dtype=np.int64)
    # Every item takes a byte at least and a name two values: 2 values a byte bound the buffer; the values read
    # are copied out of it (what the batch keeps: ~7 values a phase, not ~40).
    cap = data.size
    buf = np.empty(2 * cap + 1, dtype=np.int64)
    lo, at = _string(data, at)
    if at < 0:
        return head, buf[:0]
    head[_JOB_LO], head[_JOB_HI] = lo, at
    rank, at = _long(data, at)
    if at < 0:
        return head, buf[:0]
    step, at = _long(data, at)
    if at < 0:
        return head, buf[:0]
    head[_RANK], head[_STEP] = rank, step
    head[_LAYOUT_LO] = at
    used = 0
    n, at = _longs(data, at, buf[used:], 0, n_kinds, True)
    if at < 0:
        return head, buf[:0]
    head[8] = n
    used += n
    n = 0
    while True:  # names: a (first, end) pair per string
        count, at = _block(data, at)
        if at < 0 or used + 2 * (n + count) > buf.size:
            return head, buf[:0]
        if count == 0:
            break
        for _ in range(count):
            first, at = _string(data, at)
            if at < 0:
                return head, buf[:0]
            buf[used + 2 * n] = first
            buf[used + 2 * n + 1] = at
            n += 1
    head[9] = n
    used += 2 * n
    for slot, bound in ((10, n_groups), (11, 0), (12, 0), (13, 0)):
        n, at = _longs(data, at, buf[used:], 0, bound, bound > 0)
        if at < 0:
            return head, buf[:0]
        head[slot] = n
        used += n
        if slot == 11:
            head[_LAYOUT_HI] = at
    head[_END] = at
    head[_OK] = 1
    return head, buf[:used].copy()


@dataclass(frozen=True, eq=False)
class RawPhaseBatch:
    """A v1 PhaseBatch body as :func:`read_phase_batch` read it: ``layout`` the bytes of its kinds, names,
    groups and streams (equal bytes: an equal layout); ``kinds`` and ``groups`` enum indices, ``names`` the
    byte range of each name in the payload (``phases x 2``); ``streams``, ``start_ns`` and ``duration_ns``
    int64 arrays (ns for the times), read-only views of one buffer; ``times`` the two time columns as bytes."""

    job_id: str
    rank: int
    step: int
    layout: bytes
    kinds: I64
    names: I64
    groups: I64
    streams: I64
    #: ``start_ns`` then ``duration_ns``, little-endian int64 bytes (``None`` when their lengths differ).
    times: bytes | None
    start_ns: I64
    duration_ns: I64


def read_phase_batch(payload: bytes, at: int, n_kinds: int, n_groups: int) -> RawPhaseBatch | None:
    """The v1 PhaseBatch body of ``payload`` from byte ``at`` to its end; ``n_kinds`` / ``n_groups``: the number
    of symbols of the kind and group enums. ``None`` where fastavro must decode it (anything unexpected:
    see the module docstring, or bytes after the body, or a job id that is not UTF-8)."""
    data = np.frombuffer(payload, dtype=np.uint8)
    head, buf = _scan(data, at, n_kinds, n_groups)
    if not head[_OK] or head[_END] != len(payload):
        return None
    try:
        job_id = payload[head[_JOB_LO]:head[_JOB_HI]].decode("utf-8")
    except UnicodeDecodeError:
        return None
    n_kinds, n_names, n_groups, n_streams, n_starts, n_durations = head[8:].tolist()
    buf.flags.writeable = False
    names = n_kinds + 2 * n_names
    streams = names + n_groups
    times = buf[streams + n_streams:]
    return RawPhaseBatch(job_id, int(head[_RANK]), int(head[_STEP]), payload[head[_LAYOUT_LO]:head[_LAYOUT_HI]],
                         buf[:n_kinds], buf[n_kinds:names].reshape(-1, 2), buf[names:streams],
                         buf[streams:streams + n_streams], times.astype("<i8").tobytes() if n_starts == n_durations
                         else None, times[:n_starts], times[n_starts:])
