"""The compression agent's router without a broker: ack ordering, end markers, rebalance, late events,
copies, skew and failures (what :mod:`argus.streams.compression_agent` only carries out)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from argus.core.errors import ConfigError
from argus.core.settings import Settings
from argus.schemas.records import JobLifecycle, KernelBatch, KernelSummary, LifecycleEvent
from argus.streams.compression_router import CompressionRouter, Emission, Routed, Staging

W = 1_000_000_000  # window: 1 s
T0 = 1_700_000_000 * 10**9
SETTINGS = Settings(window_ns=W, allowed_lateness_ns=W // 2, max_event_skew_ns=100 * W, job_idle_timeout_s=10.0)


@dataclass(frozen=True)
class Msg:
    """A message handle: what the router returns to ack."""

    offset: int


def batch(start_s: float, n: int = 8, rank: int = 0, seq: int = 0, job: str = "j", eos: bool = False,
          names: tuple[str, ...] = ("gemm", "relu")) -> KernelBatch:
    start = T0 + int(start_s * W) + np.arange(n, dtype=np.int64) * (W // 100)
    return KernelBatch(job, rank, seq, names, (np.arange(n) % len(names)).astype(np.uint32),
                       np.full(n, 7, np.uint32), start, 10_000 + (np.arange(n, dtype=np.int64) % 5) * 100,
                       np.zeros(n, np.int32), end_of_stream=eos)


class Agent:
    """Plays the shell: takes messages in order, 'delivers' emissions when told, records the acks."""

    def __init__(self, settings: Settings = SETTINGS, staging: Staging | None = None) -> None:
        self.router: CompressionRouter[Msg] = CompressionRouter(settings.worker, settings.detector, staging=staging)
        self.acked: list[int] = []
        self.sent: list[KernelSummary] = []
        self.in_flight: list[Emission[Msg]] = []
        self.dead: list[str] = []
        self.markers: list[tuple[str, int]] = []
        self.offset = 0

    def carry_out(self, routed: Routed[Msg], deliver: bool = True) -> None:
        self.dead += [d.reason for d in routed.dead]
        if routed.emission is not None:
            self.sent += routed.emission.summaries
            self.in_flight.append(routed.emission)
        if routed.end_marker is not None:
            self.deliver_all()  # the shell waits for every summary sent before passing a marker on
            self.markers.append(routed.end_marker)
        elif deliver:
            self.deliver_all()
        self.acked += [m.offset for m in routed.ack]

    def take(self, b: KernelBatch, partition: int = 0, deliver: bool = True, now: float = 0.0) -> Routed[Msg]:
        routed = self.router.take(b, Msg(self.offset), partition, self.offset, now, T0)
        self.offset += 1
        self.carry_out(routed, deliver)
        return routed

    def deliver_all(self) -> None:
        while self.in_flight:
            self.carry_out(self.router.delivered(self.in_flight.pop(0)), deliver=False)


def events_in(summaries: list[KernelSummary]) -> int:
    return sum(sum(s.n_events) for s in summaries)


def test_a_message_is_acked_only_once_its_windows_summaries_are_delivered() -> None:
    a = Agent()
    a.take(batch(0.0, n=50), deliver=False)  # window [0, 1 s): open
    assert a.acked == [] and a.router.pending_messages == 1
    # Events up to 1.5 s and past it: the first window closes (watermark past end + lateness).
    a.take(batch(1.0, n=80, seq=1), deliver=False)
    assert a.in_flight and a.acked == []  # summarized, not delivered: nothing acked yet
    a.deliver_all()
    assert a.acked == [0]  # message 1 still has events in the open window [1 s, 2 s)
    assert events_in(a.sent) == 50


def test_a_message_spanning_two_windows_waits_for_both() -> None:
    a = Agent()
    a.take(batch(0.5, n=100))  # 0.5 .. 1.49 s: windows [0, 1) and [1, 2)
    a.take(batch(1.6, n=1, seq=1))  # closes [0, 1) only
    assert a.acked == []
    a.take(batch(2.6, n=1, seq=2))  # closes [1, 2), which holds message 1 too
    assert a.acked == [0, 1]


def test_job_end_marker_flushes_the_partitions_ranks_then_passes_on_after_delivery() -> None:
    a = Agent()
    a.take(batch(0.0, rank=0), partition=1, deliver=False)
    a.take(batch(0.0, rank=1), partition=2, deliver=False)
    end = a.router.take(KernelBatch.job_end_marker("j"), Msg(99), 1, 99, 0.0, T0)
    # Only rank 0 arrives on partition 1; its window is summarized with the marker.
    assert end.emission is not None and {r for s in end.emission.summaries for r in s.rank} == {0}
    assert end.end_marker == ("j", 1) and [m.offset for m in end.ack] == [99]
    a.carry_out(end)
    assert a.markers == [("j", 1)] and sorted(a.acked) == [0, 99]
    # Rank 1 (partition 2) is still open until its own partition's marker.
    assert a.router.open_windows == 1
    a.carry_out(a.router.take(KernelBatch.job_end_marker("j"), Msg(100), 2, 100, 0.0, T0))
    assert sorted(a.acked) == [0, 1, 99, 100] and a.router.open_windows == 0 and a.router.pending_messages == 0


def test_marker_waits_for_summaries_sent_before_it() -> None:
    a = Agent()
    a.take(batch(0.0), deliver=False)
    a.take(batch(1.6, n=1, seq=1), deliver=False)  # closes window 0: an emission in flight
    assert len(a.in_flight) == 1
    a.carry_out(a.router.take(KernelBatch.job_end_marker("j"), Msg(7), 0, 7, 0.0, T0))
    # carry_out delivered everything before recording the marker: all summaries precede it.
    assert not a.in_flight and a.markers == [("j", 0)] and sorted(a.acked) == [0, 1, 7]


def test_rank_without_partition_is_closed_by_any_marker() -> None:
    a = Agent()
    a.take(batch(0.0, rank=3), partition=0)
    a.take(batch(0.2, n=0, rank=3, seq=1, eos=True), partition=0)  # its end of stream: partition forgotten
    routed = a.router.take(KernelBatch.job_end_marker("j"), Msg(5), 2, 5, 0.0, T0)  # another partition's
    a.carry_out(routed)
    assert a.router.open_windows == 0 and sorted(a.acked) == [0, 1, 5]


def test_rebalance_forgets_without_acking_and_redelivery_gives_the_same_summaries() -> None:
    msgs = [batch(0.0, seq=0), batch(0.5, seq=1), batch(1.6, n=1, seq=2)]
    first = Agent()
    first.take(msgs[0], deliver=False)
    first.take(msgs[1], deliver=False)
    first.router.revoked()
    assert first.router.pending_messages == 0 and first.router.open_windows == 0 and first.acked == []
    # The same messages re-delivered (same offsets) to a fresh owner and to the revoked one: same summaries.
    fresh = Agent()
    for agent in (first, fresh):
        agent.offset = 0
        agent.sent.clear()
        agent.in_flight.clear()
    for m in msgs:
        first.take(m)
        fresh.take(m)
    assert first.sent == fresh.sent and events_in(first.sent) == 16
    assert first.acked == fresh.acked == [0, 1]


def test_late_events_become_a_further_piece_of_their_window() -> None:
    a = Agent()
    a.take(batch(0.0, n=10))
    a.take(batch(1.6, n=1, seq=1))  # window [0, 1) summarized
    assert events_in(a.sent) == 10
    late = a.take(batch(0.3, n=4, seq=2))  # for the summarized window
    assert late.emission is not None
    piece = late.emission.summaries
    assert events_in(list(piece)) == 4 and all(p > 0 for s in piece for p in s.piece)
    assert a.router.stats.late_events == 4 and 2 in a.acked


def test_a_copy_of_a_batch_is_acked_not_summarized_again() -> None:
    a = Agent()
    a.take(batch(0.0, seq=0))
    a.take(batch(0.0, seq=0))  # re-sent
    assert a.router.stats.duplicate_batches == 1 and 1 in a.acked
    a.take(batch(1.6, n=1, seq=1))
    assert events_in(a.sent) == 8


def test_skewed_events_are_dead_lettered_before_their_message_is_acked() -> None:
    a = Agent()
    a.take(batch(0.0))
    routed = a.take(batch(1000.0, n=3, seq=1))  # 1000 s past a watermark, beyond max_event_skew_ns (100 s)
    assert routed.dead and routed.dead[0].reason.startswith("skew: 3 events of j/0")
    assert routed.dead[0].payload is not None and a.router.stats.skewed_events == 3


def test_a_failing_message_is_dead_lettered_whole_and_acked() -> None:
    a = Agent()
    a.take(batch(0.0))
    bad = batch(0.1, seq=1)
    object.__setattr__(bad, "duration_ns", None)  # processing raises inside the buffer
    routed = a.take(bad)
    assert [m.offset for m in routed.ack] == [1] and routed.dead
    assert routed.dead[0].rank == 0 and "Error" in routed.dead[0].reason
    assert a.router.stats.failed_messages == 1
    a.take(batch(1.6, n=1, seq=2))
    assert events_in(a.sent) == 8 and 0 in a.acked  # the partition goes on; the good message is summarized


def test_undelivered_summaries_are_dead_lettered_and_their_messages_still_freed() -> None:
    a = Agent()
    a.take(batch(0.0), deliver=False)
    routed = a.router.take(batch(1.6, n=1, seq=1), Msg(1), 0, 1, 0.0, T0)
    assert routed.emission is not None
    s = routed.emission.summaries[0]
    done = a.router.delivered(routed.emission, [(s, s.encode(), RuntimeError("refused"))])
    assert [m.offset for m in done.ack] == [0]
    assert done.dead[0].payload == s.encode() and "not delivered: RuntimeError: refused" in done.dead[0].reason


def test_kernel_only_jobs_are_abandoned_after_twice_the_idle_timeout() -> None:
    a = Agent()
    a.take(batch(0.0, n=5, rank=2), now=0.0)
    assert a.router.idle_jobs(10.0) == []
    # The worker's clock, read on its timer's ticks: a blocked loop counts as one tick of silence.
    out = [rec for t in np.arange(12.5, 30.0, a.router.idle_tick_s) for rec in a.router.idle_jobs(float(t))]
    assert len(out) == 1 and out[0].event is LifecycleEvent.ABANDONED and out[0].world_size == 3
    assert out[0].reason.startswith("kernels only") and out[0].time_ns > T0
    # An END forgets the job: no ABANDONED for it.
    b = Agent()
    b.take(batch(0.0), now=0.0)
    assert b.router.job_closed(JobLifecycle("j", LifecycleEvent.END, T0, 1))
    assert all(not b.router.idle_jobs(float(t)) for t in np.arange(0.0, 30.0, b.router.idle_tick_s))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 5.0), st.integers(1, 30), st.integers(0, 2)), min_size=1, max_size=12),
       st.lists(st.booleans(), min_size=12, max_size=12))
def test_every_event_summarized_once_and_every_message_acked_once(
        batches: list[tuple[float, int, int]], deliver_now: list[bool]) -> None:
    a = Agent()
    seqs: dict[int, int] = {}
    for i, (start, n, rank) in enumerate(batches):
        seqs[rank] = seqs.get(rank, -1) + 1
        a.take(batch(start, n=n, rank=rank, seq=seqs[rank]), partition=rank, deliver=deliver_now[i])
    for rank in range(3):
        a.carry_out(a.router.take(KernelBatch.job_end_marker("j"), Msg(1000 + rank), rank, 1000 + rank, 0.0, T0))
    assert sorted(a.acked) == sorted([*range(len(batches)), 1000, 1001, 1002])
    assert events_in(a.sent) == sum(n for _, n, _ in batches) and a.router.pending_messages == 0


def _ranks_closing_windows(a: Agent, ranks: int, now: float = 0.0) -> None:
    """Every rank's first window, then a batch that closes it (its watermark past the end + lateness)."""
    for r in range(ranks):
        a.take(batch(0.0, n=20, rank=r), now=now)
    for r in range(ranks):
        a.take(batch(1.6, n=20, rank=r, seq=1), now=now)


def test_staged_windows_make_one_summary_per_kernel_and_stream_with_the_same_rows() -> None:
    at_once, staged = Agent(), Agent(staging=Staging(windows=8, max_age_s=60.0))
    for a in (at_once, staged):
        _ranks_closing_windows(a, 8)
    # Each rank's message closed its own window: 8 summaries per (kernel, stream) at once, 1 staged.
    assert len(at_once.sent) == 8 * 2 and len(staged.sent) == 2
    rows = lambda sent: sorted((s.kernel, r, n) for s in sent for r, n in zip(s.rank, s.n_events, strict=True))  # noqa: E731
    assert rows(staged.sent) == rows(at_once.sent)
    # Acked alike once delivered: the first 8 messages (their windows summarized), not the open second ones.
    assert sorted(staged.acked) == sorted(at_once.acked) == list(range(8))


def test_staged_windows_wait_until_their_age_or_a_job_end_and_nothing_is_acked_before() -> None:
    a = Agent(staging=Staging(windows=1000, max_age_s=0.25))
    _ranks_closing_windows(a, 3, now=10.0)
    assert a.sent == [] and a.acked == [] and a.router.staged_windows == 3
    assert a.router.flush_staged(10.2).emission is None  # not old enough yet
    a.carry_out(a.router.flush_staged(10.3))
    assert a.router.staged_windows == 0 and {r for s in a.sent for r in s.rank} == {0, 1, 2}
    assert sorted(a.acked) == [0, 1, 2]
    # A job-end marker summarizes what is staged before it passes on.
    b = Agent(staging=Staging(windows=1000, max_age_s=60.0))
    _ranks_closing_windows(b, 2)
    b.take(KernelBatch.job_end_marker("j"))
    assert b.markers == [("j", 0)] and b.router.staged_windows == 0 and b.router.open_windows == 0
    assert events_in(b.sent) == 2 * 20 * 2 and sorted(b.acked) == list(range(5))


def test_a_rebalance_forgets_staged_windows_and_acks_nothing() -> None:
    a = Agent(staging=Staging(windows=1000, max_age_s=60.0))
    _ranks_closing_windows(a, 2)
    a.router.revoked()
    assert a.router.staged_windows == 0 and a.acked == [] and a.router.pending_messages == 0


def test_staging_is_validated() -> None:
    for bad in (dict(windows=0), dict(max_age_s=0.0)):
        with pytest.raises(ConfigError):
            Staging(**bad)  # type: ignore[arg-type]
