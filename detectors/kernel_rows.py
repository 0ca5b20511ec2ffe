"""The rows of one (job, kernel, stream)'s :class:`~schemas.records.KernelSummary` records, merged per rank
for L3 (:mod:`detectors.l3_kernels`).

A window of a 10,240-rank job arrives as one record per rank: every column is read once, straight from
the records' tuples into one flat array (``operator.attrgetter`` over the records, one ``np.fromiter``
per column), and the checks run on those arrays rather than record by record.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from operator import attrgetter
from typing import Any

import numpy as np
import numpy.typing as npt

from argus.errors import DetectorError
from detectors.mixture import MixtureBatch
from schemas.records import KernelSummary

__all__ = ["merge_rows", "one_key", "window_end"]

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]


def one_key(summaries: Sequence[KernelSummary]) -> bool:
    """Whether all ``summaries`` are of one (job, kernel, stream)."""
    return len(set(map(attrgetter("job_id", "kernel", "stream"), summaries))) <= 1


def window_end(summaries: Sequence[KernelSummary]) -> int:
    """The latest window end (ns) of ``summaries``; a record without rows counts as 0."""
    ends = list(map(attrgetter("window_end_ns"), summaries))
    flat = _flat(ends, np.int64)
    latest = int(flat.max()) if flat.size else 0
    return max(latest, 0) if min(map(len, ends), default=0) == 0 else latest


def merge_rows(summaries: Sequence[KernelSummary], min_events: int) -> tuple[I64, MixtureBatch | None, F64]:
    """The ranks with at least ``min_events`` events, their merged mixtures (None if there are none) and
    their total time in the kernel (ns). Raises :class:`DetectorError` for a record whose cluster columns
    do not match its ``n_clusters``."""
    cols = {f: list(map(attrgetter(f), summaries)) for f in ("rank", "n_clusters", "cluster_count", "cluster_p50_ns",
                                                                "cluster_p99_ns", "cluster_sum_ns")}
    n_rows, n_counts, n_clusters = (np.fromiter(map(len, cols[f]), dtype=np.int64, count=len(summaries))
                                    for f in ("rank", "n_clusters", "cluster_count"))
    per_row = _flat(cols["n_clusters"], np.int64)
    # Each record's sum of n_clusters, from one running sum over all records.
    running = np.concatenate([[0], np.cumsum(per_row)])
    stop = np.cumsum(n_counts)
    bad = (n_counts != n_rows) | (running[stop] - running[stop - n_counts] != n_clusters)
    if bad.any():
        s = summaries[int(np.argmax(bad))]
        raise DetectorError(f"kernel summary {s.job_id}/{s.kernel}: cluster columns do not match n_clusters")
    owner = np.repeat(_flat(cols["rank"], np.int64), per_row)
    c, m, q, t = (_flat(cols[f], np.float64) for f in ("cluster_count", "cluster_p50_ns", "cluster_p99_ns",
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


def _flat(columns: list[Any], dtype: type[np.generic]) -> npt.NDArray[Any]:
    """The concatenation of ``columns`` (tuples of numbers) as one array of ``dtype``."""
    return np.fromiter(itertools.chain.from_iterable(columns), dtype=dtype, count=sum(map(len, columns)))
