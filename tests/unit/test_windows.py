"""Event-time windows: accounting, boundaries, late events, ack tokens; and compression on top of them."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from argus.core.errors import SchemaError
from argus.schemas.records import KernelBatch
from argus.streams.compression import summarize_isolated, summarize_windows
from argus.streams.windows import OTHER_KERNEL, KernelNames, WindowBuffer, beyond_skew

W = 1_000_000_000  # 1 s windows
T0 = 1_767_225_600 * W


def batch(start_ns: np.ndarray, rank: int = 0, seq: int = 0, names: tuple[str, ...] = ("k0", "k1"),
          eos: bool = False, job: str = "j") -> KernelBatch:
    n = start_ns.size
    # Durations derive from the start time so that cutting a stream differently keeps each event intact.
    return KernelBatch(job, rank, seq, names, (start_ns // 7) % len(names), np.full(n, 7), start_ns,
                       1000 + start_ns % 997, np.zeros(n), end_of_stream=eos)


def test_windows_close_on_watermark_and_end_of_stream() -> None:
    buf = WindowBuffer(W, lateness_ns=W // 2)
    up = buf.add(batch(T0 + np.arange(10) * (W // 10)), token=1)
    assert up.closed == [] and up.free_tokens == []
    up = buf.add(batch(T0 + W + W // 2 + np.arange(3)), token=2)  # watermark passes end + lateness
    assert [(w.start_ns, len(w)) for w in up.closed] == [(T0, 10)]
    assert buf.release(up.closed[0]) == [1]
    up = buf.add(batch(np.array([], dtype=np.int64), eos=True), token=3)
    assert [(w.start_ns, len(w)) for w in up.closed] == [(T0 + W, 3)]
    assert up.free_tokens == [3]
    assert buf.release(up.closed[0]) == [2]
    assert buf.open_windows == 0


def test_late_events_are_returned_not_dropped() -> None:
    buf = WindowBuffer(W, lateness_ns=0)
    buf.add(batch(np.array([T0, T0 + 2 * W])), token=1)
    up = buf.add(batch(np.array([T0 + 5, T0 + 2 * W + 1])), token=2)
    assert up.late is not None and up.late.start_ns.tolist() == [T0 + 5]


def test_job_end_flushes_all_ranks_of_the_job_only() -> None:
    buf = WindowBuffer(W, lateness_ns=0)
    buf.add(batch(np.array([T0]), rank=0), token=1)
    buf.add(batch(np.array([T0]), rank=1), token=2)
    buf.add(batch(np.array([T0]), rank=0, job="other"), token=3)
    closed = buf.flush_job("j")
    assert sorted(w.rank for w in closed) == [0, 1] and buf.open_windows == 1


def test_windows_align_to_epoch_multiples() -> None:
    buf = WindowBuffer(W, lateness_ns=0)
    up = buf.add(batch(np.array([T0 + 123, T0 + W + 5]), eos=True), token=1)
    assert [w.start_ns % W for w in up.closed] == [0, 0]


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 400),
    cuts=st.lists(st.integers(0, 400), max_size=6),
    span_s=st.integers(1, 8),
    seed=st.integers(0, 2**16),
)
def test_batching_does_not_change_windows_or_lose_events(n: int, cuts: list[int], span_s: int, seed: int) -> None:
    """However a rank's ordered stream is cut into messages, the same windows come out, every event once."""
    rng = np.random.default_rng(seed)
    start = T0 + np.sort(rng.integers(0, span_s * W, n))
    edges = sorted({0, n, *[c % (n + 1) for c in cuts]})

    def run(parts: list[tuple[int, int]]) -> list[tuple[int, tuple[int, ...]]]:
        buf = WindowBuffer(W, lateness_ns=W // 4)
        closed = []
        for i, (a, b) in enumerate(parts):
            closed += buf.add(batch(start[a:b], seq=i), token=i).closed
        closed += buf.add(batch(start[:0], seq=len(parts), eos=True), token=len(parts)).closed
        return sorted((w.start_ns, tuple(np.sort(w.duration_ns).tolist())) for w in closed)

    one = run([(0, n)])
    many = run(list(itertools.pairwise(edges)))
    assert one == many
    assert sum(len(d) for _, d in one) == n


def test_tokens_released_only_when_all_their_windows_are_emitted() -> None:
    buf = WindowBuffer(W, lateness_ns=0)
    up = buf.add(batch(np.array([T0, T0 + W])), token=7)  # spans two windows
    assert [w.start_ns for w in up.closed] == [T0]
    assert buf.release(up.closed[0]) == []
    up = buf.add(batch(np.array([T0 + 3 * W])), token=8)
    assert buf.release(up.closed[0]) == [7]


def test_summaries_account_for_every_event_and_regroup_by_kernel() -> None:
    rng = np.random.default_rng(1)
    buf = WindowBuffer(W, lateness_ns=0)
    closed = []
    for rank in range(3):
        n = 3000
        dur = np.where(rng.random(n) < 0.5, rng.lognormal(np.log(5e4), 0.05, n), rng.lognormal(np.log(4e5), 0.05, n))
        b = KernelBatch("j", rank, 0, ("gemm", "nccl"), np.zeros(n), np.full(n, 7), T0 + np.arange(n) * 1000,
                        dur.astype(np.int64), np.zeros(n), end_of_stream=True)
        closed += buf.add(b, token=rank).closed
    out = summarize_windows(closed)
    assert len(out) == 1 and out[0].kernel == "gemm" and out[0].rank == (0, 1, 2)
    assert sum(out[0].n_events) == 9000 and out[0].n_clusters == (2, 2, 2)
    p50 = np.array(out[0].cluster_p50_ns).reshape(3, 2)
    assert np.allclose(p50[:, 0], 5e4, rtol=0.05) and np.allclose(p50[:, 1], 4e5, rtol=0.05)


def test_beyond_skew_against_the_watermark_or_the_batch_median() -> None:
    starts = np.array([T0, T0 + 5, T0 + 10**18, T0 + 7])
    assert beyond_skew(starts, T0, 3600 * W).tolist() == [False, False, True, False]
    # No watermark yet: the batch's median stands in for it.
    assert beyond_skew(starts, -(2**62), 3600 * W).tolist() == [False, False, True, False]
    assert not beyond_skew(starts, T0, None).any()


def test_far_future_event_is_set_aside_and_does_not_move_the_watermark() -> None:
    buf = WindowBuffer(W, lateness_ns=0, max_skew_ns=60 * W)
    buf.add(batch(T0 + np.arange(5) * 1000), token=1)
    up = buf.add(batch(np.array([T0 + 10**18, T0 + 6000])), token=2)
    assert up.skewed is not None and up.skewed.start_ns.tolist() == [T0 + 10**18]
    assert up.closed == [] and up.late is None
    # 10,000 later events in the same window: none is late (the watermark did not jump 10^18 ns ahead).
    ups = [buf.add(batch(T0 + 10_000 + np.arange(i * 100, (i + 1) * 100)), token=3 + i) for i in range(100)]
    assert all(u.late is None and u.skewed is None for u in ups)
    up = buf.add(batch(np.array([], dtype=np.int64), eos=True), token=200)
    assert sum(len(w) for w in up.closed) == 5 + 1 + 10_000


def test_a_ranks_first_batch_far_in_the_future_is_judged_against_its_job_and_takes_no_seq() -> None:
    """A bogus batch that is the first of its rank (another rank of the job already has a watermark) is set
    aside, and its bogus seq does not turn the rank's real batches into copies (they were all lost so)."""
    buf = WindowBuffer(W, lateness_ns=W // 2, max_skew_ns=60 * W, late_pieces=True)
    buf.add(batch(T0 + np.arange(5) * 1000, rank=1), token=1)
    up = buf.add(batch(np.full(4, T0 + 4 * 10**18), rank=0, seq=10**6), token=2)
    assert up.skewed is not None and len(up.skewed) == 4 and up.free_tokens == [2] and not up.duplicate
    ups = [buf.add(batch(T0 + np.arange(i * 10, (i + 1) * 10), rank=0, seq=i), token=3 + i) for i in range(3)]
    assert not any(u.duplicate or u.skewed is not None for u in ups)
    end = buf.add(batch(np.array([], dtype=np.int64), rank=0, seq=3, eos=True), token=9)
    assert sum(len(w) for w in end.closed) == 30 and buf.ranks_of("j") == {1}
    # With no rank of the job seen yet, the batch's own median is the reference: one far event is caught.
    first = buf.add(batch(np.array([T0, T0 + 1, T0 + 10**18]), job="other"), token=10)
    assert first.skewed is not None and first.skewed.start_ns.tolist() == [T0 + 10**18]
    # A job whose very first batch is bogus as a whole: only the caller's clock can tell.
    alone = batch(np.full(4, T0 + 4 * 10**18), job="third", seq=10**6)
    assert buf.add(alone, token=11).skewed is None  # no clock given: nothing to compare with
    up = buf.add(dataclasses.replace(alone, job_id="fourth"), token=12, now_ns=T0)
    assert up.skewed is not None and len(up.skewed) == 4 and up.closed == []
    later = buf.add(batch(T0 + np.arange(5), job="fourth", seq=0), token=13, now_ns=T0)
    assert later.skewed is None and not later.duplicate


def test_without_a_skew_limit_one_far_event_turns_later_events_late() -> None:
    buf = WindowBuffer(W, lateness_ns=0)
    buf.add(batch(np.array([T0, T0 + 10**18])), token=1)
    assert buf.add(batch(np.array([T0 + 5])), token=2).late is not None


def test_kernel_names_per_window_are_capped_into_an_other_bucket() -> None:
    names = KernelNames(limit=3)
    kid = names.map(("a", "b", "c", "d", "e"), np.array([0, 1, 2, 3, 4, 4, 0], dtype=np.uint32))
    assert names.names == ("a", "b", "c", OTHER_KERNEL) and kid.tolist() == [0, 1, 2, 3, 3, 3, 0]
    assert names.folded_events == 3
    assert names.map(("z", "b"), np.array([0, 1], dtype=np.uint32)).tolist() == [3, 1]
    assert names.folded_events == 4


def test_a_window_with_many_names_is_summarized_within_the_cap() -> None:
    n = 20_000
    many = tuple(f"k{i}" for i in range(n))
    b = KernelBatch("j", 0, 0, many, np.arange(n), np.full(n, 7), T0 + np.arange(n), np.full(n, 1000), np.zeros(n),
                    end_of_stream=True)
    closed = WindowBuffer(W, lateness_ns=0, max_names=100).add(b, token=1).closed
    assert len(closed) == 1 and len(closed[0].names) == 101 and closed[0].folded_events == n - 100
    out = summarize_windows(closed)
    assert len(out) == 101 and sum(sum(s.n_events) for s in out) == n
    other = next(s for s in out if s.kernel == OTHER_KERNEL)
    assert other.n_events == (n - 100,)


def test_names_of_different_windows_do_not_share_a_dictionary() -> None:
    buf = WindowBuffer(W, lateness_ns=0, max_names=1)
    b = KernelBatch("j", 0, 0, ("x", "y"), np.array([0, 1]), np.full(2, 7), np.array([T0, T0 + W]),
                    np.full(2, 1000), np.zeros(2), end_of_stream=True)
    closed = buf.add(b, token=1).closed
    assert [w.names for w in closed] == [("x",), ("y",)]


def test_a_window_that_cannot_be_summarized_is_set_aside() -> None:
    buf = WindowBuffer(W, lateness_ns=0)
    big = 2**62 - 1  # each duration is valid, their sum is beyond int64
    b0 = KernelBatch("j", 0, 0, ("k",), np.zeros(3), np.full(3, 7), T0 + np.arange(3), np.full(3, big),
                     np.zeros(3), end_of_stream=True)
    closed = buf.add(b0, token=1).closed + buf.add(batch(T0 + np.arange(50), rank=1, eos=True), token=2).closed
    out, failed = summarize_isolated(closed)
    assert [w.rank for w, _ in failed] == [0] and isinstance(failed[0][1], SchemaError)
    assert {s.rank for s in out} == {(1,)} and sum(sum(s.n_events) for s in out) == 50
    dead = failed[0][0].as_batch()
    dead.check()
    assert len(dead) == 3 and dead.names == ("k",)


def test_discard_takes_one_message_out_of_the_open_windows() -> None:
    buf = WindowBuffer(W, lateness_ns=0)
    buf.add(batch(T0 + np.arange(3)), token=1)
    buf.add(batch(T0 + 10 + np.arange(4)), token=2)
    buf.add(batch(np.array([T0 + W - 1])), token=3)
    buf.discard(2)
    up = buf.add(batch(np.array([], dtype=np.int64), eos=True), token=4)
    assert [len(w) for w in up.closed] == [4] and up.free_tokens == [4]
    assert buf.release(up.closed[0]) == [1, 3]


def test_far_future_events_of_an_ended_rank_are_set_aside_not_summarized() -> None:
    from argus.schemas.records import KernelBatch

    def batch(seq: int, start: int, end: bool = False) -> KernelBatch:
        n = 0 if end else 4
        return KernelBatch(job_id="j", rank=0, seq=seq, names=("k",), name_idx=np.zeros(n, np.uint32),
                           stream=np.full(n, 7, np.uint32), start_ns=np.full(n, start, np.int64),
                           duration_ns=np.full(n, 1000, np.int64), step=np.zeros(n, np.int32), end_of_stream=end)

    buf = WindowBuffer(10**10, 10**9, max_skew_ns=3600 * 10**9, late_pieces=True)
    buf.add(batch(0, 5 * 10**9), 0)
    buf.add(batch(1, 0, end=True), 1)  # the rank ended
    up = buf.add(batch(2, 4 * 10**18), 2)  # one bogus timestamp, after the end
    assert up.closed == [] and up.skewed is not None and len(up.skewed) == 4
    late = buf.add(batch(3, 6 * 10**9), 3)  # an ordinary straggler is still a piece
    assert late.skewed is None and sum(len(w.duration_ns) for w in late.closed) == 4
