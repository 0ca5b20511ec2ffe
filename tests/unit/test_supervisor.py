"""The supervisor's restart policy and state file, without processes (see tests/integration/test_cli_stack.py
and tests/faults for the real thing)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

from argus.core.settings import Settings
from argus.supervisor import STATE_FILE, Supervisor, read_state


def _supervisor(tmp_path: Path) -> Supervisor:
    settings = Settings.load(env={}, home=tmp_path, supervisor_backoff_s=0.5, supervisor_backoff_max_s=4.0)
    sup = Supervisor(settings)
    sup.run_dir.mkdir(parents=True)
    return sup


def test_backoff_doubles_on_quick_crashes_and_resets_after_a_stable_run(tmp_path: Path) -> None:
    sup = _supervisor(tmp_path)
    delays = []
    for _ in range(5):
        sup._started("worker", 100)
        sup._exited("worker", -signal.SIGKILL)
        delays.append(sup.states["worker"].backoff_s)
    assert delays == [0.5, 1.0, 2.0, 4.0, 4.0]  # capped at supervisor_backoff_max_s
    state = sup.states["worker"]
    assert state.restarts == 4 and state.state == "backoff" and state.pid is None
    assert state.last_exit is not None and state.last_exit["signal"] == "SIGKILL"
    # A process that ran for 4x the longest backoff crashed once: the next restart comes soon again.
    sup._started("worker", 101)
    state.up_since = (state.up_since or 0) - 4 * 4.0
    sup._exited("worker", 1)
    assert state.backoff_s == 0.5 and state.last_exit is not None
    assert state.last_exit["code"] == 1 and state.last_exit["signal"] is None and state.restarts == 5


def test_state_file_is_what_status_reads(tmp_path: Path) -> None:
    sup = _supervisor(tmp_path)
    sup._started("sink", 42)
    sup._write_state()
    doc = read_state(sup.run_dir)
    assert doc is not None and doc == json.loads((sup.run_dir / STATE_FILE).read_text())
    assert doc["services"]["sink"]["pid"] == 42 and doc["services"]["sink"]["state"] == "running"
    assert set(doc["services"]) == {"kafka", "worker", "sink", "query-service"}
    assert read_state(tmp_path / "nowhere") is None


def test_a_process_that_stops_answering_its_health_check_is_killed_as_hung(tmp_path: Path) -> None:
    import subprocess
    import sys

    from argus.supervisor import Service

    answers = iter([False, True, True, False, False, False])  # starting, healthy, then hung
    probed: list[str] = []

    def probe(url: str) -> bool:
        probed.append(url)
        return next(answers)

    settings = Settings.load(env={}, home=tmp_path, supervisor_hang_s=60.0, worker_web_port=18999)
    sup = Supervisor(settings, probe=probe)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        sup._check_hung(Service.WORKER, proc, now=0.0)  # not healthy yet: still starting, never killed
        sup._check_hung(Service.WORKER, proc, now=1.0)  # probed at most every few seconds
        for t in (10.0, 20.0, 30.0, 70.0, 72.0):  # 72: within the probe interval, not probed
            sup._check_hung(Service.WORKER, proc, now=t)
            assert sup.states["worker"].hang_kills == 0  # last pass at 20 s: failing for < 60 s
        sup._check_hung(Service.WORKER, proc, now=85.0)
        assert proc.wait(10) == -signal.SIGKILL
        assert sup.states["worker"].hang_kills == 1
        assert probed[0] == "http://127.0.0.1:18999/health" and len(probed) == 6
    finally:
        proc.kill()
