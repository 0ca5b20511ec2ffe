"""A profiler alongside, on the CPU: real torch.profiler sessions (with and without a schedule) make the tracer's
kernel records step aside (CUPTI released to the profiler, fake CUPTI here) and come back when they stop, while
steps, phases and heartbeats go on; a CPU-only session changes nothing; two sessions at once hold argus aside
until the last one stops. Without a GPU torch drops the CUDA activity of a session, so "traces the GPU" is forced
where a test needs a GPU session; everything else is torch's own profiler code."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch.profiler import ProfilerActivity, profile, schedule  # noqa: E402

import argus.producers.cupti_kernels as ck  # noqa: E402
import argus.producers.profiler_guard as pg  # noqa: E402
from argus.core.settings import Settings  # noqa: E402
from argus.producers.cupti_kernels import CuptiState  # noqa: E402
from argus.producers.profiler_guard import ProfilerGuard  # noqa: E402
from argus.producers.rank_registry import RankRegistry  # noqa: E402
from argus.producers.tracer import Tracer  # noqa: E402
from argus.schemas.records import Heartbeat, PauseReason, PhaseKind, Step  # noqa: E402
from tests.samples import RecordingPublisher  # noqa: E402
from tests.unit.test_cupti_kernels import FakeCupti  # noqa: E402


def _tracer(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, pub: RecordingPublisher) -> tuple[Tracer, FakeCupti]:
    fake = FakeCupti()
    monkeypatch.setattr(ck, "_load_cupti", lambda: (fake, ""))
    monkeypatch.setenv("ARGUS_CUPTI", "1")
    tr = Tracer(Settings(heartbeat_interval_s=0.1), "job-prof", 0, 1, pub, registry=RankRegistry(tmp_path / "r"),
                reduce_counts=False, cuda=False)
    return tr, fake


def _steps(tr: Tracer, n: int, prof: Any = None) -> None:
    for _ in range(n):
        with tr.step(), tr.phase("forward", PhaseKind.FORWARD):
            torch.ones(8) @ torch.ones(8)
        if prof is not None:
            prof.step()


def test_a_gpu_profiler_session_takes_cupti_and_gives_it_back(monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    monkeypatch.setattr(pg, "_traces_gpu", lambda prof: True)
    pub = RecordingPublisher(check=True)
    tr, fake = _tracer(monkeypatch, tmp_path, pub)
    tr.start()
    assert tr.cupti_status.state is CuptiState.RUNNING and fake.enabled
    seen: list[tuple[CuptiState, bool]] = []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
        seen.append((tr.cupti_status.state, bool(fake.enabled)))
        _steps(tr, 3)
        time.sleep(0.3)  # heartbeats meanwhile
    assert seen == [(CuptiState.PAUSED, False)]  # released before Kineto prepared
    assert tr.cupti_status.state is CuptiState.RUNNING and fake.enabled  # taken back after the stop
    _steps(tr, 2)
    deadline = time.monotonic() + 30
    while not (pub.of(Heartbeat) and not pub.of(Heartbeat)[-1].kernels_paused):  # the flag goes with the pause
        assert time.monotonic() < deadline
        time.sleep(0.02)
    stats = tr.close()
    assert stats.steps == 5 and len(pub.of(Step)) == 5  # steps went on throughout
    assert stats.profiler_sessions == 1 and stats.kernel_pauses == 1
    beats = pub.of(Heartbeat)
    assert any(b.kernels_paused and b.pause_reasons == (PauseReason.PROFILER,) for b in beats)


def test_scheduled_session_steps_aside_from_warmup_to_its_end(monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    monkeypatch.setattr(pg, "_traces_gpu", lambda prof: True)
    tr, fake = _tracer(monkeypatch, tmp_path, RecordingPublisher())
    tr.start()
    states: list[CuptiState] = []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 schedule=schedule(wait=1, warmup=1, active=2, repeat=1)) as prof:
        for _ in range(6):
            states.append(tr.cupti_status.state)
            _steps(tr, 1, prof)
    assert states[0] is CuptiState.RUNNING  # the wait step: nothing prepared yet
    assert CuptiState.PAUSED in states[1:4]
    assert tr.cupti_status.state is CuptiState.RUNNING and fake.enabled
    assert tr.close().profiler_sessions == 1


def test_cpu_only_session_changes_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    tr, fake = _tracer(monkeypatch, tmp_path, RecordingPublisher())
    tr.start()
    with profile(activities=[ProfilerActivity.CPU]):
        assert tr.cupti_status.state is CuptiState.RUNNING and fake.enabled
    assert tr.close().profiler_sessions == 0


def test_overlapping_sessions_and_uninstall() -> None:
    events: list[str] = []
    guard = ProfilerGuard(lambda: events.append("pause"), lambda: events.append("resume"))
    assert guard.install()
    try:
        a, b = object(), object()
        guard._starting(a)
        guard._starting(a)  # prepare, then start: one session
        guard._starting(b)
        guard._stopped(a)
        assert events == ["pause"] and guard.active
        guard._stopped(b)
        assert events == ["pause", "resume"] and not guard.active and guard.sessions == 1
    finally:
        guard.uninstall()
    import torch.autograd.profiler as ap

    assert all(not hasattr(getattr(ap.profile, m), "__wrapped__") for m in ("_prepare_trace", "__exit__"))


def test_a_failing_pause_never_reaches_the_profiler() -> None:
    def boom() -> None:
        raise RuntimeError("CUPTI gone")

    guard = ProfilerGuard(boom, boom)
    guard.install()
    try:
        with profile(activities=[ProfilerActivity.CPU]):
            torch.ones(2) + 1
        guard._starting(object())  # forced start: the error is logged, not raised
    finally:
        guard.uninstall()
