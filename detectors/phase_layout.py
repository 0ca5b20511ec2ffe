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

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import attrgetter

import numpy as np
import numpy.typing as npt

from argus.core.errors import DetectorError
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
        return cls(b.kinds, b.groups, uniq, inv, counts, np.argsort(inv, kind="stable"),
                   np.cumsum(counts) - counts, outer if block.size else block, block, first)

    def columns(self, batches: Sequence[PhaseBatch], field: str) -> I64:
        """One int64 column array of ``batches`` (all of this layout): ``batches x phases``."""
        width = self.inverse.size
        cols = list(map(attrgetter(field), batches))
        if cols and not min(map(len, cols)) == width == max(map(len, cols)):
            raise DetectorError(f"phase batches of one layout differ in the length of {field}")
        # One np.fromiter over every row's ints is the fastest way from tuples of Python ints to int64 (numpy 2:
        # ~20 ns an int, faster than packing rows with struct); a value outside int64 raises.
        try:
            flat = np.fromiter(itertools.chain.from_iterable(cols), dtype=np.int64, count=len(cols) * width)
        except (OverflowError, ValueError, TypeError) as exc:
            raise DetectorError(f"phase batch {field}: {exc}") from exc
        out: I64 = flat.reshape(len(cols), width)
        return out

    def sums(self, values: I64) -> I64:
        """Per row of ``values`` (``batches x phases``, ns), the sum per phase id: ``batches x ids``."""
        if values.size and max(int(values.max()), -int(values.min())) * values.shape[1] >= _EXACT_NS:
            # Sums beyond float64's integers: the per-batch float sums, as ever.
            return np.stack([_float_sums(row.astype(np.float64), self) for row in values])
        out: I64 = np.add.reduceat(values[:, self.order], self.bounds, axis=1)
        return out

    def nested_sums(self, start: I64, duration: I64) -> I64:
        """Per batch and phase id, the overlap (ns) of its compute phases with the batch's blocking
        collectives, each capped at the phase's duration, summed (0 for other ids): ``batches x ids``."""
        rows = duration.shape[0]
        if self.block.size == 0 or self.outer.size == 0 or rows == 0:
            return np.zeros((rows, self.ids.size), dtype=np.int64)
        # Phase-major (``phases x batches``, contiguous): a column is a row, gathered by one copy.
        start_t, dur_t = np.ascontiguousarray(start.T), np.ascontiguousarray(duration.T)
        start_t -= start_t.min(axis=0)
        s_o, d_o = start_t[self.outer], dur_t[self.outer]
        e_o = s_o + np.maximum(d_o, 0)
        # A collective of negative length overlaps nothing (as the pairwise minimum/maximum has it).
        s_c = start_t[self.block]
        e_c = s_c + np.maximum(dur_t[self.block], 0)
        span = max(int(e_o.max()), int(e_c.max())) + 1
        if span * (rows + 1) >= _EXACT_NS or max(int(dur_t.max()), -int(dur_t.min())) * dur_t.shape[0] >= _EXACT_NS:
            # Times beyond float64's integers: the per-batch float evaluation, as ever.
            return np.stack([_float_sums(nested_one(start[i], duration[i].astype(np.float64), self), self)
                             for i in range(rows)])
        nested = np.minimum(_overlaps(s_o, e_o, s_c, e_c, span), d_o)
        # Per id, the sum of its compute columns' rows (integer sums; no BLAS, whose threads contend).
        pos = self.inverse[self.outer]
        order = np.argsort(pos, kind="stable")
        ids, first = np.unique(pos[order], return_index=True)
        out_t = np.zeros((self.ids.size, rows), dtype=np.int64)
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

        Python work per batch is the layout look-up and the conversion of its two integer columns."""
        which_list: list[int] = []
        members: dict[int, list[int]] = {}
        prev: PhaseBatch | None = None
        at = -1
        for i, b in enumerate(batches):
            # Consecutive batches of one layout are common (one rank's stage after another): compare to the last.
            if prev is None or not (b.names is prev.names or b.names == prev.names) or b.kinds != prev.kinds \
                    or b.groups != prev.groups:
                at = self.layout_of(b)
            which_list.append(at)
            members.setdefault(at, []).append(i)
            prev = b
        out = []
        for j, idx in members.items():
            lay = self.layouts[j]
            mine = [batches[i] for i in idx]
            dur = lay.columns(mine, "duration_ns")
            start = lay.columns(mine, "start_ns") if lay.block.size else dur
            out.append(FoldedLayout(j, np.array(idx, dtype=np.int64), lay.sums(dur), lay.nested_sums(start, dur)))
        return np.array(which_list, dtype=np.int64), out


def _float_sums(values: F64, lay: PhaseLayout) -> I64:
    out: I64 = np.rint(np.bincount(lay.inverse, weights=values, minlength=lay.ids.size)).astype(np.int64)
    return out


def _overlaps(s_o: I64, e_o: I64, s_c: I64, e_c: I64, span: int) -> I64:
    """Per column (a batch), each interval ``[s_o, e_o)``'s summed overlap with the intervals ``[s_c, e_c)``
    (ns, exact); phase-major arrays (``phases x batches``).

    Batches of one layout run their phases at nearly the same offsets from their step's start, so most
    pairs of a phase and a collective overlap in no batch: only the pairs whose ranges over all batches meet
    are evaluated. Where too many meet (very different timelines), by coverage (:class:`_Coverage`)."""
    lo_so, hi_so, lo_eo, hi_eo = s_o.min(axis=1), s_o.max(axis=1), e_o.min(axis=1), e_o.max(axis=1)
    lo_sc, hi_ec = s_c.min(axis=1), e_c.max(axis=1)
    meets = np.maximum(lo_so[:, None], lo_sc[None, :]) < np.minimum(hi_eo[:, None], hi_ec[None, :])
    # A collective inside the phase in every batch (a forward around its layers' all-reduces) overlaps it by
    # its length: those pairs are summed by one product (integers below 2**52, exact), the others pairwise.
    inside = (hi_so[:, None] <= lo_sc[None, :]) & (hi_ec[None, :] <= lo_eo[:, None])
    po, pc = np.nonzero(meets & ~inside)  # pairs grouped by phase (row-major)
    if po.size > _MAX_PAIRS_PER_PHASE * s_o.shape[0]:
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
