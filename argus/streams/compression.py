"""Online compression: closed kernel windows -> per-(kernel, stream) KDE-cluster summaries.

Pure function, no Kafka. Each (job, rank, window)'s events are grouped by (kernel, stream) and clustered by
KDE valleys on log-durations (:func:`argus.detectors.cluster_by_group`, one vectorized pass per window); the
summaries of all given windows are then regrouped by (job, kernel, stream), the key of the cross-rank
comparison, into one :class:`KernelSummary` each. :func:`summarize_isolated` does the same but sets aside
the windows whose summaries cannot be made or fail their checks (so one bad window never blocks the rest).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from argus.detectors.kde_clusters import ClusterSet, KdeParams, cluster_by_group
from argus.schemas.records import KernelBatch, KernelSummary
from argus.streams.windows import ClosedWindow

__all__ = ["load_compiled_core", "summarize_isolated", "summarize_windows"]

log = logging.getLogger(__name__)


@dataclass
class _Rows:
    rank: list[int] = field(default_factory=list)
    start: list[int] = field(default_factory=list)
    end: list[int] = field(default_factory=list)
    n_events: list[int] = field(default_factory=list)
    n_clusters: list[int] = field(default_factory=list)
    piece: list[int] = field(default_factory=list)
    clusters: list[ClusterSet] = field(default_factory=list)


def summarize_windows(windows: Sequence[ClosedWindow], params: KdeParams | None = None) -> list[KernelSummary]:
    """Summaries of ``windows``, one record per (job, kernel, stream), rows ordered by (rank, window, piece);
    each row carries its window's ``piece``.

    Every event of every window is counted in exactly one cluster, so
    ``sum(n_events) == sum(len(w) for w in windows)``.

    Raises:
        SchemaError: a summary fails :meth:`KernelSummary.check` (e.g. a sum of durations beyond int64).
    """
    groups: defaultdict[tuple[str, str, int], _Rows] = defaultdict(_Rows)
    for w in sorted(windows, key=lambda w: (w.job_id, w.rank, w.start_ns, w.piece)):
        if not len(w):
            continue
        gid = (w.kernel_id.astype(np.int64) << 32) | w.stream.astype(np.int64)
        for g, cs in cluster_by_group(gid, w.duration_ns, params):
            rows = groups[(w.job_id, w.names[g >> 32], g & 0xFFFFFFFF)]
            rows.rank.append(w.rank)
            rows.start.append(w.start_ns)
            rows.end.append(w.end_ns)
            rows.n_events.append(cs.total_count)
            rows.n_clusters.append(len(cs))
            rows.piece.append(w.piece)
            rows.clusters.append(cs)
    out = []
    for (job_id, kernel, stream), rows in sorted(groups.items()):
        def cat(col: str, rows: _Rows = rows) -> tuple[int, ...]:
            return tuple(np.concatenate([getattr(c, col) for c in rows.clusters]).tolist())

        summary = KernelSummary(
            job_id=job_id, kernel=kernel, stream=stream, rank=tuple(rows.rank),
            window_start_ns=tuple(rows.start), window_end_ns=tuple(rows.end), n_events=tuple(rows.n_events),
            n_clusters=tuple(rows.n_clusters), cluster_count=cat("count"), cluster_p50_ns=cat("p50_ns"),
            cluster_p99_ns=cat("p99_ns"), cluster_min_ns=cat("min_ns"), cluster_max_ns=cat("max_ns"),
            cluster_sum_ns=cat("sum_ns"), piece=tuple(rows.piece),
        )
        summary.check()
        out.append(summary)
    return out


def summarize_isolated(windows: Sequence[ClosedWindow], params: KdeParams | None = None
                       ) -> tuple[list[KernelSummary], list[tuple[ClosedWindow, Exception]]]:
    """Like :func:`summarize_windows`, but a window whose summaries raise (e.g. a cluster's sum of durations
    beyond int64, which fails :meth:`KernelSummary.check`) is returned with its exception instead of failing
    the others. The common case is one call; only on a failure is every window summarized alone."""
    try:
        return summarize_windows(windows, params), []
    except Exception as exc:  # isolated below, window by window, to name the culprit
        log.debug("summarizing %d windows together failed (%s); one by one", len(windows), exc)
    out: list[KernelSummary] = []
    failed: list[tuple[ClosedWindow, Exception]] = []
    for w in windows:
        try:
            out.extend(summarize_windows([w], params))
        except Exception as exc:  # any failure of one window is reported with that window
            failed.append((w, exc))
    return out, failed


def load_compiled_core() -> None:
    """Load the compiled kernels of decoding and clustering (numba: from its disk cache, or compiled) by
    decoding and summarizing a small batch, so that the worker's first messages do not wait for it (~0.5 s
    from the cache, seconds to compile)."""
    n = 64
    batch = KernelBatch(job_id="warm-up", rank=0, seq=0, names=("k",), name_idx=np.zeros(n, dtype=np.uint32),
                        stream=np.arange(n, dtype=np.uint32) % 2, start_ns=np.arange(n, dtype=np.int64) * 1000,
                        duration_ns=100 + (np.arange(n, dtype=np.int64) % 2) * 10_000,
                        step=np.zeros(n, dtype=np.int32))
    decoded = KernelBatch.decode(batch.encode())
    gid = decoded.stream.astype(np.int64)
    cluster_by_group(gid, decoded.duration_ns)
