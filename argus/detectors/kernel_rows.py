"""The rows of one (job, kernel, stream)'s :class:`~argus.schemas.records.KernelSummary` records, merged per rank
for L3 (:mod:`argus.detectors.l3_kernels`).

A window of a 10,240-rank job arrives as one record per rank: every column is read once, straight from
the records' tuples into one flat array (``operator.attrgetter`` over the records, one ``np.fromiter``
per column), and the checks run on those arrays rather than record by record. :class:`SummaryColumns`
keeps what it has read, so the functions here, handed one, share the reading (and the clusters put in
order) within one detector call.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import numpy as np
import numpy.typing as npt

from argus.core.errors import DetectorError
from argus.detectors.mixture import MixtureBatch
from argus.schemas.records import KernelSummary

__all__ = ["SummaryColumns", "calls_below", "lower_part_floors", "merge_rows", "one_key", "row_floors", "window_end"]

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
#: Most clusters per rank for which lower_part_floors counts them one position at a time (else one search).
_FEW_CLUSTERS = 6


class SummaryColumns:
    """The columns of one (job, kernel, stream)'s summary records, each read from the records on first use
    and kept: ``lists(f)`` the records' tuples of field ``f``, ``flat(f, dtype)`` their concatenation.

    A helper of one detector call over records that do not change meanwhile (it holds them, not copies)."""

    def __init__(self, summaries: Sequence[KernelSummary]) -> None:
        self.summaries = summaries
        self._lists: dict[str, list[Any]] = {}
        self._flat: dict[tuple[str, Any], npt.NDArray[Any]] = {}
        self._ordered: dict[bool, _OrderedClusters | None] = {}

    def __len__(self) -> int:
        return len(self.summaries)

    def lists(self, field: str) -> list[Any]:
        """Per record, its tuple of ``field``."""
        got = self._lists.get(field)
        if got is None:
            got = self._lists[field] = list(map(attrgetter(field), self.summaries))
        return got

    def flat(self, field: str, dtype: type[np.generic]) -> npt.NDArray[Any]:
        """The records' ``field`` tuples concatenated, as one array of ``dtype`` (read-only: shared)."""
        key = (field, dtype)
        got = self._flat.get(key)
        if got is None:
            got = self._flat[key] = _flat(self.lists(field), dtype)
            got.flags.writeable = False
        return got

    def ordered(self, by_rank: bool) -> _OrderedClusters | None:
        """The clusters with calls, ordered by their owner (the rank with ``by_rank``, else the row: a window
        or a piece of one), then by median; kept per owner kind. None: no such cluster, or columns that do
        not match ``n_clusters``."""
        if by_rank not in self._ordered:
            self._ordered[by_rank] = self._order(by_rank)
        return self._ordered[by_rank]

    def _order(self, by_rank: bool) -> _OrderedClusters | None:
        per_row = self.flat("n_clusters", np.int64)
        count, p50, low = (self.flat(f, np.float64) for f in ("cluster_count", "cluster_p50_ns", "cluster_min_ns"))
        row_rank = self.flat("rank", np.int64)
        if row_rank.size == 0 or not (low.size == p50.size == count.size == int(per_row.sum())):
            return None
        owner = np.repeat(row_rank if by_rank else np.arange(row_rank.size), per_row)
        keep = count > 0
        if not keep.any():
            return None
        owner, count, p50, low = owner[keep], count[keep], p50[keep], np.minimum(low[keep], p50[keep])
        step, rise = np.diff(owner), np.diff(p50)
        if not bool(np.all((step > 0) | ((step == 0) & (rise >= 0)))):  # records in rank order hold them so
            order = np.lexsort((p50, owner))
            owner, count, p50, low = owner[order], count[order], p50[order], low[order]
        cum = np.cumsum(count)
        start = np.r_[0, np.flatnonzero(np.diff(owner)) + 1]
        stop = np.r_[start[1:], owner.size]
        before = np.r_[0.0, cum[start[1:] - 1]]
        return _OrderedClusters(owner[start], start, stop, before, cum[stop - 1] - before, count, p50, low, cum)


@dataclass(frozen=True)
class _OrderedClusters:
    """Clusters ordered by owner, then median: per owner (ascending ``owner``) its slice ``start:stop`` and
    the running call count ``before`` it and ``total`` in it; per cluster its ``count``, median ``p50``,
    shortest call ``low`` (at most its median) and the running count ``cum`` through it."""

    owner: I64
    start: I64
    stop: I64
    before: F64
    total: F64
    count: F64
    p50: F64
    low: F64
    cum: F64


def _columns(summaries: SummaryColumns | Sequence[KernelSummary]) -> SummaryColumns:
    return summaries if isinstance(summaries, SummaryColumns) else SummaryColumns(summaries)


def one_key(summaries: Sequence[KernelSummary]) -> bool:
    """Whether all ``summaries`` are of one (job, kernel, stream)."""
    return len(set(map(attrgetter("job_id", "kernel", "stream"), summaries))) <= 1


def window_end(summaries: SummaryColumns | Sequence[KernelSummary]) -> int:
    """The latest window end (ns) of ``summaries``; a record without rows counts as 0."""
    cols = _columns(summaries)
    ends = cols.lists("window_end_ns")
    flat = cols.flat("window_end_ns", np.int64)
    latest = int(flat.max()) if flat.size else 0
    return max(latest, 0) if min(map(len, ends), default=0) == 0 else latest


def merge_rows(summaries: SummaryColumns | Sequence[KernelSummary],
               min_events: int) -> tuple[I64, MixtureBatch | None, F64]:
    """The ranks with at least ``min_events`` events, their merged mixtures (None if there are none) and
    their total time in the kernel (ns). Raises :class:`DetectorError` for a record whose cluster columns
    do not match its ``n_clusters``."""
    cols = _columns(summaries)
    n_rows, n_counts, n_clusters = (np.fromiter(map(len, cols.lists(f)), dtype=np.int64, count=len(cols))
                                    for f in ("rank", "n_clusters", "cluster_count"))
    per_row = cols.flat("n_clusters", np.int64)
    # Each record's sum of n_clusters, from one running sum over all records.
    running = np.concatenate([[0], np.cumsum(per_row)])
    stop = np.cumsum(n_counts)
    bad = (n_counts != n_rows) | (running[stop] - running[stop - n_counts] != n_clusters)
    if bad.any():
        s = cols.summaries[int(np.argmax(bad))]
        raise DetectorError(f"kernel summary {s.job_id}/{s.kernel}: cluster columns do not match n_clusters")
    owner = np.repeat(cols.flat("rank", np.int64), per_row)
    c, m, q, t = (cols.flat(f, np.float64) for f in ("cluster_count", "cluster_p50_ns", "cluster_p99_ns",
                                                     "cluster_sum_ns"))
    keep = c > 0
    owner, c, m, q, t = owner[keep], c[keep], np.maximum(m[keep], 1.0), q[keep], t[keep]
    ranks, idx = np.unique(owner, return_inverse=True)
    events = np.bincount(idx, weights=c, minlength=ranks.size)
    ok = events >= min_events
    if not ok.any():
        return np.empty(0, dtype=np.int64), None, np.empty(0)
    sel = ok[idx]
    remap = np.cumsum(ok) - 1
    batch = MixtureBatch.from_long(remap[idx[sel]], c[sel], m[sel], np.maximum(q[sel], m[sel]),
                                   n_owners=int(ok.sum()))
    total: F64 = np.bincount(idx, weights=t, minlength=ranks.size)[ok].astype(np.float64)
    return ranks[ok].astype(np.int64), batch, total


def row_floors(summaries: SummaryColumns | Sequence[KernelSummary], ranks: I64, share: float = 0.3,
               level: float = 0.75, within: bool = False) -> F64:
    """Per rank of ``ranks`` (ns): how fast the rank's fast calls of the kernel were. Per row (a window, or a
    piece of one), the shortest call of the cluster that holds the row's ``share`` quantile call (clusters
    in duration order, weighted by their calls), or with ``within`` the quantile itself, read in that
    cluster between its shortest call and its median (log-linearly, at the quantile's place among the
    cluster's calls; its median where the quantile lies above it); over the rank's rows, their ``level``
    quantile (the higher value where it falls between rows). A rank without rows gets NaN.

    The cluster of a low quantile rather than the row's very fastest call: that one may be a lone outlier,
    or come from before a change that holds in most of the row (from an onset on) -- calls whose shortest
    call moved with the change no longer share a cluster with the earlier ones. Where they still share one
    wide cluster (a transfer x1.9 from the eighth of 40 steps, with the waiting calls between), its shortest
    call is of the old regime and only ``within`` sees the new; but in a cluster mostly of waiting calls
    (one side of a pipeline transfer) the quantile is waiting too.
    """
    cols = _columns(summaries)
    out = np.full(ranks.size, np.nan)
    oc = cols.ordered(by_rank=False)
    if oc is None:
        return out
    start, before, total, count, p50, low, cum = oc.start, oc.before, oc.total, oc.count, oc.p50, oc.low, oc.cum
    # Per row: the first cluster whose running count reaches share x the row's calls.
    target = np.repeat(before + share * total, oc.stop - start)
    reached = np.flatnonzero(cum >= target - 1e-9)
    first = np.searchsorted(reached, start)
    pick = reached[np.minimum(first, reached.size - 1)]
    # Where the quantile lies among the picked cluster's calls: 0 at its shortest, 1 at its median and above.
    row_target = before + share * total
    place = np.clip(2.0 * (row_target - (cum[pick] - count[pick])) / np.maximum(count[pick], 1e-300), 0.0, 1.0)
    place *= within
    with np.errstate(divide="ignore", invalid="ignore"):
        fastest = np.where(low[pick] > 0, low[pick] * np.exp(place * np.log(p50[pick] / low[pick])), low[pick])
    row_rank = cols.flat("rank", np.int64)[oc.owner]
    order = np.lexsort((fastest, row_rank))
    row_rank, fastest = row_rank[order], fastest[order]
    uniq, first_row, n = np.unique(row_rank, return_index=True, return_counts=True)
    value = fastest[first_row + np.ceil(level * (n - 1)).astype(np.int64)]
    pos = np.searchsorted(uniq, ranks)
    hit = (pos < uniq.size) & (uniq[np.minimum(pos, uniq.size - 1)] == ranks)
    out[hit] = value[pos[hit]]
    return out


def calls_below(summaries: SummaryColumns | Sequence[KernelSummary], ranks: I64, limit_ns: F64) -> F64:
    """Per rank of ``ranks``, the share of its calls (over all its rows) in clusters whose median is at most
    its ``limit_ns`` (ns, one per rank); NaN for a rank without calls."""
    out = np.full(ranks.size, np.nan)
    oc = _columns(summaries).ordered(by_rank=True)
    if oc is None:
        return out
    at = np.searchsorted(oc.owner, ranks)
    has = (at < oc.owner.size) & (oc.owner[np.minimum(at, oc.owner.size - 1)] == ranks)
    owner_limit = np.full(oc.owner.size, -np.inf)
    owner_limit[at[has]] = np.asarray(limit_ns, dtype=np.float64)[has]
    per_cluster = np.repeat(owner_limit, oc.stop - oc.start)
    below = np.add.reduceat(np.where(oc.p50 <= per_cluster, oc.count, 0.0), oc.start)
    out[has] = below[at[has]] / oc.total[at[has]]
    return out


def lower_part_floors(summaries: SummaryColumns | Sequence[KernelSummary], ranks: I64, levels: npt.ArrayLike,
                      median_place: float = 0.4) -> F64:
    """Per rank of ``ranks`` (ascending) and level of ``levels`` (``R x J``, ns): where the level lies in
    the lower part of one of the rank's clusters (clusters in order of their medians, the level below
    ``median_place`` of the way up to the cluster's median call), that cluster's shortest call -- a floor
    under the rank's quantile there that holds whatever the cluster's shape. NaN where the level lies at or
    above its cluster's median (there the median and p99 a summary keeps are exact), or the rank has no rows.

    A log-normal rebuilt from a cluster's median and p99 is only right for a cluster of one shape. A rank
    whose calls of three shapes came out as one wide cluster (one noisy window clustered so, its peers' not)
    reads several times its peers' in the rebuilt lower part of that cluster, though its shortest call there
    is no slower than their calls: such a reading is no slow mode, and the floor says so.
    """
    u = np.asarray(levels, dtype=np.float64)
    out = np.full((ranks.size, u.size), np.nan)
    rc = _columns(summaries).ordered(by_rank=True)
    if rc is None:
        return out
    # Only the clusters of ``ranks`` are read (a pipeline stage's, of a window of the whole job).
    pos = np.minimum(np.searchsorted(rc.owner, ranks), rc.owner.size - 1)
    hit = np.flatnonzero(rc.owner[pos] == ranks)
    at_rank = pos[hit]
    start, stop = rc.start[at_rank], rc.stop[at_rank]
    target = rc.before[at_rank][:, None] + u[None, :] * rc.total[at_rank][:, None]  # in the running count
    longest = int((stop - start).max()) if start.size else 0
    if longest <= _FEW_CLUSTERS and not np.isnan(u).any():
        # The first of the rank's clusters whose running count reaches the target: counted among its few
        # clusters, one pass per position (the same index as the search over all clusters, clipped alike).
        at = start[:, None].repeat(u.size, axis=1)
        for k in range(longest):
            within = start + k < stop
            at += within[:, None] & (rc.cum[np.minimum(start + k, stop - 1)][:, None] < target)
        at = np.minimum(at, (stop - 1)[:, None])
    else:
        at = np.minimum(np.searchsorted(rc.cum, target, side="left"), (stop - 1)[:, None])
        at = np.maximum(at, start[:, None])
    place = (target - (rc.cum[at] - rc.count[at])) / rc.count[at]
    out[hit] = np.where(place >= median_place, np.nan, rc.low[at])
    return out


def _flat(columns: list[Any], dtype: type[np.generic]) -> npt.NDArray[Any]:
    """The concatenation of ``columns`` (tuples of numbers) as one array of ``dtype``."""
    return np.fromiter(itertools.chain.from_iterable(columns), dtype=dtype, count=sum(map(len, columns)))
