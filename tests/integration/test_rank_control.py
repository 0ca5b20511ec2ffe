"""Control without a restart on the local stack: a real gloo job (3 ranks, the fake CUPTI of ``tests/fake_cupti``
making kernel records) is told through ``argus control`` to pause rank 1's kernel records and later to resume
them. Rank 1 acknowledges both in its heartbeats, its kernel records stop and start while its steps and the
other ranks' kernels go on, the diagnosis raises nothing from the gap, and ``argus findings`` says when rank 1's
kernels were paused.

Every wait is on something the job says (heartbeats, records), never on a sleep's luck on a busy machine.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer

from argus.cli import main
from argus.core.settings import Settings
from argus.schemas.records import KernelBatch
from argus.sinks.findings_query import fetch_findings, wait_diagnosed
from argus.sinks.kernel_pauses import kernel_pauses
from argus.topics import Topic
from tests.integration.conftest import SinkThread, WorkerProcess
from tests.integration.ranks import ROOT, run_ranks

pytestmark = pytest.mark.integration
torch = pytest.importorskip("torch", reason="torch is a test dependency (extra 'rank'); CI installs it")

WORLD, PAUSED, JOB = 3, 1, "ctl"
#: How long the pause lasts at least, in event time seconds: several 1-s windows.
PAUSE_S = 4.0


def _wait(what: str, fn: Any, timeout_s: float = 120, every_s: float = 0.3) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def _control(settings: Settings, capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """Run ``argus control`` (as the CLI does, with the test's settings in the environment); the command id."""
    with pytest.MonkeyPatch.context() as mp:
        for k, v in settings.to_env().items():
            mp.setenv(k, v)
        assert main(["control", "--job", JOB, *args]) == 0
    out = capsys.readouterr().out
    return out.split("control ", 1)[1].split(":", 1)[0]


def _kernel_starts(settings: Settings) -> dict[int, list[int]]:
    """Per rank, the start times of every kernel record the job published (the kernels topic, from the start)."""
    consumer = Consumer({"bootstrap.servers": settings.bootstrap_servers, "group.id": f"{settings.app_id}-k",
                         "auto.offset.reset": "earliest", "enable.auto.commit": False})
    out: dict[int, list[int]] = {}
    ended: set[int] = set()
    try:
        consumer.subscribe([Topic.KERNELS.full(settings)])
        deadline = time.monotonic() + 90
        while len(ended) < WORLD and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None or msg.error() is not None:
                continue
            if not (msg.key() or b"").startswith(f"{JOB}/".encode()):
                continue
            try:
                b = KernelBatch.decode(msg.value() or b"")
            except Exception:  # the worker's job-end markers
                continue
            out.setdefault(b.rank, []).extend(int(t) for t in b.start_ns)
            if b.end_of_stream:
                ended.add(b.rank)
    finally:
        consumer.close()
    assert len(ended) == WORLD, f"end_of_stream from ranks {sorted(ended)} only"
    return {r: sorted(ts) for r, ts in out.items()}


def test_gloo_job_paused_and_resumed_mid_run(settings: Settings, worker: WorkerProcess, sink: SinkThread,
                                             tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stop = tmp_path / "stop"
    failure: list[BaseException] = []

    def job() -> None:
        try:
            run_ranks(ROOT / "tests" / "integration" / "control_job.py",
                      ["--job", JOB, "--stop-file", str(stop)], world=WORLD, settings=settings, log_dir=tmp_path,
                      extra_env={"PYTHONPATH": f"{ROOT}:{ROOT / 'tests' / 'fake_cupti'}",
                                 "ARGUS_HEARTBEAT_INTERVAL_S": "0.5", "ARGUS_CONTROL_POLL_S": "0.2"})
        except BaseException as exc:
            failure.append(exc)

    runner = threading.Thread(target=job, daemon=True)
    runner.start()
    try:
        hb = "SELECT {cols} FROM {{db}}.heartbeats FINAL WHERE job_id = 'ctl' AND rank = 1 {cond}"
        _wait("rank 1 at step 10", lambda: sink.scalar(hb.format(cols="max(step)", cond="")) >= 10)
        pause_id = _control(settings, capsys, "--ranks", str(PAUSED), "pause-kernels")
        paused_at = _wait("rank 1 acknowledging the pause", lambda: sink.scalar(hb.format(
            cols="min(time_ns)", cond=f"AND control_ack = '{pause_id}' AND kernels_paused = 1")))
        step_paused = sink.scalar(hb.format(cols="max(step)", cond=""))
        # The pause holds while the job runs on: PAUSE_S of heartbeats, and steps.
        _wait("the pause to last", lambda: sink.scalar(hb.format(
            cols="max(time_ns)", cond="AND kernels_paused = 1")) - paused_at >= PAUSE_S * 1e9)
        assert sink.scalar(hb.format(cols="max(step)", cond="")) > step_paused  # steps went on
        resume_id = _control(settings, capsys, "--ranks", str(PAUSED), "resume-kernels")
        resumed_at = _wait("rank 1 acknowledging the resume", lambda: sink.scalar(hb.format(
            cols="min(time_ns)", cond=f"AND control_ack = '{resume_id}' AND kernels_paused = 0")))
        step_resumed = sink.scalar(hb.format(cols="max(step)", cond=""))
        _wait("10 steps after the resume", lambda: sink.scalar(hb.format(cols="max(step)", cond="")) >=
              step_resumed + 10)
    finally:
        stop.touch()
        runner.join(300)
    assert not failure, failure
    assert not runner.is_alive()
    assert wait_diagnosed(settings, JOB, 120, query=sink.store.query)

    starts = _kernel_starts(settings)
    last_before = max(t for t in starts[PAUSED] if t < paused_at)
    first_after = min(t for t in starts[PAUSED] if t > last_before)
    # Rank 1's kernel records stop by the time it says it paused, and start again by the time it says it resumed;
    # the others' go on throughout.
    assert first_after - last_before >= PAUSE_S * 1e9, (last_before, first_after)
    assert first_after <= resumed_at + 2e9 and any(t > resumed_at for t in starts[PAUSED])
    for r in set(range(WORLD)) - {PAUSED}:
        inside = [t for t in starts[r] if paused_at < t < paused_at + PAUSE_S * 1e9]
        assert len(inside) > 20, (r, len(inside))

    findings = fetch_findings(settings, JOB, query=sink.store.query)
    assert not [f for f in findings if f["level"] == "L3"], findings  # nothing from the gap
    spans = kernel_pauses(settings, JOB, query=sink.store.query)
    assert [(s.rank, s.reasons, s.open) for s in spans] == [(PAUSED, "CONTROL", False)], spans
    assert spans[0].start_ns == paused_at and spans[0].end_ns == resumed_at
