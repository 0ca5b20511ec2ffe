"""Call modes: how a rank's calls of one kernel fall into durations, and the calls a slowdown moved.

A kernel's calls fall into modes (one per shape, roughly: the summaries' clusters). A rank slowed in a
kernel from some step on moves that share of its calls of the slowed modes up: the mode keeps the calls of
the steps before the onset, a new one above holds the rest, while its peers keep the whole mode. The share
moved is the share of the traced steps the slowdown was spent in, which the kernel summaries tell without
steps (a window pools its calls) and without phases: an impact spread over every step reads a fault that
began half way at half its cost (:mod:`argus.detectors.impact`). A kernel's :class:`CallCensus` counts each
rank's calls per duration bin over the job's windows; :func:`moved_calls` compares each rank's with its peers'.

Details and reasoning: docs/internals/detectors.md (``argus.detectors.call_modes``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from argus.core.errors import DetectorError

__all__ = ["CallCensus", "ModeParams", "affected_share", "moved_calls"]

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]

#: A census entry's key: its rank in the high bits, its duration bin in the low ones.
_BIN_BITS = 32


@dataclass(frozen=True)
class ModeParams:
    """Thresholds of the call-mode census (defaults in brackets): clusters are counted in duration bins of
    ``resolution`` (log ratio) [0.01]; bins within ``tolerance`` (log ratio) of a neighbour with calls are one
    mode when ranks are compared [0.05: a slowdown under 5 % moves no calls out of its mode]. A mode moved when a rank
    lacks at least ``min_share`` of its peers' calls there [0.2] and they have at least ``min_calls`` calls in
    it [8]; the rank's calls above its peers' must hold at least ``min_landed`` of the calls it lacks [0.5]
    (the calls went up, not away). Ranks are compared
    with those of the same calls of the kernel, within ``same_calls`` (relative) [0.02].

    Raises :class:`DetectorError` for out-of-range values."""

    resolution: float = 0.01
    tolerance: float = 0.05
    min_share: float = 0.2
    min_calls: float = 8.0
    min_landed: float = 0.5
    same_calls: float = 0.02

    def __post_init__(self) -> None:
        if not (1e-4 <= self.resolution <= self.tolerance < 1.0):
            raise DetectorError(f"need 1e-4 <= resolution <= tolerance < 1, got {self.resolution}, {self.tolerance}")
        if not (self.min_calls >= 1.0 and 0.0 <= self.same_calls < 1.0):
            raise DetectorError(f"need min_calls >= 1 and same_calls in [0, 1), got {self.min_calls}, "
                                f"{self.same_calls}")
        if not (0.0 < self.min_share < 1.0 and 0.0 < self.min_landed <= 1.0):
            raise DetectorError(f"need min_share in (0, 1) and min_landed in (0, 1], got {self.min_share}, "
                                f"{self.min_landed}")


class CallCensus:
    """One kernel's calls per (rank, duration bin) over a job: its clusters' calls, each counted in the bin of
    its median, ``floor(ln(median ns) / resolution)``. Held as two arrays (16 bytes per rank and bin, a rank
    holding a few bins a kernel), additions batched and joined once they outgrow what is held."""

    __slots__ = ("_calls", "_keys", "_pending", "_pending_n", "resolution")

    def __init__(self, resolution: float = ModeParams.resolution) -> None:
        self.resolution = resolution
        self._keys: I64 = np.empty(0, np.int64)
        self._calls: F64 = np.empty(0, np.float64)
        self._pending: list[tuple[I64, F64]] = []
        self._pending_n = 0

    def add(self, rank: npt.ArrayLike, p50_ns: npt.ArrayLike, calls: npt.ArrayLike) -> None:
        """Add clusters, one per entry: its rank, median duration (ns) and calls; clusters without a positive
        median or calls are left out."""
        at = np.asarray(p50_ns, dtype=np.float64)
        n = np.asarray(calls, dtype=np.float64)
        r = np.asarray(rank, dtype=np.int64)
        ok = np.isfinite(at) & (at >= 1.0) & (n > 0.0) & (r >= 0)
        bins = np.floor(np.log(at[ok]) / self.resolution).astype(np.int64)
        self._take((r[ok] << _BIN_BITS) | bins, n[ok])

    def merge(self, other: CallCensus) -> None:
        """Add another census's calls (of the same resolution)."""
        self._take(*other._held())

    def entries(self) -> tuple[I64, I64, F64]:
        """Rank, duration bin and calls of every (rank, bin) with calls, sorted by rank then bin."""
        keys, calls = self._held()
        return keys >> _BIN_BITS, keys & ((1 << _BIN_BITS) - 1), calls

    def __len__(self) -> int:
        return len(self._held()[0])

    def _take(self, keys: I64, calls: F64) -> None:
        self._pending.append((keys, calls))
        self._pending_n += keys.size
        if self._pending_n > max(4096, self._keys.size):
            self._join()

    def _held(self) -> tuple[I64, F64]:
        if self._pending:
            self._join()
        return self._keys, self._calls

    def _join(self) -> None:
        keys = np.concatenate([self._keys, *(k for k, _ in self._pending)])
        calls = np.concatenate([self._calls, *(c for _, c in self._pending)])
        self._keys, at = np.unique(keys, return_inverse=True)
        self._calls = np.bincount(at.ravel(), weights=calls, minlength=self._keys.size).astype(np.float64)
        self._pending, self._pending_n = [], 0


def moved_calls(census: CallCensus, p: ModeParams) -> dict[int, tuple[float, float]]:
    """Per rank of ``census``: (calls it moved up out of modes, its peers' calls in those modes), for the ranks
    that moved at least ``min_share`` of some mode and whose calls above their peers' hold at least
    ``min_landed`` of them; its peers are the other ranks of the same calls of the kernel (their lower median
    calls per mode). Ranks of no such move are absent."""
    rank, at, calls = census.entries()
    ranks, row = np.unique(rank, return_inverse=True)
    per_rank = np.bincount(row, weights=calls, minlength=ranks.size).astype(np.float64)
    out: dict[int, tuple[float, float]] = {}
    for members in _same_work(per_rank, p.same_calls):
        keep = np.isin(row, members)
        sub_row = np.searchsorted(members, row[keep])
        counts, lowest = _counts(sub_row, at[keep], calls[keep], members.size, p.tolerance / census.resolution)
        for i, move in _moved(counts, lowest, p).items():
            out[int(ranks[members[i]])] = move
    return out


def _same_work(per_rank: F64, same_calls: float) -> list[I64]:
    """Indices of ``per_rank`` (each rank's calls) in sets of two or more of the same calls (within
    ``same_calls``, relative), each sorted: the ranks that ran the same work (a pipeline stage's other layers
    run other counts)."""
    order = np.argsort(per_rank, kind="stable")
    sets: list[list[int]] = []
    first = -1.0
    for i in order.tolist():
        if sets and per_rank[i] <= (1.0 + same_calls) * first:
            sets[-1].append(i)
        else:
            sets.append([i])
            first = float(per_rank[i])
    return [np.sort(np.asarray(s, dtype=np.int64)) for s in sets if len(s) >= 2]


def _counts(row: I64, at: I64, calls: F64, n_rows: int, gap_bins: float) -> tuple[F64, F64]:
    """Rows x modes: each row's calls per mode, the modes being the bins any row has calls in, joined where the
    next lies within ``gap_bins``; and each mode's lowest bin."""
    order = np.argsort(at, kind="stable")
    mode = np.empty(at.size, dtype=np.int64)
    mode[order] = np.concatenate(([0], np.cumsum(np.diff(at[order]) > gap_bins)))
    counts = np.zeros((n_rows, int(mode.max()) + 1 if mode.size else 0))
    np.add.at(counts, (row, mode), calls)
    lowest = np.full(counts.shape[1], np.iinfo(np.int64).max)
    np.minimum.at(lowest, mode, at)
    return counts, lowest.astype(np.float64)


def _moved(counts: F64, lowest: F64, p: ModeParams) -> dict[int, tuple[float, float]]:
    """:func:`moved_calls` of one set of rows of the same work (rows x modes, each mode's lowest bin)."""
    ref = _lower_median_of_others(counts)
    lack = ref - counts
    moved = (lack >= p.min_share * ref) & (ref >= p.min_calls)
    out: dict[int, tuple[float, float]] = {}
    for i in np.flatnonzero(moved.any(axis=1)).tolist():
        cols = moved[i]
        lost = float(lack[i, cols].sum())
        extra = np.maximum(counts[i] - ref[i], 0.0)
        # The calls it lacks must sit above the modes it lost them from: a slowdown moves calls up.
        landed = float(extra[lowest > lowest[cols].min()].sum())
        if landed >= p.min_landed * lost:
            out[i] = (lost, float(ref[i, cols].sum()))
    return out


def _lower_median_of_others(counts: F64) -> F64:
    """Ranks x modes: each rank's peers' (the other rows') lower median calls per mode. The lower one: of two
    peers, one holding calls in a mode the other lacks does not make half of them the other's reference."""
    n = counts.shape[0]
    k = (n - 2) // 2  # the lower median of n - 1 values is their k-th smallest (0-based)
    s = np.sort(counts, axis=0)
    return np.where(counts <= s[k], s[min(k + 1, n - 1)], s[k])


def affected_share(moves: Iterable[tuple[float, float] | None]) -> float:
    """The share of the traced steps a rank's slowdown was spent in, from its kernels' (moved, of) calls
    (:func:`moved_calls`; None: no move): the calls moved over the calls of the modes they left, pooled; 1.0
    without moves (a slowdown from the start moves every call of its modes: about 1.0 too)."""
    lost = of = 0.0
    for move in moves:
        if move is not None:
            lost, of = lost + move[0], of + move[1]
    return min(lost / of, 1.0) if of > 0.0 else 1.0
