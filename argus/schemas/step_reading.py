"""Compiled reading of many Step Avro messages (``step.v1`` and ``step.v2``) at once: one pass over the joined
bytes, the fields kept as int64 columns (see :mod:`argus.schemas.record_columns`).

The v1 body is a string (job id), four longs (rank, step, start_ns, wall_ns) and a union of null and long (gpu_ns),
in the binary encoding of the Avro specification; v2 appends a second such union (expert_tokens). A message this
pass does not read exactly as fastavro would (another version, a truncated or overlong body, a union branch beyond
the two), or whose values :meth:`~argus.schemas.records.Step.check` rejects, is left to the record-wise decode,
which decodes it or raises the same error as ever.

Imported only where records are decoded (the stream worker, the tools), not by the rank-side tracer (numba).
"""

from __future__ import annotations

import numba
import numpy as np
import numpy.typing as npt

from argus.schemas.codec import MAGIC
from argus.schemas.phase_reading import MAX_JOBS, _long, _string, known_range

__all__ = ["STEP_FIELDS", "STEP_VERSION", "scan_steps"]

U8 = npt.NDArray[np.uint8]
I64 = npt.NDArray[np.int64]
#: The columns of :func:`scan_steps`'s answer, in order.
STEP_FIELDS = ("ok", "job", "rank", "step", "start_ns", "wall_ns", "gpu_ns", "has_gpu", "expert_tokens",
               "has_tokens")
_OK, _JOB, _RANK, _STEP, _START, _WALL, _GPU, _HAS_GPU, _TOKENS, _HAS_TOKENS = range(len(STEP_FIELDS))
#: The newest body layout this pass reads (older ones too).
STEP_VERSION = 2


@numba.njit(cache=True, nogil=True)
def _scan_steps(data: U8, bounds: I64, time_limit: int) -> tuple[I64, I64]:  # pragma: no cover
    n = bounds.size - 1
    out = np.zeros((len(STEP_FIELDS), n), dtype=np.int64)
    jobs = np.zeros((MAX_JOBS, 2), dtype=np.int64)
    n_jobs, last_job = 0, -1
    for i in range(n):
        lo, hi = bounds[i], bounds[i + 1]
        if hi - lo < 2 or data[lo] != MAGIC or not 1 <= data[lo + 1] <= STEP_VERSION:
            continue
        version = data[lo + 1]
        body = data[:hi]  # reads stop at this message's end
        first, at = _string(body, lo + 2)
        if at < 0:
            continue
        job = known_range(body, first, at, jobs, n_jobs, last_job, True)
        if job < 0:
            if n_jobs == MAX_JOBS:
                continue
            job, n_jobs = n_jobs, n_jobs + 1
            jobs[job, 0], jobs[job, 1] = first, at
        out[_JOB, i] = last_job = job
        ok = True
        for f in (_RANK, _STEP, _START, _WALL):
            v, at = _long(body, at)
            if at < 0:
                ok = False
                break
            out[f, i] = v
        if not ok:
            continue
        branch, at = _long(body, at)
        if at < 0 or not 0 <= branch <= 1:
            continue
        if branch == 1:
            v, at = _long(body, at)
            if at < 0 or not 0 <= v < time_limit:
                continue
            out[_GPU, i], out[_HAS_GPU, i] = v, 1
        if version >= 2:
            branch, at = _long(body, at)
            if at < 0 or not 0 <= branch <= 1:
                continue
            if branch == 1:
                v, at = _long(body, at)
                if at < 0 or v < 0:
                    continue
                out[_TOKENS, i], out[_HAS_TOKENS, i] = v, 1
        if at != hi or not 0 <= out[_RANK, i] <= 2**31 - 1 or not -time_limit < out[_START, i] < time_limit \
                or not 0 <= out[_WALL, i] < time_limit:
            continue
        out[_OK, i] = 1
    return out, jobs[:n_jobs].copy()


def scan_steps(data: bytes | memoryview, bounds: I64, time_limit: int) -> tuple[I64, I64]:
    """Many Step messages at once: ``data`` the messages joined, message ``i`` from byte ``bounds[i]`` to
    ``bounds[i + 1]`` (each: magic byte, the writer's version, a body of that version up to
    :data:`STEP_VERSION`); ``time_limit`` the bound of every
    time and duration (ns, exclusive). Returns ``len(STEP_FIELDS) x n`` int64 columns (:data:`STEP_FIELDS`;
    ``ok`` 0: left to the record-wise decode, also past :data:`~argus.schemas.phase_reading.MAX_JOBS` job ids;
    ``job`` the row of the message's job id in the second answer, ``jobs x 2`` byte ranges of ``data``;
    ``gpu_ns`` meaningful where ``has_gpu``, ``expert_tokens`` where ``has_tokens``)."""
    return _scan_steps(np.frombuffer(data, dtype=np.uint8), bounds, time_limit)
