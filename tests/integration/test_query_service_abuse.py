"""The query service of a real stack (`argus up`): ClickHouse clients get argus's tables read-only, and abuse
of the service (a whitespace bomb, slow-loris connections, a gigabyte result) is bounded while a job published
beside it is diagnosed through to ClickHouse."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import clickhouse_connect
import pytest

from argus.core.settings import Settings
from argus.sinks.findings_query import wait_diagnosed
from argus.sinks.query_server import service_credentials
from tests.integration.conftest import _free_port

pytestmark = pytest.mark.integration


def argus(env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "argus.cli", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def _get(port: int, path: str, headers: dict[str, str], data: bytes | None = None) -> tuple[int, bytes, float]:
    t0 = time.monotonic()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read(), time.monotonic() - t0
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), time.monotonic() - t0


def _simulate_and_wait(env: dict[str, str], settings: Settings, job: str) -> float:
    """Publish a simulated 8-rank job; seconds from its publication until it is diagnosed in ClickHouse."""
    sim = argus(env, "simulate", "--job", job, "--dp", "2", "--tp", "2", "--pp", "2", "--steps", "20",
                "--fault", "case1")
    assert sim.returncode == 0, sim.stderr
    published = time.monotonic()
    assert wait_diagnosed(settings, job, timeout_s=300), f"{job} not diagnosed within 300 s"
    return time.monotonic() - published


def _memory_kb(pid: int, field: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (peak) of ``pid`` in KiB, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for pid {pid}")


def test_clients_and_abuse_while_a_job_is_diagnosed(settings: Settings, tmp_path: Path) -> None:
    s = settings.replace(home=tmp_path / "home", query_port=_free_port(), worker_web_port=_free_port(),
                         query_service_port=_free_port(), sink_metrics_port=_free_port())
    env = {**os.environ, **s.to_env()}
    up = argus(env, "up")
    try:
        assert up.returncode == 0, up.stderr
        assert "query-service: healthy" in up.stderr
        port = s.query_service_port
        user, password = service_credentials(s)
        auth = {"X-ClickHouse-User": user, "X-ClickHouse-Key": password}
        db = s.clickhouse_database
        client = clickhouse_connect.get_client(host="127.0.0.1", port=port, username=user, password=password)
        names = {r[0] for r in client.query(f"SHOW TABLES FROM {db}").result_rows}
        assert {"steps", "findings", "jobs"} <= names
        assert client.query_arrow(f"SELECT job_id, step FROM {db}.steps LIMIT 3").column_names == ["job_id", "step"]
        assert list(client.query_df(f"SELECT count() AS n FROM {db}.findings").columns) == ["n"]
        for sql in (f"INSERT INTO {db}.steps SELECT * FROM {db}.steps", f"CREATE TABLE {db}.x (a Int8) ENGINE = Log",
                    f"DROP TABLE {db}.steps"):
            with pytest.raises(Exception, match="Code: 164"):
                client.command(sql)
        res = argus(env, "sql", f"SELECT count() AS n FROM {db}.jobs", "--json")
        assert res.returncode == 0 and "n" in json.loads(res.stdout)[0], res.stderr
        calm_s = _simulate_and_wait(env, s, "calm")  # the same job without abuse: the yardstick
        sink_pid = int(json.loads(argus(env, "status", "--json").stdout)["sink"]["pid"])
        rss_before = _memory_kb(sink_pid, "VmRSS")

        stop = threading.Event()
        figures: dict[str, list[float]] = {"bomb": [], "giga": [], "ping": [], "loris_cut": []}
        failures: list[str] = []

        def bomb() -> None:
            while not stop.is_set():
                status, body, took = _get(port, "/", auth, b"SELECT 1" + b" " * 200_000 + b"+ 1")
                if (status, body) != (200, b"2\n"):
                    failures.append(f"bomb: {status} {body[:200]!r}")
                figures["bomb"].append(took)

        def giga() -> None:
            while not stop.is_set():
                status, body, took = _get(port, "/?query=SELECT%20randomString(1000)%20FROM%20numbers(1000000)"
                                          "%20FORMAT%20RowBinary", auth)
                if status < 400 or b"Code: " not in body:
                    failures.append(f"giga: {status} {body[:200]!r}")
                figures["giga"].append(took)

        def loris() -> None:
            while not stop.is_set():
                socks = []
                for _ in range(60):
                    c = socket.create_connection(("127.0.0.1", port), timeout=60)
                    c.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nSELECT")
                    socks.append(c)
                t0 = time.monotonic()
                for c in socks:
                    if c.recv(100) != b"":
                        failures.append("loris: answered")
                    c.close()
                figures["loris_cut"].append(time.monotonic() - t0)

        def ping() -> None:
            while not stop.is_set():
                status, body, took = _get(port, "/ping", {})
                if (status, body) != (200, b"Ok.\n") or took > 5:
                    failures.append(f"ping: {status} {body!r} in {took:.1f} s")
                figures["ping"].append(took)
                time.sleep(0.5)

        threads = [threading.Thread(target=f, daemon=True) for f in (bomb, giga, loris, ping)]
        for t in threads:
            t.start()
        time.sleep(2)
        took = _simulate_and_wait(env, s, "abused")
        stop.set()
        for t in threads:
            t.join(150)
        peak_kb = _memory_kb(sink_pid, "VmHWM")
        summary = {k: (len(v), round(max(v, default=0), 2)) for k, v in figures.items()}
        sys.stderr.write(f"\nquery service: job diagnosed {calm_s:.1f} s after its publication without abuse, "
                         f"{took:.1f} s under abuse; (count, max s) per abuse: {summary}; sink RSS "
                         f"{rss_before // 1024} MB before, peak {peak_kb // 1024} MB\n")
        assert not failures, failures[:5]
        # Each abuse bounded (generous for a busy 2-core machine; before: 14 s for a 60 KB bomb, slow-loris forever).
        assert max(figures["bomb"]) < 10 and max(figures["giga"]) < 60 and max(figures["loris_cut"]) < 40, summary
        # A gigabyte asked for 30 times over never sat in the sink: its peak stays far below one.
        assert peak_kb - rss_before < 768 * 1024, (rss_before, peak_kb)
        assert all(figures[k] for k in figures), summary
        findings = argus(env, "findings", "--job", "abused", "--json")
        assert findings.returncode == 0 and json.loads(findings.stdout), findings.stderr
    finally:
        down = argus(env, "down", "--keep-kafka")
    assert down.returncode == 0, down.stderr
