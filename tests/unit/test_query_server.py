"""The sink's SQL endpoint: only the local user with the token, only read-only statements, bounded.

chDB allows one data directory per process (and the integration session keeps its own open), so the endpoint
under test runs in a child process on its own directory, with an inserter thread standing in for the sink.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from argus.core.errors import SinkError
from argus.core.settings import Settings
from argus.sinks.query_server import check_statement, post_query, read_token, token_path

pytestmark = pytest.mark.slow

_SERVER = r"""
import sys, threading, time
from pathlib import Path
import argus.sinks.query_server as qs
from argus.core.settings import Settings
from argus.sinks.clickhouse import ClickHouseStore
from argus.sinks.tables import TABLES

home = Path(sys.argv[1])
settings = Settings.load(env={}, home=home, clickhouse_dsn=f"chdb://{home}/chdb")
store = ClickHouseStore(settings.clickhouse)
store.ensure_schema()
health = {"latencies": []}
server = qs.QueryServer(store, settings, health, port=0, request_deadline_s=1.0,  # short for the test
                        limits={**qs.QUERY_LIMITS, "max_execution_time": 3, "max_result_rows": 10_000})
stop = threading.Event()

def insert() -> None:  # the sink's inserts, on the sink's own connection
    step = 0
    while not stop.is_set():
        t = time.monotonic()
        store.insert(TABLES["steps"], [("job", 0, step, 0, 1, None)])
        health["latencies"] = [*health["latencies"][-500:], time.monotonic() - t]
        step += 1
        time.sleep(0.02)

threading.Thread(target=insert, daemon=True).start()
server.start()
print(server.port, flush=True)
sys.stdin.read()
stop.set()
server.stop()
store.close()
"""


@dataclass
class Endpoint:
    port: int
    token: str
    home: Path

    def health(self) -> dict[str, object]:
        status, body = raw(self.port, f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\n\r\n".encode())
        assert status == 200
        doc = json.loads(body)
        assert isinstance(doc, dict)
        return doc

    def post(self, sql: str | bytes, headers: dict[str, str] | None = None) -> tuple[int, str]:
        body = sql.encode() if isinstance(sql, str) else sql
        base = {"Host": f"127.0.0.1:{self.port}", "Authorization": f"Bearer {self.token}",
                "Content-Type": "application/sql", "Content-Length": str(len(body))}
        merged = {k: v for k, v in {**base, **(headers or {})}.items() if v}
        head = "".join(f"{k}: {v}\r\n" for k, v in merged.items())
        return raw(self.port, f"POST /query HTTP/1.1\r\n{head}\r\n".encode() + body)


def raw(port: int, request: bytes, timeout_s: float = 30) -> tuple[int, str]:
    """Send ``request`` as it is; (status, body) of the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode()


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Endpoint]:
    home = tmp_path_factory.mktemp("query-home")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-c", _SERVER, str(home)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.stdout is not None and proc.stdin is not None
    line = proc.stdout.readline()
    assert line.strip().isdigit(), f"query server did not start: {line!r}"
    settings = Settings.load(env={}, home=home)
    yield Endpoint(int(line), read_token(settings), home)
    proc.stdin.close()
    proc.wait(30)


def test_token_file_is_private(endpoint: Endpoint) -> None:
    path = token_path(Settings.load(env={}, home=endpoint.home))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(endpoint.token) >= 32


def test_select_with_token_works(endpoint: Endpoint) -> None:
    deadline = time.monotonic() + 30
    while not endpoint.health()["latencies"] and time.monotonic() < deadline:
        time.sleep(0.1)
    res = post_query(endpoint.port, endpoint.token, "SELECT toUInt8(count() > 0) AS ok FROM argus.steps")
    assert res.columns == ("ok",) and res.rows == [(1,)]  # the reader sees what the sink inserted
    for sql in ("WITH 2 AS x SELECT x", "SHOW TABLES FROM argus", "DESCRIBE TABLE argus.steps",
                "EXPLAIN SELECT 1", "EXISTS TABLE argus.steps", "select 1 -- a comment;\n;",
                "SELECT count() FROM numbers(10)", "SELECT 'file(x)', \"job_id\" FROM argus.steps LIMIT 1"):
        post_query(endpoint.port, endpoint.token, sql)


def test_without_the_token_nothing_runs(endpoint: Endpoint) -> None:
    assert endpoint.post("SELECT 1", {"Authorization": ""})[0] == 401
    assert endpoint.post("SELECT 1", {"Authorization": "Bearer " + "x" * 43})[0] == 401
    with pytest.raises(SinkError, match="token"):
        post_query(endpoint.port, "wrong", "SELECT 1")


def test_cross_origin_browser_post_is_refused(endpoint: Endpoint) -> None:
    # What a web page can send without a preflight: text/plain, no token, its own Origin.
    status, _ = endpoint.post("DROP DATABASE argus", {"Authorization": "", "Content-Type": "text/plain",
                                                      "Origin": "http://evil.example"})
    assert status == 403
    assert endpoint.post("SELECT 1", {"Origin": "http://evil.example"})[0] == 403
    assert endpoint.post("SELECT 1", {"Origin": "null"})[0] == 403
    assert endpoint.post("SELECT 1", {"Content-Type": "text/plain"})[0] == 415
    assert endpoint.post("SELECT 1", {"Content-Type": "application/x-www-form-urlencoded"})[0] == 415
    assert endpoint.post("SELECT 1", {"Origin": f"http://127.0.0.1:{endpoint.port}"})[0] == 200
    assert post_query(endpoint.port, endpoint.token, "EXISTS DATABASE argus").rows == [(1,)]


def test_foreign_host_header_is_refused(endpoint: Endpoint) -> None:
    # DNS rebinding: a page on evil.example whose name now resolves to 127.0.0.1.
    assert endpoint.post("SELECT 1", {"Host": f"evil.example:{endpoint.port}"})[0] == 403
    assert endpoint.post("SELECT 1", {"Host": "127.0.0.1"})[0] == 403
    status, _ = raw(endpoint.port, b"GET /health HTTP/1.1\r\nHost: evil.example\r\n\r\n")
    assert status == 403


@pytest.mark.parametrize("sql", [
    "DROP DATABASE argus",
    "drop table argus.steps",
    "SELECT * FROM file('/etc/passwd', 'LineAsString')",
    "SELECT file('/etc/passwd')",
    "SELECT * FROM `file`('/etc/passwd')",
    "SELECT * FROM FiLe /* hidden */ ('/etc/passwd')",
    "INSERT INTO FUNCTION file('/tmp/argus-pwned.csv', 'CSV') SELECT 1",
    "SELECT 1 INTO OUTFILE '/tmp/argus-pwned.txt'",
    "SELECT 1; DROP DATABASE argus",
    "SELECT * FROM url('http://127.0.0.1:1/', 'CSV')",
    "SELECT * FROM remote('127.0.0.1', system.one)",
    "SELECT * FROM python(store)",
    "SELECT 1 SETTINGS readonly = 0",
    "SELECT 1 # comment",
    "SELECT $$x$$",
    "OPTIMIZE TABLE argus.steps FINAL",
    "SYSTEM SHUTDOWN",
])
def test_dangerous_statements_are_refused(endpoint: Endpoint, sql: str) -> None:
    with pytest.raises(SinkError):
        post_query(endpoint.port, endpoint.token, sql)
    assert not Path("/tmp/argus-pwned.csv").exists() and not Path("/tmp/argus-pwned.txt").exists()
    assert post_query(endpoint.port, endpoint.token, "EXISTS TABLE argus.steps").rows == [(1,)]


def test_content_length_must_be_a_bounded_non_negative_integer(endpoint: Endpoint) -> None:
    assert endpoint.post("SELECT 1", {"Content-Length": "-1"})[0] == 411
    assert endpoint.post("SELECT 1", {"Content-Length": "1e3"})[0] == 411
    assert endpoint.post("SELECT 1", {"Content-Length": ""})[0] == 411
    assert endpoint.post("SELECT 1", {"Content-Length": "2000000"})[0] == 413
    assert endpoint.post("SELECT 1", {"Transfer-Encoding": "chunked"})[0] == 411
    assert endpoint.post(b"SELECT '\xff'")[0] == 400


def test_a_stalled_client_is_cut_off(endpoint: Endpoint) -> None:
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", endpoint.port), timeout=30) as s:
        s.sendall(b"POST /query HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and nothing more
        assert s.recv(100) == b""  # closed by the server's socket timeout
    assert time.monotonic() - t0 < 10


def test_results_and_run_time_are_bounded_and_inserts_go_on(endpoint: Endpoint) -> None:
    with pytest.raises(SinkError, match=r"(?i)limit|rows"):
        post_query(endpoint.port, endpoint.token, "SELECT number FROM numbers(100000)")
    before = len(endpoint.health()["latencies"])  # type: ignore[arg-type]
    t0 = time.monotonic()
    with pytest.raises(SinkError, match=r"(?i)timeout"):
        post_query(endpoint.port, endpoint.token,
                   "SELECT count() FROM numbers(100000000000) WHERE sipHash64(number) % 7 = 3")
    took = time.monotonic() - t0
    assert 2.5 < took < 20
    latencies = endpoint.health()["latencies"]
    assert isinstance(latencies, list)
    during = latencies[before:]
    # The sink kept inserting while the query ran (every 20 ms; 2 busy cores may slow, never stop it).
    assert len(during) >= 10 and max(during) < 2.0, (len(during), max(during, default=None))


def test_statement_guard_examples() -> None:
    for ok in ("SELECT 1", "  with x as (select 1) select * from x", "DESC argus.steps", "SELECT 'a''b\\'c'",
               "SELECT url FROM t", "SELECT 1;", "SELECT `input` FROM t", "SELECT count() FROM numbers(3)"):
        check_statement(ok)
    for bad in ("", ";", "(SELECT 1)", "SELECT 'x", "SELECT /* a", "SELECT /* /* */ file('x') */",
                "SELECT \"fi\\x6ce\"('x')", "SELECT 1 --x\rFROM file('x')", "SELECT s3Cluster('a')",
                "SELECT 1\x00", "INSERT INTO t VALUES (1)", "SELECT 1 INTO outfile 'x'", "SELECT x FROM newFn('a')"):
        with pytest.raises(SinkError):
            check_statement(bad, refused_functions={"newfn"})
