"""A job's recent steps of phase timings for L2, folded once per step into compact columns (pure numpy).

:class:`PhaseHistory` keeps, per folded step, each rank's own time per phase id (ns, the duration less
its nested blocking collectives: what :func:`~argus.detectors.l2_phases.detect_l2` reads) and nothing of
the decoded :class:`~argus.schemas.records.PhaseBatch`. Steps whose ranks and layouts are the same (every
step of a steady job) share one :class:`_Shape`: the ranks, their layouts and a ``cells x steps`` matrix
(int32 while the times fit, else int64) holding one column per step, so a diagnosis sorts that matrix
along its rows for the medians over steps instead of rebuilding a table. Memory per (rank, step): 4 or 8
bytes per phase id of the rank's layout, plus 8 bytes of arrival order.

:meth:`PhaseHistory.detect` gives exactly what ``detect_l2(PhaseTable.from_batches(batches), ...)`` gives
for the held steps' batches in step order (each step's batches in arrival order, the last of a duplicated
(rank, step) in its first position): the same phase dictionary, in the same order, and the same per
(rank, phase) statistics.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from operator import attrgetter

import numpy as np
import numpy.typing as npt

from argus.detectors.l2_phases import L2Params, L2Result, PhaseStats, judge_l2, phase_stats, rank_positions
from argus.detectors.phase_fold import store_own_times
from argus.detectors.phase_layout import COMPUTE_KINDS, LayoutIndex
from argus.schemas.records import JobTopology, PhaseBatch

__all__ = ["PhaseHistory", "row_medians"]

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
_INT32_MAX = 2**31 - 1
_RANK = attrgetter("rank")
#: Steps' columns staged before they are written into a shape's matrix at once (see _Shape).
_STAGED = 8
#: Values sorted at once for the medians over steps (a block of rows; 1 MiB of int32).
_SORT_BLOCK_VALUES = 1 << 18


def row_medians(mat: npt.NDArray[np.int32] | I64, cols: list[int] | None = None) -> F64:
    """Per row of ``mat``, the median of its values in columns ``cols`` (all when ``None``): the middle value,
    or the mean of the middle two (float64), as ``np.median`` gives them.

    Rows are sorted a block of ~1 MiB at a time: the whole matrix (80 MiB at 10,240 ranks x 200 steps)
    copied at once for its sort is fresh memory on every diagnosis, whose page faults cost several times
    the sort (~250 ms against ~25 ms on the reference VM)."""
    n = mat.shape[1] if cols is None else len(cols)
    out = np.empty(mat.shape[0])
    if n == 0:
        out.fill(np.nan)
        return out
    step = max(1, _SORT_BLOCK_VALUES // n)
    for lo in range(0, mat.shape[0], step):
        block = mat[lo:lo + step].copy() if cols is None else mat[lo:lo + step, cols]
        block.sort(axis=1)
        out[lo:lo + step] = (block[:, (n - 1) // 2].astype(np.float64) + block[:, n // 2].astype(np.float64)) / 2.0
    return out


class _Shape:
    """Sorted ranks and each one's layout index (``lay``), with one column per step of its cells' own times:
    rows are per rank (ascending), then per phase id of its layout (ascending); then the durations (waiting
    included) of the cells that nest blocking collectives (:attr:`PhaseLayout.nests`), in the same order."""

    def __init__(self, ranks: I64, lay: I64, index: LayoutIndex) -> None:
        self.ranks, self.lay = ranks, lay
        sizes, nsizes = _sizes(index, lay)
        self.offsets = np.cumsum(sizes) - sizes
        total = self.n_own = int(sizes.sum())
        self.raw_offsets = total + np.cumsum(nsizes) - nsizes
        self.cell_rank = np.repeat(ranks, sizes)
        self.cell_gid = np.empty(total, dtype=np.int64)
        self.cell_count = np.empty(total, dtype=np.int64)
        self.raw_rank = np.repeat(ranks, nsizes)
        self.raw_gid = np.empty(int(nsizes.sum()), dtype=np.int64)
        self.cell_nests = np.zeros(total, dtype=bool)
        for j in np.unique(lay).tolist():
            layout = index.layouts[j]
            rows = (self.offsets[lay == j][:, None] + np.arange(layout.ids.size)).ravel()
            self.cell_gid[rows] = np.tile(layout.ids, rows.size // max(layout.ids.size, 1))
            self.cell_count[rows] = np.tile(layout.counts, rows.size // max(layout.ids.size, 1))
            if layout.nests.size:
                self.cell_nests[(self.offsets[lay == j][:, None] + layout.nests).ravel()] = True
                raw_rows = (self.raw_offsets[lay == j][:, None] + np.arange(layout.nests.size)).ravel() - total
                self.raw_gid[raw_rows] = np.tile(layout.ids[layout.nests], raw_rows.size // layout.nests.size)
        self._mat: npt.NDArray[np.int32] | I64 = np.empty((total + self.raw_gid.size, 0), dtype=np.int32)
        # The latest steps' columns, one contiguous row each, until a reader needs the matrix or _STAGED fill: a
        # column written into the matrix touches a cache line per cell (174k at 10,240 ranks), a flush of several
        # columns the same lines once.
        self._stage: npt.NDArray[np.int32] | I64 | None = None
        self._staged: list[int] = []
        self.free: list[int] = []
        self.used = 0
        self._cells: tuple[JobTopology, I64, I64] | None = None

    @property
    def mat(self) -> npt.NDArray[np.int32] | I64:
        """The ``cells x columns`` matrix of the held steps (int32 while the times fit, else int64)."""
        self.flush()
        return self._mat

    def flush(self) -> None:
        """Write the staged columns into the matrix."""
        slots = self._staged
        if not slots or self._stage is None:
            return
        block = self._stage[:len(slots)].T
        first = slots[0]
        if slots == list(range(first, first + len(slots))):
            self._mat[:, first:first + len(slots)] = block
        else:
            self._mat[:, slots] = block
        self._staged = []

    def staged_bytes(self) -> int:
        return 0 if self._stage is None else int(self._stage.nbytes)

    def staged_column(self, slot: int) -> npt.NDArray[np.int32] | I64:
        """A contiguous row (of the matrix's dtype) that stands for column ``slot`` until :meth:`flush`."""
        if len(self._staged) >= _STAGED or slot in self._staged:
            self.flush()
        if self._stage is None or self._stage.dtype != self._mat.dtype:
            self._stage = np.empty((_STAGED, self._mat.shape[0]), dtype=self._mat.dtype)
        self._staged.append(slot)
        return self._stage[len(self._staged) - 1]

    def cells(self, topology: JobTopology, pid: I64, n_phases: int) -> I64:
        """Per own row, its cell of a ``world x phases`` array under ``topology`` and the phase positions ``pid``
        (per phase id), kept for the next diagnosis while both stay the same (a steady job's every one)."""
        held = self._cells
        if held is None or held[0] is not topology or not np.array_equal(held[1], pid):
            held = self._cells = (topology, pid.copy(),
                                  rank_positions(topology, self.cell_rank) * n_phases + pid[self.cell_gid])
        return held[2]

    def same(self, ranks: I64, lay: I64) -> bool:
        return bool(np.array_equal(self.ranks, ranks) and np.array_equal(self.lay, lay))

    def widen(self) -> None:
        """Hold times of int64 from now on (a time beyond int32's ns, ~2.1 s); staged columns are written first."""
        if self._mat.dtype != np.int64:
            self._mat = self.mat.astype(np.int64)

    def reserve(self, cap: int) -> int:
        """A free column for one step (written by the caller); ``cap``: the most columns worth holding."""
        if not self.free:
            old = self.mat
            width = old.shape[1]
            grown = max(width + 1, min(2 * width, cap), 4)
            self._mat = np.empty((old.shape[0], grown), dtype=old.dtype)
            self._mat[:, :width] = old
            self.free = list(range(grown - 1, width - 1, -1))
        slot = self.free.pop()
        self.used += 1
        return slot

    def release(self, slot: int) -> None:
        if slot in self._staged:
            self.flush()  # a staged column is its slot's until written: the slot may be reserved again
        self.free.append(slot)
        self.used -= 1


@dataclass
class _Piece:
    """One folded step: its shape and column, each sorted rank's arrival position, and the layouts in the
    order the step's batches first showed them (what orders the phase dictionary)."""

    shape: _Shape
    slot: int
    arrival: I64
    first_layouts: tuple[int, ...]

    @property
    def column(self) -> I64:
        """The step's column (ns, as int64): own times per cell, then the durations of the cells that nest."""
        out: I64 = self.shape.mat[:, self.slot].astype(np.int64)
        return out


class PhaseHistory:
    """Folded steps of one job's phase batches (see the module docstring); ``cap``: the most steps held at
    once (the diagnosis's ``history_steps``), which sizes the per-shape matrices."""

    def __init__(self, cap: int) -> None:
        self.cap = max(int(cap), 1)
        self.index = LayoutIndex()
        self._pieces: dict[int, _Piece] = {}
        self._shapes: list[_Shape] = []

    def __len__(self) -> int:
        return len(self._pieces)

    def holds(self, step: int) -> bool:
        return step in self._pieces

    def steps(self) -> list[int]:
        return sorted(self._pieces)

    def fold(self, step: int, batches: Sequence[PhaseBatch], ranks_of: Iterable[int] | None = None) -> None:
        """Fold one step's batches (one per rank, in arrival order) into the history, replacing any fold of it.
        ``ranks_of``: the batches' ranks, in their order, where the caller holds them (read from the batches
        else)."""
        which, folded = self.index.fold(batches)
        ranks = np.fromiter(map(_RANK, batches) if ranks_of is None else ranks_of, dtype=np.int64,
                            count=len(batches))
        order = np.argsort(ranks, kind="stable")
        where = np.empty_like(order)
        where[order] = np.arange(order.size)
        shape, slot = self._reserve(step, ranks[order], which[order], order.astype(np.int64))
        parts = [(shape.offsets[where[p.members]], shape.raw_offsets[where[p.members]], p.duration, p.nested,
                  self.index.layouts[p.layout].nests) for p in folded]
        column = shape.staged_column(slot)
        if not all(store_own_times(column, *part) for part in parts):
            # A time beyond int32: the matrix widened, the step written again whole into a column of int64.
            shape.widen()
            column = shape.staged_column(slot)
            for part in parts:
                store_own_times(column, *part)

    def replace(self, batch: PhaseBatch) -> None:
        """A batch of a folded step delivered again (or late): it replaces its rank's phases in that step,
        keeping the rank's first arrival position (a rank new to the step arrives last)."""
        piece = self._pieces[batch.step]
        shape = piece.shape
        which, folded = self.index.fold([batch])
        lay = int(which[0])
        nests = self.index.layouts[lay].nests
        row = np.maximum(folded[0].duration - folded[0].nested, 0).ravel() if folded else np.empty(0, np.int64)
        raw_row = np.maximum(folded[0].duration[:, nests], 0).ravel() if folded else np.empty(0, np.int64)
        i = int(np.searchsorted(shape.ranks, batch.rank))
        present = i < shape.ranks.size and int(shape.ranks[i]) == batch.rank
        column = piece.column
        if present and int(shape.lay[i]) == lay:
            column[shape.offsets[i]:shape.offsets[i] + row.size] = row
            column[shape.raw_offsets[i]:shape.raw_offsets[i] + raw_row.size] = raw_row
            self._place(batch.step, shape.ranks, shape.lay, piece.arrival, column)
            return
        # A new layout or a new rank: the step's columns are laid out again.
        layouts = [self.index.layouts[int(j)] for j in shape.lay.tolist()]
        segments = [column[shape.offsets[j]:shape.offsets[j] + x.ids.size] for j, x in enumerate(layouts)]
        raws = [column[shape.raw_offsets[j]:shape.raw_offsets[j] + x.nests.size] for j, x in enumerate(layouts)]
        ranks, lays, arrival = shape.ranks.tolist(), shape.lay.tolist(), piece.arrival.tolist()
        if present:
            lays[i], segments[i], raws[i] = lay, row, raw_row
        else:
            ranks.insert(i, batch.rank)
            lays.insert(i, lay)
            segments.insert(i, row)
            raws.insert(i, raw_row)
            arrival.insert(i, max(arrival, default=-1) + 1)
        parts = [np.asarray(s, dtype=np.int64) for s in segments + raws]
        column = np.concatenate(parts) if parts else np.empty(0, np.int64)
        self._place(batch.step, np.array(ranks, dtype=np.int64), np.array(lays, dtype=np.int64),
                    np.array(arrival, dtype=np.int64), column)

    def drop(self, step: int) -> None:
        """Forget a step (no-op if not held)."""
        piece = self._pieces.pop(step, None)
        if piece is not None:
            piece.shape.release(piece.slot)
            if piece.shape.used == 0:
                self._shapes = [s for s in self._shapes if s is not piece.shape]

    def state_bytes(self) -> int:
        """Bytes of the arrays held (matrices, cells, arrival orders)."""
        total = sum(s.mat.nbytes + s.staged_bytes() + sum(x.nbytes for x in (
            s.ranks, s.lay, s.offsets, s.cell_rank, s.cell_gid, s.cell_count, s.raw_offsets, s.raw_rank, s.raw_gid,
            s.cell_nests)) for s in self._shapes)
        return total + sum(p.arrival.nbytes for p in self._pieces.values())

    def _place(self, step: int, ranks: I64, lay: I64, arrival: I64, column: I64) -> None:
        shape, slot = self._reserve(step, ranks, lay, arrival)
        if column.size and int(column.max()) > _INT32_MAX:
            shape.widen()
        shape.mat[:, slot] = column

    def _reserve(self, step: int, ranks: I64, lay: I64, arrival: I64) -> tuple[_Shape, int]:
        """The shape of a step's sorted ``ranks`` and their layouts, and the column it holds the step in (written
        by the caller), replacing any earlier fold of the step."""
        self.drop(step)
        shape = next((s for s in self._shapes if s.same(ranks, lay)), None)
        if shape is None:
            shape = _Shape(ranks, lay, self.index)
            self._shapes.append(shape)
        in_arrival = lay[np.argsort(arrival, kind="stable")]
        uniq, first = np.unique(in_arrival, return_index=True)
        firsts = tuple(int(x) for x in uniq[np.argsort(first, kind="stable")])
        slot = shape.reserve(self.cap)
        self._pieces[step] = _Piece(shape, slot, arrival, firsts)
        return shape, slot

    def _dictionary(self, pieces: list[_Piece]) -> I64:
        """Per phase id of the index, its position in the held steps' phase dictionary (-1: absent)."""
        seen: set[int] = set()
        order: list[int] = []
        placed: set[int] = set()
        for piece in pieces:
            for j in piece.first_layouts:
                if j in seen:
                    continue
                seen.add(j)
                for g in self.index.layouts[j].first.tolist():
                    if g not in placed:
                        placed.add(g)
                        order.append(g)
        pid = np.full(len(self.index.keys), -1, dtype=np.int64)
        pid[np.array(order, dtype=np.int64)] = np.arange(len(order))
        return pid

    def compute_own(self, last: int | None = None, collective: bool = False) -> tuple[list[int], I64, I64, F64]:
        """The held steps (ascending; with ``last``, only the latest that many) and, per (rank, compute phase)
        seen in them, its rank, its phase id and its own time in each step (rows x steps, ns: the phase's time
        less its nested blocking collectives, summed over its occurrences; NaN where the rank did not run it
        that step). Forward, backward and optimizer phases only; with ``collective``, the collective phases
        instead (which nest nothing: their time). For :mod:`argus.detectors.onsets`."""
        steps = self.steps()
        if last is not None:
            steps = steps[-last:] if last > 0 else []
        n_ids = max(len(self.index.keys), 1)
        compute = np.array([k[1].is_collective if collective else k[1] in COMPUTE_KINDS for k in self.index.keys],
                           dtype=bool)
        keys, values, cols = [], [], []
        for j, s in enumerate(steps):
            piece = self._pieces[s]
            shape = piece.shape
            sel = compute[shape.cell_gid] if shape.cell_gid.size else np.zeros(0, dtype=bool)
            keys.append(shape.cell_rank[sel] * n_ids + shape.cell_gid[sel])
            values.append(piece.column[:shape.n_own][sel].astype(np.float64))
            cols.append(np.full(keys[-1].size, j, dtype=np.int64))
        every = np.concatenate(keys) if keys else np.empty(0, np.int64)
        cells, row = np.unique(every, return_inverse=True)
        out = np.full((cells.size, len(steps)), np.nan)
        if every.size:
            out[row, np.concatenate(cols)] = np.concatenate(values)
        return steps, cells // n_ids, cells % n_ids, out

    def detect(self, topology: JobTopology, params: L2Params, onset_step: int | None = None) -> list[L2Result]:
        """``detect_l2`` over the held steps (see the module docstring); [] when no step is held."""
        steps = self.steps()
        pieces = [self._pieces[s] for s in steps]
        if not pieces:
            return []
        pid = self._dictionary(pieces)
        keys = list(self.index.keys)
        used = np.flatnonzero(pid >= 0)[np.argsort(pid[pid >= 0])]
        dictionary = (tuple(keys[g][0] for g in used), tuple(keys[g][1] for g in used),
                      tuple(keys[g][2] for g in used))
        keep = [p for s, p in zip(steps, pieces, strict=True)
                if (onset_step is None or s >= onset_step) and p.shape.cell_rank.size]
        if len(keep) < params.min_steps:
            return []
        shapes = {id(p.shape): p.shape for p in keep}
        if len(shapes) == 1 and len(set(topology.rank)) == len(topology.rank):
            stats = self._dense(next(iter(shapes.values())), [p.slot for p in keep], pid, dictionary, topology)
        else:
            # Durations of every compute cell: those that nest from their own rows, the others' are their own.
            compute = np.array([k[1] in COMPUTE_KINDS for k in keys], dtype=bool)
            columns = [p.column for p in keep]
            plain = [compute[p.shape.cell_gid] & ~p.shape.cell_nests for p in keep]
            n_own = [p.shape.n_own for p in keep]
            raw = (np.concatenate([x for p, c in zip(keep, plain, strict=True)
                                   for x in (p.shape.cell_rank[c], p.shape.raw_rank)]),
                   np.concatenate([x for p, c in zip(keep, plain, strict=True)
                                   for x in (pid[p.shape.cell_gid[c]], pid[p.shape.raw_gid])]),
                   np.concatenate([x for col, c, n in zip(columns, plain, n_own, strict=True)
                                   for x in (col[:n][c], col[n:])]))
            stats = phase_stats(
                np.concatenate([p.shape.cell_rank for p in keep]),
                np.concatenate([pid[p.shape.cell_gid] for p in keep]),
                np.concatenate([col[:n] for col, n in zip(columns, n_own, strict=True)]),
                np.concatenate([p.shape.cell_count for p in keep]), len(keep), dictionary, topology, raw=raw)
        return judge_l2(stats, topology, params)

    @staticmethod
    def _dense(shape: _Shape, slots: list[int], pid: I64, dictionary: tuple[tuple, tuple, tuple],
               topology: JobTopology) -> PhaseStats:
        """:class:`PhaseStats` of steps sharing one shape: every cell has a value in every step, so the medians
        are the middle of each row of the sorted ``cells x steps`` matrix (the values ``cell_median`` takes)."""
        n = len(slots)
        cols = None if sorted(slots) == list(range(shape.mat.shape[1])) else slots
        med = row_medians(shape.mat[:shape.n_own], cols)
        world, n_phases = len(topology.rank), len(dictionary[0])
        cell = shape.cells(topology, pid, n_phases)
        size = world * n_phases
        n_steps = np.zeros(size, dtype=np.int64)
        n_steps[cell] = n
        per_step = np.full(size, np.nan)
        per_step[cell] = med
        shape2 = (world, n_phases)

        @functools.cache
        def raw_rows() -> I64:
            """Per cell, its row among the durations (``shape.mat`` from ``n_own``), -1 where nothing nests."""
            out = np.full(size, -1, dtype=np.int64)
            out[rank_positions(topology, shape.raw_rank) * n_phases + pid[shape.raw_gid]] = np.arange(
                shape.raw_gid.size)
            return out

        def raw(k: int, positions: I64) -> F64:
            cells = positions * n_phases + k
            out: F64 = per_step[cells]
            rows = raw_rows()[cells]
            nests = rows >= 0
            out[nests] = row_medians(shape.mat[shape.n_own + rows[nests]], cols)
            return out

        sums = np.zeros(size)
        sums[cell] = shape.cell_count.astype(np.float64) * n
        with np.errstate(invalid="ignore", divide="ignore"):
            occ = sums / n_steps
        return PhaseStats(*dictionary, n_steps.reshape(shape2), per_step.reshape(shape2), occ.reshape(shape2), n,
                          raw if shape.raw_gid.size else None)


def _sizes(index: LayoutIndex, lay: I64) -> tuple[I64, I64]:
    """Per entry of ``lay`` (layout indices), its layout's ids and the ids that nest (see :class:`_Shape`)."""
    sizes = np.array([x.ids.size for x in index.layouts], dtype=np.int64)[lay]
    nsizes = np.array([x.nests.size for x in index.layouts], dtype=np.int64)[lay]
    return sizes, nsizes
