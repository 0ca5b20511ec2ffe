"""Columnar decoding of many PhaseBatch and Step messages at once, straight into numpy arrays.

Decoding record by record costs ~40 us a PhaseBatch and ~5 us a Step in Python (a compiled read, then tuples, a
frozen record and its checks): 0.6-0.9 s for the 20,480 records of one step of a 10,240-rank job. Here the
messages are joined into one buffer and read by one compiled pass each (:func:`~argus.schemas.phase_reading.
scan_phase_batches`, :func:`~argus.schemas.step_reading.scan_steps`), which also applies the records'
checks. The job ids and phase layouts that the messages repeat are recognized by their bytes in that pass (a
message whose layout bytes equal a layout read before skips them: one compare, no parse) and turned into
Python values once per distinct value. What is left per message is array work.

Details and reasoning: docs/internals/schemas.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from argus.schemas.codec import codec
from argus.schemas.phase_reading import read_layout, scan_phase_batches
from argus.schemas.records import TIME_LIMIT_NS, ParallelGroup, PhaseBatch, PhaseKind, Step, raw_phase_layout
from argus.schemas.step_reading import STEP_FIELDS, STEP_VERSION, scan_steps

__all__ = ["JoinBuffer", "PhaseColumns", "StepColumns", "decode_phase_batches", "decode_steps"]

I64 = npt.NDArray[np.int64]
#: The writer version the compiled passes read (both schemas' only version so far).
_V1 = 1


class JoinBuffer:
    """Where a caller's messages are joined, reused from call to call: joining ~40 MB of PhaseBatch messages
    (a step of 10,240 ranks) into fresh memory costs twice the copy into memory already mapped. Grows to the
    largest call's size; one per decoding thread."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def join(self, payloads: Sequence[bytes]) -> tuple[memoryview, I64]:
        """The messages as one buffer (a view of this one's memory, valid until the next call) and the byte
        where each begins (``n + 1`` bounds)."""
        bounds = np.zeros(len(payloads) + 1, dtype=np.int64)
        np.cumsum(np.fromiter(map(len, payloads), dtype=np.int64, count=len(payloads)), out=bounds[1:])
        total = int(bounds[-1])
        if len(self._buf) < total:
            self._buf = bytearray(max(total, 2 * len(self._buf)))
        view = memoryview(self._buf)
        at = 0
        for p in payloads:
            end = at + len(p)
            view[at:end] = p
            at = end
        return view[:total], bounds


def _job_ids(data: memoryview, ranges: I64) -> tuple[tuple[str, ...], npt.NDArray[np.bool_]]:
    """The job ids at the byte ranges ``ranges`` (``jobs x 2``) and which are UTF-8 (others: '')."""
    jobs, ok = [], np.ones(len(ranges), dtype=bool)
    for j, (lo, hi) in enumerate(ranges.tolist()):
        try:
            jobs.append(str(data[lo:hi], "utf-8"))
        except UnicodeDecodeError:
            jobs.append("")
            ok[j] = False
    return tuple(jobs), ok


@dataclass(frozen=True, eq=False)
class PhaseColumns:
    """PhaseBatch messages decoded by columns: row ``k`` is message ``index[k]`` of the input. ``jobs`` the
    distinct job ids, ``job`` each row's (an index into ``jobs``); ``rank`` and ``step``; ``layouts`` the
    distinct (kinds, names, groups, streams) tuples (shared with the record-wise decode's; ``None`` for one no
    row holds), ``layout`` each row's; ``times`` one read-only int64 buffer (ns), row ``k``'s starts at
    ``offset[k]`` followed by its durations, ``width[k]`` values each. ``rest``: the messages left to the
    record-wise decode."""

    jobs: tuple[str, ...]
    job: I64
    rank: I64
    step: I64
    layouts: tuple[tuple[Any, ...] | None, ...]
    layout: I64
    offset: I64
    width: I64
    times: I64
    index: I64
    rest: tuple[int, ...]

    def __len__(self) -> int:
        return int(self.index.size)

    def starts(self, k: int) -> I64:
        """Row ``k``'s ``start_ns`` (a read-only view)."""
        at = int(self.offset[k])
        return self.times[at:at + int(self.width[k])]

    def durations(self, k: int) -> I64:
        """Row ``k``'s ``duration_ns`` (a read-only view)."""
        at, w = int(self.offset[k]), int(self.width[k])
        return self.times[at + w:at + 2 * w]

    def batch(self, k: int) -> PhaseBatch:
        """Row ``k`` as the record the record-wise decode gives (``packed_times`` and the shared layout set)."""
        at, w = int(self.offset[k]), int(self.width[k])
        both = self.times[at:at + 2 * w]
        layout = self.layouts[self.layout[k]]
        assert layout is not None  # a row's layout was read
        return PhaseBatch.of_layout(self.jobs[self.job[k]], int(self.rank[k]), int(self.step[k]),
                                    layout, tuple(both[:w].tolist()),
                                    tuple(both[w:].tolist()), both.astype("<i8").tobytes())


def decode_phase_batches(payloads: Sequence[bytes], buffer: JoinBuffer | None = None) -> PhaseColumns:
    """The PhaseBatch messages ``payloads`` (wire bytes, as :meth:`PhaseBatch.decode` takes) as columns;
    ``buffer``: where to join them (default: a new one)."""
    n = len(payloads)
    data, bounds = (buffer or JoinBuffer()).join(payloads)
    kinds, groups = len(PhaseKind), len(ParallelGroup)
    if codec(PhaseBatch.SCHEMA).latest == _V1:  # the compiled pass reads v1 as the latest only
        rows, job_ranges, layout_ranges, times = scan_phase_batches(data, bounds, _V1, kinds, groups, TIME_LIMIT_NS)
    else:
        rows, job_ranges = np.full((n, 5), -1, dtype=np.int64), np.empty((0, 2), dtype=np.int64)
        layout_ranges, times = np.empty((0, 3), dtype=np.int64), np.empty(0, dtype=np.int64)
    jobs, job_ok = _job_ids(data, job_ranges)
    layouts: list[tuple[Any, ...] | None] = []
    for lo, hi, _ in layout_ranges.tolist():  # a layout's values once, whatever the messages holding it
        raw = bytes(data[lo:hi])
        got = read_layout(raw, 0, len(raw), kinds, groups)
        layouts.append(None if got is None else raw_phase_layout(raw, raw, *got))
    layout_ok = np.array([lay is not None for lay in layouts], dtype=bool)
    job, lay = rows[:, 0], rows[:, 3]
    good = job >= 0
    good[good] = job_ok[job[good]] & layout_ok[lay[good]]
    idx = np.flatnonzero(good)
    return PhaseColumns(jobs, job[idx], rows[idx, 1], rows[idx, 2], tuple(layouts), lay[idx], rows[idx, 4],
                        layout_ranges[lay[idx], 2] if idx.size else idx, times, idx,
                        tuple(np.flatnonzero(~good).tolist()))


@dataclass(frozen=True, eq=False)
class StepColumns:
    """Step messages decoded by columns: row ``k`` is message ``index[k]`` of the input; ``jobs`` / ``job`` as
    :class:`PhaseColumns`; ``start_ns``, ``wall_ns``, ``gpu_ns`` (ns; ``gpu_ns`` meaningful where
    ``has_gpu``); ``expert_tokens`` (meaningful where ``has_tokens``). ``rest``: the messages left to the
    record-wise decode."""

    jobs: tuple[str, ...]
    job: I64
    rank: I64
    step: I64
    start_ns: I64
    wall_ns: I64
    gpu_ns: I64
    has_gpu: npt.NDArray[np.bool_]
    expert_tokens: I64
    has_tokens: npt.NDArray[np.bool_]
    index: I64
    rest: tuple[int, ...]

    def __len__(self) -> int:
        return int(self.index.size)

    def record(self, k: int) -> Step:
        """Row ``k`` as the record the record-wise decode gives."""
        return Step(self.jobs[self.job[k]], int(self.rank[k]), int(self.step[k]), int(self.start_ns[k]),
                    int(self.wall_ns[k]), int(self.gpu_ns[k]) if self.has_gpu[k] else None,
                    int(self.expert_tokens[k]) if self.has_tokens[k] else None)


def decode_steps(payloads: Sequence[bytes], buffer: JoinBuffer | None = None) -> StepColumns:
    """The Step messages ``payloads`` (wire bytes, as :meth:`Step.decode` takes) as columns; ``buffer``: where to
    join them (default: a new one)."""
    n = len(payloads)
    data, bounds = (buffer or JoinBuffer()).join(payloads)
    if codec(Step.SCHEMA).latest == STEP_VERSION:  # a newer layout than the compiled pass knows: record-wise
        cols, job_ranges = scan_steps(data, bounds, TIME_LIMIT_NS)
    else:
        cols, job_ranges = np.zeros((len(STEP_FIELDS), n), dtype=np.int64), np.empty((0, 2), dtype=np.int64)
    c = dict(zip(STEP_FIELDS, cols, strict=True))
    jobs, job_ok = _job_ids(data, job_ranges)
    good = c["ok"] == 1
    good[good] = job_ok[c["job"][good]]
    idx = np.flatnonzero(good)
    return StepColumns(jobs, c["job"][idx], c["rank"][idx], c["step"][idx], c["start_ns"][idx], c["wall_ns"][idx],
                       c["gpu_ns"][idx], c["has_gpu"][idx] == 1, c["expert_tokens"][idx], c["has_tokens"][idx] == 1,
                       idx, tuple(np.flatnonzero(~good).tolist()))
