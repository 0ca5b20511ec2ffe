"""Rank-side heartbeats: published at the configured rate, on entry of a phase the rank stays in, carrying the
phase and the collective in flight, never after close; the state the training thread writes is bounded."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

from argus.core.settings import Settings  # noqa: E402
from argus.producers.cuda_timing import PhaseRec  # noqa: E402
from argus.producers.heartbeat import MAX_DEPTH, LiveState  # noqa: E402
from argus.producers.rank_registry import RankRegistry  # noqa: E402
from argus.producers.tracer import Tracer  # noqa: E402
from argus.schemas.records import Heartbeat, ParallelGroup, PhaseKind  # noqa: E402
from argus.topics import Topic  # noqa: E402
from tests.samples import RecordingPublisher  # noqa: E402


def make(pub: RecordingPublisher, tmp_path: Path, interval_s: float, **kw: Any) -> Tracer:
    return Tracer(Settings(heartbeat_interval_s=interval_s), "job-h", kw.pop("rank", 1), kw.pop("world_size", 4),
                  pub, kernels=False, registry=RankRegistry(tmp_path / "reg"), reduce_counts=False,
                  tp=kw.pop("tp", 2), **kw)


def test_heartbeats_at_the_rate_and_none_after_close(tmp_path: Path) -> None:
    pub = RecordingPublisher(check=True, round_trip=True)
    tr = make(pub, tmp_path, 0.2).start()
    time.sleep(1.05)
    stats = tr.close()
    beats = pub.of(Heartbeat)
    assert 4 <= len(beats) <= 8, len(beats)  # one at start, then one per 0.2 s
    assert stats.heartbeats_published == len(beats) and stats.heartbeats_dropped == 0
    assert all(t is Topic.HEARTBEATS and k == b"job-h" for t, k, r in pub.records if isinstance(r, Heartbeat))
    assert all(b.rank == 1 and b.step == -1 and b.phase == "" and not b.in_flight for b in beats)
    times = [b.time_ns for b in beats]
    assert times == sorted(times)
    time.sleep(0.4)
    assert len(pub.of(Heartbeat)) == len(beats)  # stopped at close


def test_heartbeat_on_entry_of_a_phase_the_rank_stays_in(tmp_path: Path) -> None:
    pub = RecordingPublisher(check=True)
    with make(pub, tmp_path, 30.0) as tr:  # the periodic one is far away: only the start one and entries
        for _ in range(3):
            with tr.step():
                for _ in range(50):  # phases shorter than a tick add no heartbeat
                    with tr.phase("mlp", PhaseKind.FORWARD):
                        pass
        with tr.step(), tr.phase("backward", PhaseKind.BACKWARD), tr.phase("attn", PhaseKind.BACKWARD):
            time.sleep(0.7)
        beats = pub.of(Heartbeat)
    assert len(beats) == 2, beats
    assert (beats[1].step, beats[1].phase, beats[1].phase_kind) == (3, "attn", PhaseKind.BACKWARD)


def test_heartbeat_carries_the_collective_in_flight(tmp_path: Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        pub = RecordingPublisher(check=True)
        tr = make(pub, tmp_path, 30.0, rank=0, world_size=1, tp=1)
        inside: list[Heartbeat] = []

        def launch() -> Any:
            assert tr._beat is not None
            tr._beat.beat()  # the heartbeat thread fires while the collective is in flight
            inside.append(pub.of(Heartbeat)[-1])
            return None

        with tr, tr.step(7):
            tr.all_reduce(torch.ones(2))  # DP seq 0
            tr._collective(None, PhaseKind.ALL_REDUCE, ParallelGroup.DP, (torch.ones(2),), None, False, launch)
            handle = tr._collective(None, PhaseKind.ALL_GATHER, ParallelGroup.TP, (torch.ones(2),), None, True,
                                    lambda: dist.all_reduce(torch.ones(2), async_op=True))
            assert tr._beat is not None
            tr._beat.beat()
            pending = pub.of(Heartbeat)[-1]
            handle.wait()
            tr._beat.beat()
            after = pub.of(Heartbeat)[-1]
        (hb,) = inside
        assert (hb.step, hb.phase, hb.phase_kind) == (7, "dp-allreduce", PhaseKind.ALL_REDUCE)
        assert (hb.collective, hb.group, hb.group_index, hb.seq) == (PhaseKind.ALL_REDUCE, ParallelGroup.DP, 0, 1)
        assert 0 < hb.in_flight_since_ns <= hb.time_ns
        assert (pending.collective, pending.group, pending.seq) == (PhaseKind.ALL_GATHER, ParallelGroup.TP, 0)
        assert not after.in_flight and after.in_flight_since_ns == -1 and after.seq == -1
    finally:
        dist.destroy_process_group()


def test_live_state_stack_is_bounded_and_unwinds() -> None:
    st = LiveState()
    recs = [PhaseRec(f"p{i}", PhaseKind.OTHER, ParallelGroup.NONE, -1, i) for i in range(MAX_DEPTH + 3)]
    for r in recs:
        st.enter(r)
    assert st.depth == MAX_DEPTH
    st.exit(recs[-1])  # never tracked: nothing changes
    assert st.depth == MAX_DEPTH
    st.exit(recs[2])  # the phases above it never ended (an exception): they go too
    assert st.depth == 2 and st.snapshot("j", 0, 5, {}).phase == "p1"
    st.exit(recs[1])
    st.exit(recs[0])
    assert st.depth == 0 and st.snapshot("j", 0, 5, {}).phase == ""
    assert all(s is None for s in st.stack)


def test_heartbeat_interval_is_validated() -> None:
    from argus.core.errors import ConfigError

    for bad in (0, -1, 3601, float("nan")):
        with pytest.raises(ConfigError, match="heartbeat_interval_s"):
            Settings(heartbeat_interval_s=bad).validate()
    assert Settings().heartbeat_interval_s == 2.0
