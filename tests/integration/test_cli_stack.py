"""`argus up/status/sql/down` as a user runs them: background services, chDB owned by the sink, SQL through it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from argus.settings import Settings
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
        res = argus(env, "sql", f"SELECT name FROM system.tables WHERE database = '{settings.clickhouse_database}' "
                                "ORDER BY name", "--json")
        assert res.returncode == 0, res.stderr
        names = [r["name"] for r in json.loads(res.stdout)]
        assert {"steps", "phases", "kernel_summaries", "findings", "dead_letters"} <= set(names)
        bad = argus(env, "sql", "SELECT * FROM no_such_table")
        assert bad.returncode == 1 and "no_such_table" in bad.stderr.lower()
    finally:
        down = argus(env, "down", "--keep-kafka")
    assert down.returncode == 0, down.stderr
    status = argus(env, "status")
    assert status.returncode == 3 and "stopped" in status.stdout
    # With the sink gone, `argus sql` opens the embedded directory itself.
    res = argus(env, "sql", "SELECT count() AS n FROM system.databases", "--json")
    assert res.returncode == 0 and json.loads(res.stdout)[0]["n"] >= 1
