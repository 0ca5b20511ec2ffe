"""The query service (ClickHouse's HTTP interface) in front of the sink's backend: real clients, refusals,
and abuse bounded while the sink goes on inserting.

The backend runs in a child process on its own chDB directory with an inserter thread standing in for the sink
(as in test_query_server); the query service runs in this process, as it runs beside the sink in the stack.
"""

from __future__ import annotations

import base64
import gzip
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import clickhouse_connect
import pytest

from argus.core.settings import Settings
from argus.sinks.query_server import service_credentials, service_query
from argus.sinks.query_service import QueryService
from tests.unit.test_query_server import _SERVER

pytestmark = pytest.mark.slow


@dataclass
class Stack:
    settings: Settings
    service: QueryService
    user: str
    password: str
    backend: subprocess.Popen[str]

    @property
    def port(self) -> int:
        return self.service.port

    def latencies(self) -> list[float]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.settings.query_port}/health", timeout=10) as r:
            import json

            return list(json.loads(r.read())["latencies"])

    def get(self, path: str, headers: dict[str, str] | None = None, data: bytes | None = None,
            timeout_s: float = 60) -> tuple[int, dict[str, str], bytes]:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                return r.status, dict(r.headers), r.read()
        except urllib.error.HTTPError as exc:
            return exc.code, dict(exc.headers), exc.read()

    def auth(self) -> dict[str, str]:
        return {"X-ClickHouse-User": self.user, "X-ClickHouse-Key": self.password}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    home = tmp_path_factory.mktemp("service-home")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-c", _SERVER, str(home)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.stdout is not None and proc.stdin is not None
    line = proc.stdout.readline()
    assert line.strip().isdigit(), f"backend did not start: {line!r}"
    settings = Settings.load(env={}, home=home, query_port=int(line), clickhouse_dsn=f"chdb://{home}/chdb")
    service = QueryService(settings, port=0, request_deadline_s=2.0)
    service.start()
    user, password = service_credentials(settings)
    yield Stack(settings, service, user, password, proc)
    service.stop()
    proc.stdin.close()
    proc.wait(30)


def test_ping_and_health(stack: Stack) -> None:
    assert stack.get("/ping")[::2] == (200, b"Ok.\n")
    assert stack.get("/")[::2] == (200, b"Ok.\n")
    status, _, body = stack.get("/health")
    assert status == 200 and b'"backend": "sink"' in body
    answer = _raw(stack.port, b"HEAD /ping HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200 OK") and answer.endswith(b"\r\n\r\n")  # headers only


def test_clickhouse_connect_query_arrow_and_df(stack: Stack) -> None:
    client = clickhouse_connect.get_client(host="127.0.0.1", port=stack.port, username=stack.user,
                                           password=stack.password)
    deadline = time.monotonic() + 30
    while not stack.latencies() and time.monotonic() < deadline:
        time.sleep(0.1)
    res = client.query("SELECT count() AS n, max(step) AS top FROM argus.steps WHERE job_id = {job:String}",
                       parameters={"job": "job"})
    assert res.column_names == ("n", "top") and res.result_rows[0][0] >= 1
    table = client.query_arrow("SELECT job_id, step FROM argus.steps ORDER BY step LIMIT 5")
    assert table.num_rows >= 1 and table.column_names == ["job_id", "step"]
    df = client.query_df("SELECT step, toString(step) AS s FROM argus.steps ORDER BY step LIMIT 3")
    assert list(df.columns) == ["step", "s"] and len(df) >= 1
    for sql in ("INSERT INTO argus.steps VALUES ('x', 0, 1, 0, 1, NULL)", "CREATE TABLE argus.x (a Int8) "
                "ENGINE = Memory", "DROP TABLE argus.steps", "SELECT * FROM file('/etc/passwd')"):
        with pytest.raises(Exception, match=r"Code: (164|497)"):
            client.query(sql)
    with pytest.raises(Exception, match=r"Code: 164"):
        client.command("DROP DATABASE argus")
    assert client.query("EXISTS TABLE argus.steps").result_rows == [(1,)]
    time.sleep(3)  # past the 2 s deadline: the service closed the pooled keep-alive connection
    assert client.query("SELECT 7").result_rows == [(7,)]
    client.close()


def test_raw_http_like_curl(stack: Stack) -> None:
    q = "/?query=SELECT%201%20AS%20x%20FORMAT%20JSONEachRow"
    status, headers, body = stack.get(q, stack.auth())
    assert status == 200 and body == b'{"x":1}\n'
    assert headers["X-ClickHouse-Format"] == "JSONEachRow" and headers["X-ClickHouse-Query-Id"]
    assert "read_rows" in headers["X-ClickHouse-Summary"]
    basic = base64.b64encode(f"{stack.user}:{stack.password}".encode()).decode()
    status, _, body = stack.get("/", {"Authorization": f"Basic {basic}"}, data=b"SELECT 2")
    assert (status, body) == (200, b"2\n")
    status, _, body = stack.get(f"/?user={stack.user}&password={stack.password}&query=SELECT%203&readonly=1")
    assert (status, body) == (200, b"3\n")
    status, _, body = stack.get("/?query=SELECT%203&max_execution_time=300&max_result_rows=0", stack.auth())
    assert (status, body) == (200, b"3\n")  # a limit named by the client: accepted, the service's own holds
    status, _, body = stack.get("/?query=SELECT%203&max_threads=64", stack.auth())
    assert (status, body) == (200, b"3\n")  # max_threads too: the service's 2 stay in force
    slow = "SELECT count() FROM numbers(100000000000) WHERE sipHash64(number) % 7 = 3"
    status, _, body = stack.get("/?max_execution_time=300", stack.auth(), data=slow.encode())
    assert status >= 400 and b"Code: 159" in body, body  # TIMEOUT_EXCEEDED at the backend's 3 s
    status, headers, body = stack.get("/?enable_http_compression=1&query=SELECT%204&database=argus",
                                      {**stack.auth(), "Accept-Encoding": "gzip"})
    assert status == 200 and headers["Content-Encoding"] == "gzip" and gzip.decompress(body) == b"4\n"
    # What clickhouse-go (Grafana's datasource, protocol http) sends: basic auth, Native by default, its timeout.
    status, headers, body = stack.get("/?database=argus&default_format=Native&max_execution_time=60",
                                      {"Authorization": f"Basic {basic}"}, data=b"SELECT timeZone()")
    assert status == 200 and headers["X-ClickHouse-Format"] == "Native" and body.endswith(b"UTC"), body
    # Refusals, ClickHouse-style.
    for path, headers_, code in (
            ("/?query=SELECT%201", {}, 516), ("/?query=SELECT%201", {**stack.auth(), "X-ClickHouse-Key": "x"}, 516),
            ("/?query=SELECT%201&readonly=0", stack.auth(), 164),
            ("/?query=SELECT%201&max_execution_time=1e9", stack.auth(), 164),
            ("/?query=SELECT%201&output_format_json_quote_64bit_integers=0", stack.auth(), 164),
            ("/?query=SELECT%201&compress=1", stack.auth(), 48),
            ("/?query=SELECT%20*%20FROM%20disks&database=system", stack.auth(), 164),
            ("/?query=SELECT%20path%20FROM%20system.disks", stack.auth(), 497),
            ("/?query=SELECT%201%20SETTINGS%20readonly%3D0", stack.auth(), 164),
            ("/?query=SELECT%201%20FORMAT%20Template", stack.auth(), 73),
            ("/?query=", stack.auth(), 62), ("/?query=SELECT%201", {"Authorization": "Basic !!"}, 516),
            ("/?query=SELECT%201", {**stack.auth(), "Content-Type": "multipart/form-data; boundary=x"}, 48),
            ("/?query=SELECT%201", {**stack.auth(), "Content-Encoding": "gzip"}, 48),
            ("/?query=SELECT%201", {**stack.auth(), "Origin": "http://evil.example"}, 497),
            # Native at a protocol revision: the embedded engine writes the plain one only (clickhouse-go asks).
            ("/?query=SELECT%201%20FORMAT%20Native&client_protocol_version=54460", stack.auth(), 48)):
        status, headers, body = stack.get(path, headers_)
        assert status >= 400 and headers["X-ClickHouse-Exception-Code"] == str(code), (path, status, body)
        assert body.startswith(f"Code: {code}. DB::Exception:".encode()), body
    at_service = stack.settings.replace(query_service_port=stack.port)
    assert service_query(at_service, "SELECT toUInt64(5) AS n").rows == [(5,)]


def _raw(port: int, request: bytes, timeout_s: float = 30) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return data


def _inserts_went_on(stack: Stack, before: int) -> None:
    """The sink's inserts (every 20 ms) went on during and after the abuse: a 2-core machine may slow them,
    never stop them."""
    time.sleep(1.0)
    during = stack.latencies()[before:]
    assert len(during) >= 10 and max(during) < 2.0, (len(during), max(during, default=None))


def test_whitespace_bomb_is_answered_fast(stack: Stack) -> None:
    before = len(stack.latencies())
    t0 = time.monotonic()
    status, _, body = stack.get("/", stack.auth(), data=b"SELECT 1" + b" " * 200_000 + b"+ 1")
    took = time.monotonic() - t0
    assert (status, body) == (200, b"2\n") and took < 5, took
    _inserts_went_on(stack, before)


def test_slow_loris_is_cut_and_ping_keeps_answering(stack: Stack) -> None:
    socks = []
    for _ in range(60):
        s = socket.create_connection(("127.0.0.1", stack.port), timeout=30)
        s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nSELECT")  # and nothing more
        socks.append(s)
    t0 = time.monotonic()
    assert stack.get("/ping", timeout_s=5)[::2] == (200, b"Ok.\n")
    assert stack.get("/?query=SELECT%201", stack.auth(), timeout_s=10)[::2] == (200, b"1\n")
    for s in socks:
        assert s.recv(100) == b""  # closed at the request's 2 s deadline
        s.close()
    assert time.monotonic() - t0 < 15


def test_connections_beyond_the_bound_are_refused_fast(stack: Stack) -> None:
    from argus.sinks import query_service

    socks = [socket.create_connection(("127.0.0.1", stack.port), timeout=30)
             for _ in range(query_service.MAX_CONNECTIONS)]
    try:
        time.sleep(0.5)
        t0 = time.monotonic()
        answer = _raw(stack.port, b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 503") and time.monotonic() - t0 < 2
    finally:
        for s in socks:
            s.close()
    deadline = time.monotonic() + 10
    while stack.get("/ping")[0] != 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert stack.get("/ping")[::2] == (200, b"Ok.\n")


def test_a_gigabyte_result_is_refused(stack: Stack) -> None:
    before = len(stack.latencies())
    t0 = time.monotonic()
    status, headers, body = stack.get("/?query=SELECT%20randomString(1000)%20FROM%20numbers(1000000)"
                                      "%20FORMAT%20RowBinary", {**stack.auth()})
    took = time.monotonic() - t0
    assert status >= 400 and headers["X-ClickHouse-Exception-Code"] in ("396", "241"), body[:300]
    assert took < 30
    _inserts_went_on(stack, before)
    # chDB keeps a failed query's partial output for the next query on its connection: never served.
    for _ in range(4):
        assert stack.get("/?query=SELECT%201%2B1", stack.auth())[::2] == (200, b"2\n")
    # Several at once: bounded by the slots, each refused, the service still answers.
    results: list[int] = []
    threads = [threading.Thread(target=lambda: results.append(stack.get(
        "/?query=SELECT%20randomString(1000)%20FROM%20numbers(1000000)", stack.auth())[0])) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 6 and all(s >= 400 for s in results)
    assert stack.get("/ping")[::2] == (200, b"Ok.\n")


def test_processes_starting_together_agree_on_one_token(tmp_path: Path) -> None:
    from argus.sinks.query_server import ensure_token

    settings = Settings.load(env={}, home=tmp_path / "home")
    tokens: list[str] = []
    threads = [threading.Thread(target=lambda: tokens.append(ensure_token(settings))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(tokens) == 8 and len(set(tokens)) == 1
    assert service_credentials(settings) == ("argus", tokens[0])
    assert sorted(p.name for p in (tmp_path / "home").iterdir()) == ["query.token"]


def test_settings_of_the_query_service(tmp_path: Path) -> None:
    from argus.core.errors import ConfigError

    s = Settings.load(env={})
    assert (s.query_service_host, s.query_service_port, s.query_user) == ("127.0.0.1", 18123, "argus")
    secret = tmp_path / "pw"
    secret.write_text("s3cret\n")
    s = Settings.load(env={"ARGUS_QUERY_PASSWORD_FILE": str(secret), "ARGUS_QUERY_SERVICE_PORT": "28123",
                           "ARGUS_QUERY_SERVICE_HOST": "0.0.0.0", "ARGUS_HOME": str(tmp_path)})
    assert service_credentials(s) == ("argus", "s3cret") and s.query_service_port == 28123
    assert not (tmp_path / "query.token").exists()  # a password set: no token needed
    for bad in ({"query_service_host": "a b"}, {"query_service_port": 70000}, {"query_user": "a:b"},
                {"query_user": ""}):
        with pytest.raises(ConfigError):
            Settings.load(env={}, **bad)
