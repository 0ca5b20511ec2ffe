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
