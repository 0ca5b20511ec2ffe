"""`argus up/status/sql/down` as a user runs them: background services, chDB owned by the sink, SQL through it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from argus.core.settings import Settings
from tests.integration.conftest import _free_port

pytestmark = pytest.mark.integration


def argus(env: dict[str, str], *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "argus.cli", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_up_sql_status_down(settings: Settings, tmp_path: Path) -> None:
    env = {**os.environ, **settings.replace(home=tmp_path / "home", query_port=_free_port(),
                                            worker_web_port=_free_port()).to_env()}
    up = argus(env, "up")
    try:
        assert up.returncode == 0, up.stderr
        assert "sink: healthy" in up.stderr and "worker: healthy" in up.stderr
        again = argus(env, "up")  # idempotent: reuses what runs
        assert again.returncode == 0 and "already running" in again.stderr
        status = argus(env, "status", "--json")
        assert status.returncode == 0, status.stdout + status.stderr
        doc = json.loads(status.stdout)
        assert doc["sink"]["healthy"] and doc["worker"]["healthy"] and doc["kafka"]["healthy"]
        # The sink owns the chDB directory; `argus sql` goes through its endpoint.
        res = argus(env, "sql", f"SHOW TABLES FROM {settings.clickhouse_database}", "--json")
        assert res.returncode == 0, res.stderr
        names = [r["name"] for r in json.loads(res.stdout)]
        assert {"steps", "phases", "kernel_summaries", "findings", "dead_letters"} <= set(names)
        bad = argus(env, "sql", "SELECT * FROM no_such_table")
        assert bad.returncode == 1 and "no_such_table" in bad.stderr.lower()
        unknown = argus(env, "findings", "--job", "no-such-job")  # asked through the query service
        assert unknown.returncode == 5 and "no job 'no-such-job'" in unknown.stderr, unknown.stderr
    finally:
        down = argus(env, "down", "--keep-kafka")
    assert down.returncode == 0, down.stderr
    status = argus(env, "status")
    assert status.returncode == 3 and "stopped" in status.stdout
    # With the sink gone, `argus sql` opens the embedded directory itself.
    res = argus(env, "sql", "SELECT count() AS n FROM system.databases", "--json")
    assert res.returncode == 0 and json.loads(res.stdout)[0]["n"] >= 1


def _processes_of(home: Path) -> dict[int, str]:
    """Our processes started for ``home`` (their environment names it): pid -> command line."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if f"ARGUS_HOME={home.resolve()}".encode() in environ and state != "Z" and "argus" in cmdline:
            found[int(proc.name)] = cmdline
    return found


def _wait(what: str, check: Callable[[], Any], timeout_s: float = 180) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"{what}: not within {timeout_s} s")


def _status(env: dict[str, str]) -> dict[str, Any]:
    res = argus(env, "status", "--json")
    doc: dict[str, Any] = json.loads(res.stdout)
    return doc


def test_supervisor_restarts_killed_services_and_down_leaves_no_orphans(settings: Settings, tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = {**os.environ, **settings.replace(home=home, query_port=_free_port(), worker_web_port=_free_port()).to_env(),
           "ARGUS_SUPERVISOR_BACKOFF_S": "0.2"}
    # Two `argus up` at once: one supervisor, one worker, one sink.
    ups = [subprocess.Popen([sys.executable, "-m", "argus.cli", "up"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        outs = [p.communicate(timeout=300) for p in ups]
        assert all(p.returncode == 0 for p in ups), outs
        procs = _processes_of(home)
        assert sum("argus.supervisor" in c and "--child" not in c for c in procs.values()) == 1, procs
        assert sum("--child worker" in c for c in procs.values()) == 1, procs
        assert sum("--child sink" in c for c in procs.values()) == 1, procs
        doc = _status(env)
        assert doc["supervisor"]["running"] and doc["kafka"]["state"] == "external"  # the session's broker
        assert doc["worker"]["restarts"] == 0 and doc["worker"]["last_exit"] is None

        # kill -9 of the worker and the sink: both come back without a user action, and status says so.
        old = {name: doc[name]["pid"] for name in ("worker", "sink")}
        for pid in old.values():
            os.kill(pid, signal.SIGKILL)

        def restarted() -> dict[str, Any] | None:
            d = _status(env)
            ok = all(d[n]["healthy"] and d[n]["restarts"] == 1 and d[n]["pid"] != old[n] for n in old)
            return d if ok else None

        doc = _wait("worker and sink restarted and healthy", restarted)
        for name in old:
            assert doc[name]["last_exit"]["signal"] == "SIGKILL" and doc[name]["state"] == "running"
            assert doc[name]["up_since"] and doc[name]["uptime_s"] >= 0
        text = argus(env, "status")
        assert text.returncode == 0 and "restarts=1" in text.stdout and "SIGKILL" in text.stdout

        # kill -9 of the supervisor: its children stop with it (the kernel's SIGTERM), `up` brings all back.
        token = (home / "query.token").read_text()
        os.kill(doc["supervisor"]["pid"], signal.SIGKILL)
        _wait("children gone with their supervisor", lambda: not _processes_of(home), timeout_s=120)
        again = argus(env, "up")
        assert again.returncode == 0, again.stderr
        assert "supervisor: started" in again.stderr
        # A stack started afresh takes a new token (the earlier run's may have leaked), and it works.
        assert (home / "query.token").read_text() != token
        assert argus(env, "sql", "SELECT 1").returncode == 0
    finally:
        down = argus(env, "down", "--keep-kafka")
    assert down.returncode == 0, down.stderr
    assert _processes_of(home) == {}  # no orphans
    doc = _status(env)
    assert not doc["supervisor"]["running"] and not doc["worker"]["running"] and not doc["sink"]["running"]
