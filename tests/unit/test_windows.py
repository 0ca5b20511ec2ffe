"""Event-time windows: accounting, boundaries, late events, ack tokens; and compression on top of them."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.records import KernelBatch
from streams.compression import summarize_windows
from streams.windows import WindowBuffer

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
