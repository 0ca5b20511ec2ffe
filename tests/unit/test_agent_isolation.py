"""The pure parts of the agents' per-record isolation: which ranks are foreign to a job, summary rows,
bounded L3 state, dead-letter reasons and delivery (a dead letter the broker refuses is never acked past)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

from argus.core.errors import DeadLetterError, DetectorError, SchemaError, failure_reason
from argus.schemas.records import DeadLetter, KernelSummary
from argus.streams.dead_letters import DeadLetters
from argus.streams.diagnosis import DiagnosisParams
from argus.streams.summary_pieces import BoundedKernelDiagnosis, foreign_ranks, select_rows
from tests.samples import T0, samples

W = 1_000_000_000


def test_foreign_ranks_by_topology_then_world_size() -> None:
    topo = samples()["job_topology"]  # ranks 0 and 1
    assert foreign_ranks([0, 1, 5, 5, 2], topo, None) == [2, 5]
    assert foreign_ranks([0, 3, 4], None, 4) == [4]
    assert foreign_ranks([0, 99], None, None) == []


def test_select_rows_keeps_each_rows_clusters() -> None:
    s = samples()["kernel_summary"]  # row 0: 2 clusters, row 1: 1 cluster
    one = select_rows(s, [1])
    one.check()
    assert one.rank == (1,) and one.cluster_p50_ns == (11,) and one.n_events == (3,)
    assert select_rows(s, [0, 1]) == s


def test_failure_reason_names_the_exception() -> None:
    assert failure_reason(DetectorError("rank 9 not in topology")) == "DetectorError: rank 9 not in topology"
    assert failure_reason(SchemaError("step.v1: corrupt body")) == "step.v1: corrupt body"


def _summary(ws: int, rank: int) -> KernelSummary:
    return KernelSummary("j", "gemm", 7, (rank,), (ws,), (ws + W,), (4,), (1,), (4,), (100,), (120,), (90,),
                         (130,), (400,))


def test_l3_state_keeps_at_most_max_windows_judged_windows() -> None:
    state = BoundedKernelDiagnosis("j", "gemm", 7, DiagnosisParams(), max_windows=3)
    for i in range(10):
        for rank in range(2):
            state.add(_summary(T0 + i * W, rank))
        state.diagnose(None, final=True)  # judges every window
        state.prune()
    assert state.windows == 3 and state.forgotten_through == T0 + 6 * W
    # A row for a forgotten window is ignored, not judged against nobody.
    state.add(_summary(T0 + 2 * W, 1))
    assert state.windows == 3 and state.rows_ignored == 1


def test_unjudged_windows_are_never_pruned() -> None:
    state = BoundedKernelDiagnosis("j", "gemm", 7, DiagnosisParams(), max_windows=3)
    for i in range(6):
        state.add(_summary(T0 + i * W, 0))
        state.prune()
    assert state.windows == 6 and state.forgotten_through is None


@dataclass
class _Msg:
    topic: str = "t.kernels"
    partition: int = 2
    offset: int = 41
    key: bytes = b"job/3"


@dataclass
class _Event:
    value: bytes = b"poison"
    message: _Msg = field(default_factory=_Msg)


class _Topic:
    def __init__(self, fail: int) -> None:
        self.fail, self.sent = fail, []  # type: ignore[var-annotated]

    async def send(self, key: bytes, value: bytes, force: bool) -> Any:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.fail > 0:
            self.fail -= 1
            fut.set_exception(RuntimeError("broker refused"))
        else:
            self.sent.append((key, value))
            fut.set_result(None)
        return fut


def test_dead_letter_is_retried_then_delivered() -> None:
    topic = _Topic(fail=1)
    dead = DeadLetters(topic, retries=2)
    asyncio.run(dead.send(_Event(), "compress", "why", job="job", rank=3))  # type: ignore[arg-type]
    (key, value), = topic.sent
    rec = DeadLetter.decode(value)
    assert key == b"job/3" and (rec.stage, rec.reason, rec.payload, rec.offset) == ("compress", "why", b"poison", 41)
    assert dead.sent == 1


def test_undeliverable_dead_letter_raises_instead_of_being_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    async def no_sleep(_: float) -> None:
        return None

    monkeypatch.setattr(asyncio, "sleep", no_sleep)
    dead = DeadLetters(_Topic(fail=10), retries=2)
    with pytest.raises(DeadLetterError, match="not delivered"):
        asyncio.run(dead.send(_Event(), "compress", "why"))  # type: ignore[arg-type]
    assert dead.sent == 0


def test_pruned_windows_are_judged_again_at_the_end_from_their_results(monkeypatch: pytest.MonkeyPatch) -> None:
    import argus.streams.diagnosis as diagnosis
    from argus.detectors.impact import StepClock
    from argus.streams.diagnosis import _row
    from tests.unit.test_diagnosis_state import _summaries

    topo, summaries = _summaries()  # the paper's case 1: rank 5's GEMMs slow, over several windows
    rows = [_row(s, i) for s in summaries for i in range(len(s.rank))]
    full = {ws for ws in {r.window_start_ns[0] for r in rows}
            if sum(r.window_start_ns[0] == ws for r in rows) == topo.world_size}
    summaries = sorted((r for r in rows if r.window_start_ns[0] in full), key=lambda r: r.window_start_ns[0])
    assert len(full) >= 3
    clock = StepClock((max(r.window_end_ns[0] for r in summaries),), 1e9)
    # Nothing is raised live (a margin no impact clears): every finding comes from the end's judgement.
    params = DiagnosisParams(live_impact_margin=1e9)
    bounded = BoundedKernelDiagnosis("c1", summaries[0].kernel, summaries[0].stream, params, max_windows=1)
    whole = diagnosis.KernelDiagnosis("c1", summaries[0].kernel, summaries[0].stream, params)
    for s in summaries:
        for state in (bounded, whole):
            state.add(s)
            assert state.diagnose(topo, clock=clock) == []
        bounded.prune()
    assert bounded.windows == 1 and bounded.forgotten_through is not None
    calls: list[int] = []
    real = diagnosis.detect_l3
    monkeypatch.setattr(diagnosis, "detect_l3", lambda rows, *a: calls.append(len(rows)) or real(rows, *a))
    found = bounded.diagnose(topo, final=True, clock=clock)
    # The windows whose rows went are judged from what their live judgement found, and L3 does not run
    # again on rows that did not change: the same findings, impacts and evidence as with every row kept.
    assert calls == []
    assert found and found == whole.diagnose(topo, final=True, clock=clock)
    assert {r for f in found for r in f.ranks} == {5}


def test_a_changed_topology_or_group_judges_the_rows_again() -> None:
    from argus.detectors.impact import StepClock
    from argus.schemas.records import ParallelGroup
    from tests.unit.test_diagnosis_state import _summaries

    topo, summaries = _summaries()
    clock = StepClock((max(e for s in summaries for e in s.window_end_ns),), 1e9)
    state = BoundedKernelDiagnosis("c1", summaries[0].kernel, summaries[0].stream, DiagnosisParams(),
                                   max_windows=64)
    for s in summaries:
        state.add(s)
    state.diagnose(topo, clock=clock)
    kept = dict(state._results)
    assert kept and all(k.holds(topo, None) for k in kept.values())
    state.diagnose(topo, final=True, clock=clock, group_kind=ParallelGroup.TP)
    assert all(state._results[ws].group_kind is ParallelGroup.TP and state._results[ws] is not k
               for ws, k in kept.items())
