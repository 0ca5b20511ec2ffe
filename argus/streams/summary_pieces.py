"""Kernel summaries as the L3 agent takes them: job-end markers, rows of ranks outside a job, pieces of one
(rank, window) merged into one row, copies told from new pieces, and the bounded per-(kernel, stream) state.

Pure (no Kafka): used by :class:`argus.streams.summary_router.SummaryRouter`.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable

from argus.detectors.impact import StepClock
from argus.schemas.records import Finding, JobTopology, KernelSummary, ParallelGroup
from argus.streams.diagnosis import DiagnosisParams, KernelDiagnosis

__all__ = ["BoundedKernelDiagnosis", "PieceLedger", "foreign_ranks", "is_end_marker", "merge_pieces", "select_rows",
           "summary_end_marker"]


def summary_end_marker(job_id: str, source_partition: int) -> KernelSummary:
    """What a compressor partition sends to every summaries partition when it has finished a job."""
    return KernelSummary(job_id=job_id, kernel="", stream=source_partition, rank=(), window_start_ns=(),
                         window_end_ns=(), n_events=(), n_clusters=(), cluster_count=(), cluster_p50_ns=(),
                         cluster_p99_ns=(), cluster_min_ns=(), cluster_max_ns=(), cluster_sum_ns=())


def is_end_marker(s: KernelSummary) -> bool:
    """Whether ``s`` is a job-end marker (:func:`summary_end_marker`), not a summary."""
    return s.kernel == "" and not s.rank


def foreign_ranks(ranks: Iterable[int], topology: JobTopology | None, world_size: int | None) -> list[int]:
    """The ranks of ``ranks`` that are not in their job: absent from its topology when that is known, else
    not below its world size when that is known (sorted, each once)."""
    if topology is not None:
        members = topology.members()
        return sorted({r for r in ranks if r not in members})
    if world_size:
        return sorted({r for r in ranks if r >= world_size})
    return []


def select_rows(s: KernelSummary, rows: list[int]) -> KernelSummary:
    """The summary with only rows ``rows`` (indices, ascending, each once) and their clusters."""
    if len(rows) == len(s.rank):
        return s
    first = [0, *itertools.accumulate(s.n_clusters)]
    cl = [j for i in rows for j in range(first[i], first[i + 1])]

    def pick(col: tuple[int, ...], idx: list[int]) -> tuple[int, ...]:
        return tuple(col[i] for i in idx)

    return KernelSummary(
        job_id=s.job_id, kernel=s.kernel, stream=s.stream, rank=pick(s.rank, rows),
        window_start_ns=pick(s.window_start_ns, rows), window_end_ns=pick(s.window_end_ns, rows),
        n_events=pick(s.n_events, rows), n_clusters=pick(s.n_clusters, rows),
        cluster_count=pick(s.cluster_count, cl), cluster_p50_ns=pick(s.cluster_p50_ns, cl),
        cluster_p99_ns=pick(s.cluster_p99_ns, cl), cluster_min_ns=pick(s.cluster_min_ns, cl),
        cluster_max_ns=pick(s.cluster_max_ns, cl), cluster_sum_ns=pick(s.cluster_sum_ns, cl),
        piece=pick(s.piece, rows) if s.piece else (),
    )


def merge_pieces(pieces: Iterable[KernelSummary]) -> KernelSummary:
    """One row from one-row summaries of the same (rank, window): events summed, clusters concatenated and
    ordered by p50 (the row's mixture is the pieces' mixtures together)."""
    rows = list(pieces)
    if len(rows) == 1:
        return rows[0]
    first = rows[0]
    clusters = sorted(zip(*(tuple(itertools.chain.from_iterable(getattr(r, c) for r in rows)) for c in _CLUSTER_COLS),
                          strict=True), key=lambda c: (c[1], c[0], c[2]))
    cols = dict(zip(_CLUSTER_COLS, (tuple(col) for col in zip(*clusters, strict=True)), strict=True))
    return KernelSummary(
        job_id=first.job_id, kernel=first.kernel, stream=first.stream, rank=first.rank,
        window_start_ns=first.window_start_ns, window_end_ns=first.window_end_ns,
        n_events=(sum(r.n_events[0] for r in rows),), n_clusters=(len(clusters),), **cols)


_CLUSTER_COLS = ("cluster_count", "cluster_p50_ns", "cluster_p99_ns", "cluster_min_ns", "cluster_max_ns",
                 "cluster_sum_ns")


class PieceLedger:
    """The summary pieces taken so far, per (kernel, stream, rank, window, piece), with their event counts.

    :meth:`fresh` keeps the rows of a summary that add something: a piece not seen before, or a larger copy
    of one (a complete re-summary after a partial one); copies with no more events are dropped.
    """

    def __init__(self) -> None:
        self._events: dict[tuple[str, int, int, int, int], int] = {}

    def fresh(self, s: KernelSummary) -> tuple[KernelSummary | None, KernelSummary | None]:
        """(rows of ``s`` that are new or larger copies, rows of ``s`` that are new pieces); ``None`` when
        there are none."""
        grown, new = [], []
        for i, (rank, ws, piece) in enumerate(zip(s.rank, s.window_start_ns, s.pieces(), strict=True)):
            key = (s.kernel, s.stream, rank, ws, piece)
            had = self._events.get(key)
            if had is not None and had >= s.n_events[i]:
                continue
            self._events[key] = s.n_events[i]
            grown.append(i)
            if had is None:
                new.append(i)

        def pick(rows: list[int]) -> KernelSummary | None:
            if not rows:
                return None
            return s if len(rows) == len(s.rank) else select_rows(s, rows)

        return pick(grown), pick(new)


class BoundedKernelDiagnosis(KernelDiagnosis):
    """:class:`KernelDiagnosis` that drops the rows of its oldest judged windows beyond ``max_windows``.

    Each window is judged on its own rows, so dropping judged ones changes no later judgement, and what their
    judgement found is kept (:class:`~argus.streams.diagnosis.JudgedWindow`): the job's end judges them again
    from it, so the state of a (job, kernel, stream) holds at most ``max_windows`` windows of rows whatever
    the job's length. Rows that arrive afterwards for a dropped window are ignored (counted in
    :attr:`rows_ignored`), since judging them without the window's other ranks would compare a rank against
    nobody.
    """

    def __init__(self, job_id: str, kernel: str, stream: int, params: DiagnosisParams, max_windows: int) -> None:
        super().__init__(job_id, kernel, stream, params)
        self.max_windows = max_windows
        self.forgotten_through: int | None = None
        self.rows_ignored = 0
        self._pieces: dict[int, dict[int, dict[int, KernelSummary]]] = {}  # window -> rank -> piece -> row
        # Each window's merged row per rank; the rank-ordered row lists are rebuilt only for the windows
        # changed since the last judgement (a per-row re-sort costs O(ranks^2) per window at 10k ranks).
        self._by_rank: dict[int, dict[int, KernelSummary]] = {}
        self._dirty: set[int] = set()

    def add(self, summary: KernelSummary) -> None:
        """Take the rows of ``summary``; the pieces of one (rank, window) become one merged row (a copy of a
        piece replaces it when larger), and a window judged before a piece arrived is judged again. Rows of
        a window are kept ordered by rank, so the judgement does not depend on arrival order."""
        if self.forgotten_through is not None:
            limit = self.forgotten_through
            rows = [i for i, ws in enumerate(summary.window_start_ns) if ws > limit]
            self.rows_ignored += len(summary.rank) - len(rows)
            if not rows:
                return
            if len(rows) < len(summary.rank):
                summary = select_rows(summary, rows)
        for i, (rank, ws, piece) in enumerate(zip(summary.rank, summary.window_start_ns, summary.pieces(),
                                                  strict=True)):
            have = self._pieces.setdefault(ws, {}).setdefault(rank, {})
            old = have.get(piece)
            if old is not None and old.n_events[0] >= summary.n_events[i]:
                continue
            row = select_rows(summary, [i])
            have[piece] = dataclasses.replace(row, piece=()) if row.piece else row
            self._by_rank.setdefault(ws, {})[rank] = merge_pieces(have[p] for p in sorted(have))
            self._windows.setdefault(ws, [])
            self._dirty.add(ws)
            self._ranks[ws].add(rank)
            self._seen_ranks.add(rank)
            self._results.pop(ws, None)  # its rows changed
            if len(have) > 1 or old is not None:
                self._judged.pop(ws, None)  # judged without this piece: judge again

    def diagnose(self, topology: JobTopology | None, final: bool = False,
                 group_kind: ParallelGroup | None = None, clock: StepClock | None = None) -> list[Finding]:
        self._materialize()
        return super().diagnose(topology, final=final, group_kind=group_kind, clock=clock)

    def window_rows(self, window_start_ns: int) -> list[KernelSummary]:
        """The merged rows of one window, ordered by rank."""
        self._materialize()
        return list(self._windows.get(window_start_ns, []))

    def _materialize(self) -> None:
        for ws in self._dirty:
            rows = self._by_rank[ws]
            self._windows[ws] = [rows[r] for r in sorted(rows)]
        self._dirty.clear()

    def prune(self) -> None:
        """Drop the rows of the oldest windows beyond ``max_windows``, as far as they have been judged (their
        judgements stay)."""
        starts = sorted(self._windows)
        for ws in starts[: max(len(starts) - self.max_windows, 0)]:
            if ws not in self._judged or ws not in self._results:
                break
            del self._windows[ws]
            self._by_rank.pop(ws, None)
            self._dirty.discard(ws)
            self._ranks.pop(ws, None)
            self._pieces.pop(ws, None)
            self.forgotten_through = ws

    @property
    def windows(self) -> int:
        return len(self._windows)
