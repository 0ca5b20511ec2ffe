"""Compiled reading of a PhaseBatch Avro body (``phase_batch.v1``): one pass over the bytes, integers kept as arrays.

fastavro's schemaless reader builds a Python list of ints per column (~450 ints a batch of ~150 phases) and
resolves the writer's schema against the reader's value by value: ~350 us a batch, and whoever needs the times as
arrays (L2's fold of a step, 10,240 batches at 10,240 ranks) converts the ints once more (~20 ns each). This
kernel (numba, compiled once and cached on disk) walks the v1 layout (the binary encoding of the Avro
specification: zigzag varints, length-prefixed strings, arrays in blocks of a count, a negative count followed
by the block's size in bytes) and returns the long columns as int64 arrays and, for the strings, their byte
ranges, so the caller decodes names only for a layout it has not seen (a layout's bytes name it).

Details and reasoning: docs/internals/schemas.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
import numpy.typing as npt

from argus.schemas.codec import MAGIC

__all__ = ["MAX_JOBS", "MAX_LAYOUTS", "PHASE_ROW_FIELDS", "RawPhaseBatch", "known_range", "read_layout",
           "read_phase_batch", "scan_phase_batches"]

U8 = npt.NDArray[np.uint8]
I64 = npt.NDArray[np.int64]
#: Positions in the scan's header array (``_HEAD`` values).
_OK, _JOB_LO, _JOB_HI, _RANK, _STEP, _LAYOUT_LO, _LAYOUT_HI, _END = range(8)
_N_COUNTS = 6  # kinds, names, groups, streams, start_ns, duration_ns
_HEAD = 8 + _N_COUNTS


@numba.njit(cache=True, nogil=True)
def _long(data: U8, at: int) -> tuple[int, int]:  # pragma: no cover - compiled
    """One Avro long at ``at``: (value, next position); next -1 past the end or beyond 64 bits.

    Signed arithmetic and one loop test per byte: numba mixes uint64 with integer literals in float64, and a
    check of the byte's position per byte, both several times slower."""
    n = data.size
    if at >= n:
        return 0, -1
    b = np.int64(data[at])
    at += 1
    acc = b & 0x7F
    shift = 7
    while b >= 0x80:
        if at >= n or shift > 63:
            return 0, -1
        b = np.int64(data[at])
        at += 1
        acc |= (b & 0x7F) << shift
        shift += 7
    if shift == 70 and b > 1:  # the 10th byte holds bit 63 only
        return 0, -1
    return int(((acc >> 1) & 0x7FFFFFFFFFFFFFFF) ^ -(acc & 1)), at  # zigzag, with a logical shift


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
def _scan_into(data: U8, at: int, n_kinds: int, n_groups: int, head: I64, buf: I64) -> int:  # pragma: no cover
    """The v1 body from ``at`` into ``head`` (``_HEAD`` values, zero on entry; ``head[_OK]`` left 0 where the
    caller must use fastavro) and ``buf``: kinds, name ranges (first, end per name), groups, streams, starts,
    durations, their counts in ``head[8:]``. Returns the values of ``buf`` used."""
    lo, at = _string(data, at)
    if at < 0:
        return 0
    head[_JOB_LO], head[_JOB_HI] = lo, at
    rank, at = _long(data, at)
    if at < 0:
        return 0
    step, at = _long(data, at)
    if at < 0:
        return 0
    head[_RANK], head[_STEP] = rank, step
    head[_LAYOUT_LO] = at
    used = _layout_into(data, at, n_kinds, n_groups, head, buf)
    if used < 0:
        return 0
    return _times_into(data, head[_LAYOUT_HI], head, buf, used)


@numba.njit(cache=True, nogil=True)
def _layout_into(data: U8, at: int, n_kinds: int, n_groups: int, head: I64, buf: I64) -> int:  # pragma: no cover
    """The layout (kinds, names, groups, streams) from ``at`` into ``buf`` from 0, their counts into
    ``head[8:12]`` and its end into ``head[_LAYOUT_HI]``: the values used, -1 where it is not read here."""
    used = 0
    n, at = _longs(data, at, buf[used:], 0, n_kinds, True)
    if at < 0:
        return -1
    head[8] = n
    used += n
    n = 0
    while True:  # names: a (first, end) pair per string
        count, at = _block(data, at)
        if at < 0 or used + 2 * (n + count) > buf.size:
            return -1
        if count == 0:
            break
        for _ in range(count):
            first, at = _string(data, at)
            if at < 0:
                return -1
            buf[used + 2 * n] = first
            buf[used + 2 * n + 1] = at
            n += 1
    head[9] = n
    used += 2 * n
    for slot, bound in ((10, n_groups), (11, 0)):
        n, at = _longs(data, at, buf[used:], 0, bound, bound > 0)
        if at < 0:
            return -1
        head[slot] = n
        used += n
    head[_LAYOUT_HI] = at
    return used


@numba.njit(cache=True, nogil=True)
def _times_into(data: U8, at: int, head: I64, buf: I64, used: int) -> int:  # pragma: no cover - compiled
    """The starts and durations from ``at`` into ``buf`` from ``used``, their counts into ``head[12:14]``, the
    body's end into ``head[_END]`` and ``head[_OK]`` set: the values used (``used`` where not read here)."""
    for slot in (12, 13):
        n, at = _longs(data, at, buf[used:], 0, 0, False)
        if at < 0:
            return used
        head[slot] = n
        used += n
    head[_END] = at
    head[_OK] = 1
    return used


@numba.njit(cache=True, nogil=True)
def _scan(data: U8, at: int, n_kinds: int, n_groups: int) -> tuple[I64, I64]:  # pragma: no cover - compiled
    """:func:`_scan_into` of one body: its header and the values read (a copy)."""
    head = np.zeros(_HEAD, dtype=np.int64)
    # Every item takes a byte at least and a name two values: 2 values a byte bound the buffer; the values read
    # are copied out of it (what the batch keeps: ~7 values a phase, not ~40).
    buf = np.empty(2 * data.size + 1, dtype=np.int64)
    used = _scan_into(data, at, n_kinds, n_groups, head, buf)
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


@numba.njit(cache=True, nogil=True)
def _layout_at(data: U8, lo: int, hi: int, n_kinds: int, n_groups: int) -> tuple[I64, I64]:  # pragma: no cover
    head = np.zeros(_HEAD, dtype=np.int64)
    buf = np.empty(2 * (hi - lo) + 1, dtype=np.int64)
    used = _layout_into(data[:hi], lo, n_kinds, n_groups, head, buf)
    if used >= 0 and head[_LAYOUT_HI] == hi:
        head[_OK] = 1
    return head, buf[:max(used, 0)].copy()


def read_layout(data: bytes, lo: int, hi: int, n_kinds: int, n_groups: int) -> tuple[I64, I64, I64, I64] | None:
    """The layout whose v1 bytes (kinds, names, groups, streams) are ``data[lo:hi]``: kinds and groups (enum
    indices), the names' byte ranges in ``data`` (``phases x 2``) and streams; ``None`` where those bytes are
    not exactly one layout."""
    head, buf = _layout_at(np.frombuffer(data, dtype=np.uint8), lo, hi, n_kinds, n_groups)
    if not head[_OK]:
        return None
    k, n, g = int(head[8]), int(head[9]), int(head[10])
    return buf[:k], buf[k:k + 2 * n].reshape(-1, 2), buf[k + 2 * n:k + 2 * n + g], buf[k + 2 * n + g:]


#: Distinct job ids and layouts one :func:`scan_phase_batches` call tells apart (the messages of a job beyond
#: them are left to the record-wise decode).
MAX_JOBS, MAX_LAYOUTS = 64, 1024


@numba.njit(cache=True, nogil=True)
def _equal(data: U8, a: int, b: int, n: int) -> bool:  # pragma: no cover - compiled
    """``data[a:a + n] == data[b:b + n]``."""
    x, y = data[a:a + n], data[b:b + n]
    diff = 0
    for j in range(n):  # no early exit: the loop vectorizes
        diff |= x[j] ^ y[j]
    return diff == 0


@numba.njit(cache=True, nogil=True)
def known_range(data: U8, at: int, end: int, known: I64, n_known: int, last: int,
                exact: bool) -> int:  # pragma: no cover - compiled
    """The row of ``known`` (``rows x 2``: byte ranges of ``data``) whose bytes ``data`` holds from ``at`` (and
    ends at ``end`` where ``exact``, else before ``end``); ``last`` is tried first; -1 where none does."""
    for t in range(-1, n_known):
        c = last if t < 0 else t
        if c < 0 or (t >= 0 and c == last):
            continue
        lo, n = known[c, 0], known[c, 1] - known[c, 0]
        if (at + n == end if exact else at + n <= end) and _equal(data, at, lo, n):
            return c
    return -1


@numba.njit(cache=True, nogil=True)
def _checked_layout(head: I64, buf: I64) -> bool:  # pragma: no cover - compiled
    """Whether a layout read by :func:`_layout_into` passes :meth:`PhaseBatch.check` (equal column lengths,
    streams of -1 or more): one that does not is left to the record-wise decode, which names the reason."""
    k = head[8]
    if not head[9] == head[10] == head[11] == k:
        return False
    return bool(np.all(buf[4 * k:5 * k] >= -1))  # streams


@numba.njit(cache=True, nogil=True)
def _checked_times(buf: I64, at: int, k: int, time_limit: int) -> bool:  # pragma: no cover - compiled
    """Whether the ``k`` starts then ``k`` durations in ``buf`` from ``at`` are within the records' bounds."""
    starts, durations = buf[at:at + k], buf[at + k:at + 2 * k]
    return bool(np.all((starts > -time_limit) & (starts < time_limit)) and np.all((durations >= 0)
                                                                                   & (durations < time_limit)))


@numba.njit(cache=True, nogil=True)
def _scan_many(data: U8, bounds: I64, version: int, n_kinds: int, n_groups: int,
               time_limit: int) -> tuple[I64, I64, I64, I64]:  # pragma: no cover - compiled
    """See :func:`scan_phase_batches`."""
    n = bounds.size - 1
    rows = np.full((n, len(PHASE_ROW_FIELDS)), -1, dtype=np.int64)
    jobs = np.zeros((MAX_JOBS, 2), dtype=np.int64)
    layouts = np.zeros((MAX_LAYOUTS, 3), dtype=np.int64)  # byte range, width
    n_jobs = n_layouts = 0
    last_job = last_layout = -1
    longest = 0
    for i in range(n):
        longest = max(longest, bounds[i + 1] - bounds[i])
    head = np.zeros(_HEAD, dtype=np.int64)
    buf = np.empty(2 * longest + 1, dtype=np.int64)
    times = np.empty(max(16, (bounds[n] - bounds[0]) // 8), dtype=np.int64)
    used = 0
    for i in range(n):
        lo, hi = bounds[i], bounds[i + 1]
        if hi - lo < 2 or data[lo] != MAGIC or data[lo + 1] != version:
            continue
        body = data[:hi]  # reads stop at this message's end
        first, at = _string(body, lo + 2)
        if at < 0:
            continue
        job = known_range(body, first, at, jobs, n_jobs, last_job, True)
        if job < 0 and n_jobs < MAX_JOBS:
            job, n_jobs = n_jobs, n_jobs + 1
            jobs[job, 0], jobs[job, 1] = first, at
        rank, at = _long(body, at)
        if at < 0 or job < 0 or not 0 <= rank <= 2**31 - 1:
            continue
        step, at = _long(body, at)
        if at < 0:
            continue
        lay = known_range(body, at, hi, layouts[:, :2], n_layouts, last_layout, False)
        if lay >= 0:
            at += layouts[lay, 1] - layouts[lay, 0]
        else:
            head[:] = 0
            if _layout_into(body, at, n_kinds, n_groups, head, buf) < 0 or not _checked_layout(head, buf) \
                    or n_layouts == MAX_LAYOUTS:
                continue
            lay, n_layouts = n_layouts, n_layouts + 1
            layouts[lay, 0], layouts[lay, 1], layouts[lay, 2] = at, head[_LAYOUT_HI], head[8]
            at = head[_LAYOUT_HI]
        last_job, last_layout = job, lay
        k = layouts[lay, 2]
        if used + 2 * k > times.size:
            grown = np.empty(max(2 * times.size, used + 2 * k), dtype=np.int64)
            grown[:used] = times[:used]
            times = grown
        # The times straight into the buffer (a message that fails is overwritten by the next).
        n_starts, at = _longs(body, at, times[used:used + k], 0, 0, False)
        if at < 0 or n_starts != k:
            continue
        n_durations, at = _longs(body, at, times[used + k:used + 2 * k], 0, 0, False)
        if at != hi or n_durations != k or not _checked_times(times, used, k, time_limit):
            continue
        row = rows[i]
        row[0], row[1], row[2], row[3], row[4] = job, rank, step, lay, used
        used += 2 * k
    return rows, jobs[:n_jobs].copy(), layouts[:n_layouts].copy(), times[:used].copy()


#: The columns of :func:`scan_phase_batches`'s rows, in order.
PHASE_ROW_FIELDS = ("job", "rank", "step", "layout", "offset")


def scan_phase_batches(data: bytes | memoryview, bounds: I64, version: int, n_kinds: int, n_groups: int,
                       time_limit: int) -> tuple[I64, I64, I64, I64]:
    """Many PhaseBatch messages at once: ``data`` the messages joined, message ``i`` from byte ``bounds[i]`` to
    ``bounds[i + 1]`` (each: magic byte, the writer's ``version``, a v1 body); ``n_kinds`` / ``n_groups`` as
    :func:`read_phase_batch`; ``time_limit`` the bound of every time (ns, exclusive).

    Returns ``rows`` (``messages x 5`` int64, :data:`PHASE_ROW_FIELDS`: the row of the message's job id and of
    its layout in the next two answers, its rank, step, and where its times begin in the last; all -1 for a
    message left to the record-wise decode: anything not read as fastavro reads it, values
    :meth:`PhaseBatch.check` rejects, or a job id or layout beyond the first :data:`MAX_JOBS` /
    :data:`MAX_LAYOUTS`), the job ids' byte ranges in ``data`` (``jobs x 2``), the layouts' (``layouts x 3``:
    first byte, end, phases; a layout's bytes are those of its first message, which was read whole), and the
    read-only times (per message read: its starts, then its durations, ns)."""
    rows, jobs, layouts, times = _scan_many(np.frombuffer(data, dtype=np.uint8), bounds, version, n_kinds,
                                               n_groups, time_limit)
    times.flags.writeable = False
    return rows, jobs, layouts, times
