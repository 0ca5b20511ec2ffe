"""Exactly-once results from at-least-once delivery, the pure parts: window pieces that survive replays,
pieces merged (never one dropped for another) in L3 and in ClickHouse, copies counted once."""

from __future__ import annotations

import numpy as np

from argus.schemas.records import (
    JobLifecycle,
    KernelBatch,
    KernelSummary,
    LifecycleEvent,
    ParallelGroup,
    PhaseBatch,
    PhaseKind,
)
from argus.sinks.tables import PHASE_MARKER_IDX, TABLES
from argus.streams.compression import summarize_windows
from argus.streams.diagnosis import DiagnosisParams
from argus.streams.summary_pieces import BoundedKernelDiagnosis, PieceLedger, merge_pieces
from argus.streams.windows import ClosedWindow, WindowBuffer

W = 1_000_000_000
T0 = 1_767_225_600 * W
_SEQ = iter(range(10**6))


def _next_seq() -> int:
    return next(_SEQ)


def _batch(start_ns: list[int], rank: int = 0, eos: bool = False, seq: int | None = None) -> KernelBatch:
    s = np.array(start_ns, dtype=np.int64)
    n = s.size
    seq = _next_seq() if seq is None else seq
    return KernelBatch("j", rank, seq, ("k",), np.zeros(n, dtype=np.uint32), np.full(n, 7, dtype=np.uint32), s,
                       1000 + s % 97, np.zeros(n, dtype=np.int32), end_of_stream=eos)


def test_a_re_sent_batch_is_a_copy_not_a_piece() -> None:
    buf = WindowBuffer(W, 0, late_pieces=True)
    buf.add(_batch([T0 + 1], seq=0), token=1, position=1)
    buf.add(_batch([T0 + W + 1], seq=1), token=2, position=2)
    up = buf.add(_batch([T0 + 1], seq=0), token=3, position=3)
    assert up.duplicate and up.closed == [] and up.free_tokens == [3]
    assert not buf.add(_batch([T0 + 2 * W], seq=3), token=4, position=4).duplicate  # a gap is fine
    assert not buf.add(_batch([T0 + 2 * W], seq=2), token=5, position=5).duplicate


def _run(buf: WindowBuffer, batches: list[tuple[int, KernelBatch]]) -> list[ClosedWindow]:
    out: list[ClosedWindow] = []
    for offset, b in batches:
        out += buf.add(b, token=offset, position=offset).closed
    return out


STREAM = [(10, _batch([T0 + 1, T0 + 2])), (11, _batch([T0 + 3, T0 + W + 1])), (12, _batch([T0 + 2 * W + 5]))]


def test_a_replay_from_inside_a_window_re_emits_the_same_piece_with_fewer_events() -> None:
    first = _run(WindowBuffer(W, 0, late_pieces=True), STREAM)
    replay = _run(WindowBuffer(W, 0, late_pieces=True), STREAM[1:])  # committed offset was inside window T0
    one = {(w.start_ns, w.piece): len(w) for w in first}
    two = {(w.start_ns, w.piece): len(w) for w in replay}
    assert one == {(T0, 11): 3, (T0 + W, 11): 1}
    assert two == {(T0, 11): 1, (T0 + W, 11): 1}  # same identities: the stored, larger copy wins


def test_events_after_the_window_closed_or_the_rank_ended_are_a_further_piece() -> None:
    buf = WindowBuffer(W, 0, late_pieces=True)
    _run(buf, STREAM)
    late = buf.add(_batch([T0 + 9]), token=13, position=13)
    assert late.late is None and [(w.start_ns, w.piece, w.late, len(w)) for w in late.closed] == [(T0, 13, True, 1)]
    assert late.free_tokens == [13]
    buf.add(_batch([], eos=True), token=14, position=14)
    after_end = buf.add(_batch([T0 + 2 * W + 7, T0 + 4]), token=15, position=15)
    assert sorted((w.start_ns, w.piece) for w in after_end.closed) == [(T0, 15), (T0 + 2 * W, 15)]
    assert buf.open_windows == 0  # nothing left open that would never close


def test_without_late_pieces_late_events_are_returned_as_before() -> None:
    buf = WindowBuffer(W, 0)
    _run(buf, STREAM)
    up = buf.add(_batch([T0 + 9]), token=13)
    assert up.late is not None and up.closed == []


def _pieces() -> list[KernelSummary]:
    buf = WindowBuffer(W, 0, late_pieces=True)
    windows = _run(buf, STREAM) + buf.add(_batch([T0 + 9, T0 + 50]), token=13, position=13).closed
    return summarize_windows(windows)


def test_summaries_carry_pieces_and_ledger_keeps_new_or_larger_copies() -> None:
    (s,) = _pieces()
    assert s.pieces() == (11, 13, 11) and s.window_start_ns[:2] == (T0, T0)
    ledger = PieceLedger()
    grown, new = ledger.fresh(s)
    assert grown == s and new == s
    assert ledger.fresh(s) == (None, None)  # a re-delivered copy adds nothing


def test_l3_merges_the_pieces_of_a_window_and_judges_it_again() -> None:
    (s,) = _pieces()
    state = BoundedKernelDiagnosis("j", "k", 7, DiagnosisParams(), max_windows=8)
    state.add(s)
    state.add(s)  # a copy
    rows = state.window_rows(T0)
    assert len(rows) == 1 and rows[0].n_events == (5,) and rows[0].n_clusters[0] == len(rows[0].cluster_p50_ns)
    assert list(rows[0].cluster_p50_ns) == sorted(rows[0].cluster_p50_ns)
    state._judged[T0] = 1
    late = KernelSummary("j", "k", 7, (0,), (T0,), (T0 + W,), (2,), (1,), (2,), (5000,), (5000,), (5000,),
                         (5000,), (10000,), piece=(99,))
    state.add(late)
    assert state.window_rows(T0)[0].n_events == (7,) and T0 not in state._judged


def test_merge_pieces_adds_events_and_concatenates_clusters() -> None:
    a = KernelSummary("j", "k", 7, (0,), (T0,), (T0 + W,), (3,), (1,), (3,), (200,), (210,), (190,), (220,), (600,))
    b = KernelSummary("j", "k", 7, (0,), (T0,), (T0 + W,), (2,), (1,), (2,), (100,), (110,), (90,), (120,), (200,))
    m = merge_pieces([a, b])
    m.check()
    assert m.n_events == (5,) and m.cluster_p50_ns == (100, 200) and m.cluster_count == (2, 3)


def test_summary_rows_are_keyed_by_piece_and_versioned_by_events() -> None:
    table = TABLES["kernel_summaries"]
    assert table.order_by[-1] == "piece" and table.version == "n_events"
    (s,) = _pieces()
    assert [row[-1] for row in table.rows(s)] == [11, 13, 11]
    v1 = KernelSummary("j", "k", 7, (0,), (T0,), (T0 + W,), (2,), (1,), (2,), (5,), (5,), (5,), (5,), (10,))
    assert [row[-1] for row in table.rows(v1)] == [0]
    assert KernelSummary.decode(s.encode()) == s


def test_diagnosed_records_list_their_finding_ids() -> None:
    rec = JobLifecycle("j", LifecycleEvent.DIAGNOSED, T0, 4, source="streams", part="l1l2", finding_ids=("a", "b"))
    assert JobLifecycle.decode(rec.encode()) == rec
    assert next(iter(TABLES["jobs"].rows(rec)))[9] == ["a", "b"]


def test_a_phase_batch_without_phases_leaves_a_marker_row() -> None:
    # Imported traces without annotations send one empty PhaseBatch per rank and step: the END counts them,
    # so the store must show that each arrived (findings --wait checks END's phase_batches).
    table = TABLES["phases"]
    empty = PhaseBatch("j", 3, 7, (), (), (), (), (), ())
    assert [(r[1], r[2], r[3]) for r in table.rows(empty)] == [(3, 7, PHASE_MARKER_IDX)]
    full = PhaseBatch("j", 3, 8, (PhaseKind.FORWARD,), ("fwd",), (ParallelGroup.NONE,), (-1,), (10,), (5,))
    assert [r[3] for r in table.rows(full)] == [0]
