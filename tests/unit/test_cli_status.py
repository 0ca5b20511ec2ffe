"""``argus status`` lists the jobs a worker holds state for."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from argus.cli import _out_jobs
from argus.core.settings import Settings
from argus.stack import Stack


def test_jobs_table(capsys: pytest.CaptureFixture[str]) -> None:
    jobs = [{"job": f"j{i}", "state": "open", "age_s": 12.3 + i, "idle_s": 1.0, "last_step": i, "held_messages": 40}
            for i in range(3)]
    _out_jobs({"open_jobs": 3, "held_messages": 120, "jobs_abandoned": 1, "jobs_diagnosed": 5, "jobs": jobs},
              limit=2)
    out = capsys.readouterr().out
    assert "open=3" in out and "held messages=120" in out and "abandoned=1" in out
    assert "j0" in out and "j1" in out and "j2" not in out and "1 more" in out
    assert "age_s" in out and "last_step" in out


def test_no_worker_stats_prints_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    _out_jobs(None)
    _out_jobs({"open_jobs": 0, "held_messages": 0})
    out = capsys.readouterr().out
    assert out.count("open=0") == 1 and "job " not in out


def test_status_of_a_fresh_home_ignores_another_homes_processes(tmp_path: Path) -> None:
    """A worker of another home answers /health on the shared port: it is not this home's, so not healthy."""

    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b'{"status": "ok"}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        settings = Settings.load(env={}, home=tmp_path / "fresh", worker_web_port=port,
                                 bootstrap_servers="127.0.0.1:1")
        worker = Stack(settings).status()["worker"]
        assert worker["foreign"] and not worker["healthy"] and not worker["running"]
        assert worker["stats"] is None
    finally:
        server.shutdown()
        server.server_close()
