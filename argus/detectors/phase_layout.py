"""Phase layouts of :class:`~argus.schemas.records.PhaseBatch` records, and their per-phase sums for many batches
at once (what :meth:`argus.detectors.l2_phases.PhaseTable.from_batches` builds its rows from).

The batches of one rank and step share their layout (the names, kinds and groups of its phases) with many
others: every rank of one (TP index, pipeline stage) runs the same phases. :class:`PhaseLayout` holds what a
layout maps to (phase ids, which columns sum into which id, which phases nest blocking collectives), and its
``sums`` / ``nested`` take the columns of all batches of the layout as one ``batches x phases`` array.

Everything is integer nanoseconds (int64), exact: the per-id sums and the overlaps of compute phases with
blocking collectives are the same integers as a per-batch float evaluation (exact below 2**53 ns), which
batches whose times or sums reach 2**52 ns keep (:func:`nested_one`).
"""

from __future__ import annotations

import functools
import itertools
import struct
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from operator import attrgetter, itemgetter
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from argus.core.errors import DetectorError
from argus.detectors.phase_fold import fold_rows, overlaps, pair_lists, pairs_covered
from argus.schemas.records import ParallelGroup, PhaseBatch, PhaseKind

__all__ = ["BLOCKING_GROUPS", "COMPUTE_KINDS", "LayoutIndex", "PhaseLayout", "nested_one"]

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
COMPUTE_KINDS = frozenset({PhaseKind.FORWARD, PhaseKind.BACKWARD, PhaseKind.OPTIMIZER})
#: Group kinds whose collectives block the compute stream where they sit inside a compute phase (Megatron's
#: TP all-reduce between GEMMs, the MoE all-to-all, pipeline send/receive); DP gradient buckets overlap the
#: backward instead. Their time inside a phase is waiting or transfer, not the phase's own work.
BLOCKING_GROUPS = frozenset({ParallelGroup.TP, ParallelGroup.EP, ParallelGroup.PP})
#: Relative times (ns) below this are exact in float64 (2**52): the batched integer overlap applies.
_EXACT_NS = 1 << 52
#: Above this many (phase, collective) pairs per compute phase whose ranges meet, overlaps go by coverage.
_MAX_PAIRS_PER_PHASE = 6
_NONE = np.empty(0, dtype=np.int64)
_PACKED_TIMES = attrgetter("packed_times")
#: Batches folded at once from packed times (~600 KiB of times at ~150 phases).
_FOLD_BLOCK = 256
_NAMES, _KINDS, _GROUPS, _SECOND = attrgetter("names"), attrgetter("kinds"), attrgetter("groups"), itemgetter(1)
_SHARED_LAYOUT = attrgetter("shared_layout")
T = TypeVar("T")


@dataclass(frozen=True, eq=False)
class PhaseLayout:
    """What one (names, kinds, groups) layout of a PhaseBatch maps to: phase ids (sorted), for each column
    the position of its id (``inverse``), occurrences per id (``counts``), the columns in id order (``order``)
    with each id's first position there (``bounds``), and the columns of its compute phases (``outer``) and
    blocking collectives (``block``); both empty when nothing nests. ``first``: its ids in the order they
    first appear among its columns (what a phase dictionary built batch by batch assigns them in)."""

    kinds: tuple[PhaseKind, ...]
    groups: tuple[ParallelGroup, ...]
    ids: I64
    inverse: I64
    counts: I64
    order: I64
    bounds: I64
    outer: I64
    block: I64
    first: I64 = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    #: Positions (in ``ids``) of the ids whose duration may hold nested blocking time (its compute phases,
    #: where it has blocking collectives), ascending.
    nests: I64 = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    #: The (compute, collective) pairs :meth:`fold_rows` evaluates, with their lists (kept for the next call).
    _pairs: list[tuple[npt.NDArray[np.bool_], I64, I64]] = field(default_factory=list, init=False, repr=False)

    @classmethod
    def of(cls, b: PhaseBatch, keys: dict[tuple[str, PhaseKind, ParallelGroup], int]) -> PhaseLayout:
        """``b``'s layout; new (name, kind, group) entries are added to ``keys``."""
        if not len(b.names) == len(b.kinds) == len(b.groups) == len(b.duration_ns) == len(b.start_ns):
            raise DetectorError(f"phase batch {b.job_id}/{b.rank}/{b.step}: columns differ in length")
        triples = zip(b.names, b.kinds, b.groups, strict=True)
        ids = np.array([keys.setdefault(k, len(keys)) for k in triples], dtype=np.int64)
        uniq, inv = np.unique(ids, return_inverse=True)
        counts = np.bincount(inv).astype(np.int64)
        outer = np.flatnonzero([k in COMPUTE_KINDS for k in b.kinds])
        block = np.flatnonzero([k.is_collective and g in BLOCKING_GROUPS for k, g in zip(b.kinds, b.groups,
                                                                                  strict=True)])
        first = ids[np.sort(np.unique(ids, return_index=True)[1])]
        outer = outer if block.size else block
        return cls(b.kinds, b.groups, uniq, inv, counts, np.argsort(inv, kind="stable"),
                   np.cumsum(counts) - counts, outer, block, first, np.unique(inv[outer]).astype(np.int64))

    def columns(self, batches: Sequence[PhaseBatch], field: str) -> I64:
        """One int64 column array of ``batches`` (all of this layout): ``batches x phases``. A column that is
        one tuple object in several batches (one producer's starts shared by its ranks) is converted once."""
        width = self.inverse.size
        cols = list(map(attrgetter(field), batches))
        ids = list(map(id, cols))
        distinct = dict(zip(ids, cols, strict=True))  # the batches hold every column: no id is reused meanwhile
        rows = list(distinct.values()) if len(distinct) < len(cols) else cols
        if rows and not min(map(len, rows)) == width == max(map(len, rows)):
            raise DetectorError(f"phase batches of one layout differ in the length of {field}")
        flat = _int64s(rows, width, field)
        out: I64 = flat.reshape(len(rows), width)
        if rows is cols:
            return out
        slot = dict(zip(distinct, range(len(distinct)), strict=True))
        shared: I64 = out[np.fromiter(map(slot.__getitem__, ids), dtype=np.int64, count=len(cols))]
        shared.flags.writeable = False  # as the unshared columns (a view of bytes): one type for the kernels
        return shared

    def unpack(self, packed: Sequence[bytes]) -> I64:
        """Decoded batches' :attr:`PhaseBatch.packed_times` (all of this layout) as one read-only
        ``batches x 2·phases`` array (one buffer): per row the batch's ``start_ns``, then its ``duration_ns``
        (what :meth:`fold_packed` takes). Bytes joined, no int converted (a numpy array per batch costs ~0.6 us
        to concatenate, a join ~0.1 us). Raises :class:`DetectorError` where their lengths differ from the
        layout's."""
        width = self.inverse.size
        # Decoding checked that each batch's times are as long as its kinds (those of this layout).
        both = np.frombuffer(b"".join(packed), dtype="<i8")
        if both.size != 2 * width * len(packed):
            raise DetectorError("phase batches of one layout differ in the length of their columns")
        out: I64 = both.reshape(len(packed), 2 * width)
        return out

    def fold_rows(self, start: I64, duration: I64) -> tuple[I64, I64]:
        """Per row of ``duration`` (``batches x phases``, ns, all of this layout) the sum per phase id, and the
        overlap of its compute phases with the batch's blocking collectives, each capped at the phase's
        duration, summed per id (0 for other ids): two ``batches x ids`` arrays. ``start``: the batches'
        starts (read only when the layout has blocking collectives)."""
        return self._fold_rows(start, 0, duration, 0)

    def fold_packed(self, times: I64) -> tuple[I64, I64]:
        """:meth:`fold_rows` of :meth:`unpack`'s ``times`` (per row the starts, then the durations)."""
        return self._fold_rows(times, 0, times, self.inverse.size)

    def _fold_rows(self, s_buf: I64, s_at: int, d_buf: I64, d_at: int) -> tuple[I64, I64]:
        """fold_rows of the columns of ``s_buf`` from ``s_at`` on and of ``d_buf`` from ``d_at`` on."""
        width = self.inverse.size
        rows = d_buf.shape[0]
        if rows == 0 or width == 0:
            return np.zeros((rows, self.ids.size), dtype=np.int64), np.zeros((rows, self.ids.size), dtype=np.int64)
        cached = self._pairs[0] if self._pairs else None
        ptr, pair_block = (cached[1], cached[2]) if cached is not None else (np.zeros(self.outer.size + 1,
                                                                                      dtype=np.int64), _NONE)
        sums, nested, lo_so, hi_so, lo_eo, hi_eo, lo_sc, hi_ec, end, d_lo, d_hi = fold_rows(
            s_buf, d_buf, self.inverse, self.ids.size, self.outer, self.block, ptr, pair_block,
            start_at=s_at, dur_at=d_at)
        start, duration = s_buf[:, s_at:s_at + width], d_buf[:, d_at:d_at + width]
        beyond = max(d_hi, -d_lo) * width >= _EXACT_NS
        if beyond:
            # Sums beyond float64's integers: the per-batch float sums, as ever.
            sums = np.stack([_float_sums(row.astype(np.float64), self) for row in duration])
        if self.block.size == 0 or self.outer.size == 0:
            return sums, np.zeros((rows, self.ids.size), dtype=np.int64)
        span = end + 1
        if beyond or span * (rows + 1) >= _EXACT_NS:
            # Times beyond float64's integers: the per-batch float evaluation, as ever.
            return sums, np.stack([_float_sums(nested_one(start[i], duration[i].astype(np.float64), self), self)
                                   for i in range(rows)])
        most = _MAX_PAIRS_PER_PHASE * self.outer.size
        if cached is not None and pairs_covered((lo_so, hi_so, lo_eo, hi_eo, lo_sc, hi_ec), cached[0], most):
            return sums, nested  # the usual case: a steady layout's batches meet where its earlier ones did
        meets = np.maximum(lo_so[:, None], lo_sc[None, :]) < np.minimum(hi_eo[:, None], hi_ec[None, :])
        inside = (hi_so[:, None] <= lo_sc[None, :]) & (hi_ec[None, :] <= lo_eo[:, None])
        if np.count_nonzero(meets & ~inside) > most:
            return sums, self._nested_by_coverage(start, duration, span)
        if cached is None or (meets & ~cached[0]).any():
            # The pairs evaluated missed some that meet: again with them. Any pair that meets in no batch adds
            # 0, so the pairs kept for the layout's next batches are those of both (while few).
            pairs = meets if cached is None else meets | cached[0]
            if np.count_nonzero(pairs & ~inside) > most:
                pairs = meets
            self._pairs[:] = [(pairs, *pair_lists(pairs))]
            nested = fold_rows(s_buf, d_buf, self.inverse, self.ids.size, self.outer, self.block,
                               *self._pairs[0][1:], start_at=s_at, dur_at=d_at)[1]
        return sums, nested

    def _nested_by_coverage(self, start: I64, duration: I64, span: int) -> I64:
        """:meth:`fold_rows`'s nested times where many pairs meet (very different timelines): phase-major
        (``phases x batches``), by coverage."""
        # A copy (the columns are read-only; one row's transpose would be a view of them).
        start_t, dur_t = np.array(start.T, order="C"), np.ascontiguousarray(duration.T)
        start_t -= start_t.min(axis=0)
        s_o, d_o = start_t[self.outer], dur_t[self.outer]
        s_c = start_t[self.block]
        nested = np.minimum(overlaps(s_o, s_o + np.maximum(d_o, 0), s_c, s_c + np.maximum(dur_t[self.block], 0),
                                     span, _MAX_PAIRS_PER_PHASE), d_o)
        # Per id, the sum of its compute columns' rows (integer sums; no BLAS, whose threads contend).
        pos = self.inverse[self.outer]
        order = np.argsort(pos, kind="stable")
        ids, first = np.unique(pos[order], return_index=True)
        out_t = np.zeros((self.ids.size, duration.shape[0]), dtype=np.int64)
        out_t[ids] = np.add.reduceat(nested[order], first, axis=0)
        out: I64 = out_t.T
        return out


@dataclass(frozen=True, eq=False)
class FoldedLayout:
    """The batches of one layout among those :meth:`LayoutIndex.fold` took: their positions there
    (``members``), and per member and phase id (the layout's ``ids``) the summed duration (``duration``) and
    the blocking collectives nested in it (``nested``), ns: ``members x ids``."""

    layout: int
    members: I64
    duration: I64
    nested: I64


class LayoutIndex:
    """The phase dictionary (one id per distinct (name, kind, group), in the order first seen) and the
    layouts of every batch folded so far; one index serves one table, or one job's steps one at a time."""

    def __init__(self) -> None:
        self.keys: dict[tuple[str, PhaseKind, ParallelGroup], int] = {}
        self.layouts: list[PhaseLayout] = []
        self._by_names: dict[tuple[str, ...], list[int]] = {}  # by names: tuples of enums hash slowly

    def layout_of(self, b: PhaseBatch) -> int:
        """The index of ``b``'s layout in :attr:`layouts` (added if new, with any new dictionary entries)."""
        same = self._by_names.setdefault(b.names, [])
        for at in same:
            lay = self.layouts[at]
            if lay.kinds == b.kinds and lay.groups == b.groups:
                return at
        self.layouts.append(PhaseLayout.of(b, self.keys))
        same.append(len(self.layouts) - 1)
        return len(self.layouts) - 1

    def fold(self, batches: Sequence[PhaseBatch]) -> tuple[I64, list[FoldedLayout]]:
        """Each batch's layout index, and per layout present (in the order first seen) its batches' per-id sums.

        Python work per batch: the conversion of its two integer columns, none for decoded batches (their times
        are kept packed)."""
        # Batches of one layout often hold the very same tuples (decoded ones of a layout seen lately share one
        # PhaseBatch.shared_layout; one producer's records their columns): a layout is looked up once per such
        # object (C-level passes over the batches, no Python step per batch), else by content, the previous
        # key's layout first. The batches hold the tuples, so no id is reused during the call.
        keys: list[Hashable] = list(map(id, map(_SHARED_LAYOUT, batches)))
        firsts = dict(zip(reversed(keys), range(len(keys) - 1, -1, -1), strict=True))  # each key's first position
        if id(None) in firsts:  # some batch was not decoded so: by its three columns' identities
            keys = list(zip(map(id, map(_NAMES, batches)), map(id, map(_KINDS, batches)),
                            map(id, map(_GROUPS, batches)), strict=True))
            firsts = dict(zip(reversed(keys), range(len(keys) - 1, -1, -1), strict=True))
        known: dict[Hashable, int] = {}
        order: dict[int, None] = {}  # the layouts in the order first seen
        prev: PhaseBatch | None = None
        at = -1
        for key, i in sorted(firsts.items(), key=_SECOND):
            b = batches[i]
            if prev is None or not (b.names == prev.names and b.kinds == prev.kinds and b.groups == prev.groups):
                at = self.layout_of(b)
            known[key] = at
            order[at] = None
            prev = b
        which = np.fromiter(map(known.__getitem__, keys), dtype=np.int64, count=len(keys))
        times: list[bytes | None] = list(map(_PACKED_TIMES, batches))
        out = []
        for j in order:
            lay = self.layouts[j]
            idx = np.flatnonzero(which == j)
            packed = _every_packed(times if len(order) == 1 else _picked(times, idx))
            if packed is not None:
                # A block of batches at a time: a few fresh MiB per layout each step (a join and its views) would
                # cost more in page faults than the fold itself; a block's buffers are reused memory.
                parts = [lay.fold_packed(lay.unpack(packed[lo:lo + _FOLD_BLOCK]))
                         for lo in range(0, len(packed), _FOLD_BLOCK)]
                sums, nested = (np.concatenate(col) for col in zip(*parts, strict=True))
            else:
                mine = list(batches) if len(order) == 1 else _picked(batches, idx)
                dur = lay.columns(mine, "duration_ns")
                sums, nested = lay.fold_rows(lay.columns(mine, "start_ns") if lay.block.size else dur, dur)
            out.append(FoldedLayout(j, idx.astype(np.int64), sums, nested))
        return which, out


def _every_packed(times: list[bytes | None]) -> list[bytes] | None:
    """``times`` (:attr:`PhaseBatch.packed_times` of batches) where every batch has them, else ``None``."""
    # all(): one C-level truth test per batch (an empty bytes is false: the columns serve a layout of no
    # phase alike).
    return times if times and all(times) else None  # type: ignore[return-value]


def _picked(items: Sequence[T], idx: I64) -> list[T]:
    """``items`` at the positions ``idx`` (one C-level pass)."""
    at = idx.tolist()
    return [items[at[0]]] if len(at) == 1 else list(itemgetter(*at)(items))


@functools.lru_cache(maxsize=256)
def _packer(width: int) -> struct.Struct:
    return struct.Struct(f"{width}q")


def _int64s(rows: Sequence[Sequence[int]], width: int, field: str) -> I64:
    """The ints of ``rows`` (each ``width`` long) as one read-only int64 array; a value outside int64 raises.

    Packing each row with one ``struct`` call and joining the bytes is ~6 ns an int, ~3x faster than
    ``np.fromiter`` over the chained rows (numpy 2: ~16 ns an int), which takes what struct refuses (a
    float, a numeric string: truncated or parsed, as ever)."""
    try:
        packed = b"".join(itertools.starmap(_packer(width).pack, rows))
    except struct.error:
        pass
    else:
        return np.frombuffer(packed, dtype=np.int64)
    try:
        flat = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=len(rows) * width)
    except (OverflowError, ValueError, TypeError) as exc:
        raise DetectorError(f"phase batch {field}: {exc}") from exc
    flat.flags.writeable = False
    return flat


def _float_sums(values: F64, lay: PhaseLayout) -> I64:
    out: I64 = np.rint(np.bincount(lay.inverse, weights=values, minlength=lay.ids.size)).astype(np.int64)
    return out


def nested_one(start_ns: Sequence[int] | I64, dur: F64, lay: PhaseLayout) -> F64:
    """Per phase of one batch: its overlap with the batch's blocking collectives, capped at its duration
    (float ns, the pairwise evaluation)."""
    out = np.zeros(dur.size)
    if lay.block.size == 0:
        return out
    start = np.asarray(start_ns, dtype=np.int64)
    start = (start - start.min()).astype(np.float64)  # epoch nanoseconds exceed float64's integer precision
    s_o, e_o = start[lay.outer], start[lay.outer] + dur[lay.outer]
    s_c, e_c = start[lay.block], start[lay.block] + dur[lay.block]
    overlap = np.minimum(e_o[:, None], e_c[None, :]) - np.maximum(s_o[:, None], s_c[None, :])
    out[lay.outer] = np.minimum(np.clip(overlap, 0.0, None).sum(axis=1), dur[lay.outer])
    return out
