"""A home's endpoints are the processes it announced: a client sends its token to no other process, whoever
took the port (issue: the token went to whoever answered on the query port, which could forge rows)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from argus.core.endpoints import announce, listens, verified_port, withdraw


def _listener() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def test_an_announced_listener_of_this_process_is_verified(tmp_path: Path) -> None:
    s = _listener()
    port = s.getsockname()[1]
    try:
        assert verified_port(tmp_path, "svc") is None  # nothing announced
        path = announce(tmp_path, "svc", port)
        assert path.stat().st_mode & 0o777 == 0o600
        assert verified_port(tmp_path, "svc") == port and listens(os.getpid(), port)
        announce(tmp_path, "svc", port + 1 if port < 65535 else port - 1)  # announced, but not listening there
        assert verified_port(tmp_path, "svc") is None
        announce(tmp_path, "svc", port)
        withdraw(tmp_path, "svc")
        assert verified_port(tmp_path, "svc") is None
    finally:
        s.close()


def test_a_port_held_by_another_process_is_not_this_homes(tmp_path: Path) -> None:
    squatter = subprocess.Popen([sys.executable, "-c", "import socket,sys,time\n"
                                 "s=socket.socket(); s.bind(('127.0.0.1',0)); s.listen()\n"
                                 "print(s.getsockname()[1], flush=True); time.sleep(60)"],
                                stdout=subprocess.PIPE, text=True)
    try:
        assert squatter.stdout is not None
        port = int(squatter.stdout.readline())
        announce(tmp_path, "svc", port)  # a stale announcement of ours: this process does not listen there
        assert not listens(os.getpid(), port) and listens(squatter.pid, port)
        assert verified_port(tmp_path, "svc") is None
    finally:
        squatter.kill()
        squatter.wait()


@pytest.mark.slow
def test_the_cli_sends_no_token_to_a_process_squatting_the_query_ports(tmp_path: Path) -> None:
    """Another user's process listens on the query service's and the backend's ports: argus sql in a home
    whose services are not running queries its own store and tells the squatter nothing."""
    seen: list[str] = []

    class Squatter(BaseHTTPRequestHandler):
        def _any(self) -> None:
            seen.append(f"{self.command} {self.path} {dict(self.headers)}")
            self.send_response(200)
            self.send_header("Content-Length", "4")
            self.end_headers()
            self.wfile.write(b"Ok.\n")

        def do_GET(self) -> None:
            self._any()

        def do_POST(self) -> None:
            self._any()

        def log_message(self, *args: object) -> None:
            pass

    servers = [HTTPServer(("127.0.0.1", 0), Squatter) for _ in range(2)]
    for srv in servers:
        threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        home = tmp_path / "home"
        home.mkdir(mode=0o700)
        (home / "query.token").write_text("secret-token")
        (home / "query.token").chmod(0o600)
        env = {**os.environ, "ARGUS_HOME": str(home), "ARGUS_QUERY_SERVICE_PORT": str(servers[0].server_port),
               "ARGUS_QUERY_PORT": str(servers[1].server_port)}
        proc = subprocess.run([sys.executable, "-m", "argus", "sql", "SELECT 40 + 2 AS answer"], env=env,
                              cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and "42" in proc.stdout, proc.stderr
        assert not any("secret-token" in s for s in seen), seen
    finally:
        for srv in servers:
            srv.shutdown()
            srv.server_close()
