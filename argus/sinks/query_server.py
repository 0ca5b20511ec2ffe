"""The sink's SQL backend: the one way into an embedded chDB directory that the sink process owns.

chDB allows one process per data directory, so the query service (:mod:`argus.sinks.query_service`, which
speaks ClickHouse's HTTP interface to clients) and ``argus sql`` in other processes cannot open it. The sink
serves them here, on ``127.0.0.1:<query_port>`` only, doing as little as it can per query so that no query
slows its ingestion: ``POST /query`` (body: one statement, UTF-8, ``Content-Type: application/sql``,
``Authorization: Bearer <token>``; ``X-Argus-Format``: the output format when the statement names none,
default ``TabSeparated``; ``X-Argus-Database``: the current database; ``param_<name>`` URL parameters: bound
values) answers the engine's bytes in that format as they are, and ``GET /health`` the sink's counters (JSON).
Errors are ClickHouse's: ``Code: N. DB::Exception: ...`` with ``X-ClickHouse-Exception-Code``.

It is read-only and bounded, whoever holds the token: see docs/query-service.md.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import os
import queue
import re
import secrets
import stat
import time
import urllib.error
import urllib.parse
import urllib.request
from http import HTTPStatus
from pathlib import Path
from typing import Any

from argus.core.endpoints import announce, verified_port, withdraw
from argus.core.errors import SinkError
from argus.core.settings import Settings
from argus.sinks.clickhouse import ClickHouseStore, QueryResult
from argus.sinks.clickhouse_http import (
    OUTPUT_FORMATS,
    TOO_MANY_ROWS_OR_BYTES,
    UNKNOWN_FORMAT,
    ClickHouseError,
    content_type,
    parse_json_compact,
)
from argus.sinks.http_serve import BoundedHttpServer, Request, Response
from argus.sinks.sql_guard import (
    REFUSED_FUNCTIONS,
    SAFE_TABLE_FUNCTIONS,
    StatementRefusedError,
    check_statement,
    prepare_statement,
)

__all__ = [
    "BACKEND_ENDPOINT",
    "MAX_RESULT_BYTES",
    "MAX_SQL_BYTES",
    "QUERY_LIMITS",
    "REFUSED_FUNCTIONS",
    "SERVICE_ENDPOINT",
    "QueryServer",
    "check_statement",
    "endpoint_healthy",
    "ensure_token",
    "post_query",
    "read_token",
    "rotate_token",
    "run_query",
    "service_credentials",
    "token_path",
]

#: Names under which the query service and the sink's backend announce themselves in the home
#: (:mod:`argus.core.endpoints`): clients send the token only to the process that announced.
SERVICE_ENDPOINT = "query-service"
BACKEND_ENDPOINT = "query-backend"

log = logging.getLogger(__name__)

#: Largest request body, bytes.
MAX_SQL_BYTES = 1_000_000
#: Largest answer, bytes (formatted); a larger result is refused (add a LIMIT).
MAX_RESULT_BYTES = 128 * 1024 * 1024
#: Seconds a client has to send a whole request.
REQUEST_DEADLINE_S = 10.0
#: Queries that run at once (each on its own read-only chDB connection).
MAX_CONCURRENT_QUERIES = 2
#: Connections open at once; more are refused at once.
MAX_CONNECTIONS = 64
#: ClickHouse settings of the query connections, applied before ``readonly=1`` (after which none can change):
#: ``max_execution_time`` in seconds (under :func:`run_query`'s 60 s client timeout), result rows and
#: uncompressed result bytes, the memory one query may use (bytes), and rows per block: the result limit is
#: checked block by block, so smaller blocks stop a huge result sooner (a gigabyte asked for is refused at
#: ~71 MB read instead of ~126 MB, and the engine's peak for it falls from ~480 to ~370 MB).
QUERY_LIMITS: dict[str, Any] = {
    "max_execution_time": 50,
    # One query takes a core or two at most, whatever the host has: the sink's inserts keep the rest.
    "max_threads": 2,
    "max_result_rows": 1_000_000,
    "max_result_bytes": 64 * 1024 * 1024,
    "result_overflow_mode": "throw",
    "max_memory_usage": 2 * 1024 * 1024 * 1024,
    "max_block_size": 8192,
}
_TOKEN_FILE = "query.token"
_CONTENT_TYPE = "application/sql"
_SETTING_VALUE = re.compile(r"[A-Za-z0-9_.]+")


def token_path(settings: Settings) -> Path:
    """The query endpoint's token file, ``<home>/query.token``."""
    return settings.home.resolve() / _TOKEN_FILE


def rotate_token(settings: Settings) -> None:
    """Drop the home's token, so the next :func:`ensure_token` (the starting sink or query service) makes a new
    one: a stack started afresh does not take the token of an earlier run, which may have leaked since.

    Raises:
        SinkError: the token file exists and cannot be removed.
    """
    try:
        token_path(settings).unlink(missing_ok=True)
    except OSError as exc:
        raise SinkError(f"cannot replace the query token {token_path(settings)}: {exc}") from exc


def ensure_token(settings: Settings) -> str:
    """The endpoint's bearer token, created (mode 0600, 32 random bytes) when the file is missing, empty,
    not the current user's or readable by others (then it may have leaked, so it is replaced).

    Raises:
        SinkError: the argus home or the token file cannot be written.
    """
    path = token_path(settings)
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = path.stat() if path.exists() else None
        if st is not None and st.st_uid == os.getuid() and not st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            token = path.read_text().strip()
            if len(token) >= 32:
                return token
        if st is not None:
            log.warning("replacing query token %s (not private to this user, or empty)", path)
        token = secrets.token_urlsafe(32)
        tmp = path.with_name(f".{_TOKEN_FILE}.{os.getpid()}.{secrets.token_hex(4)}")
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        if st is None:
            # Create only if still absent: the sink and the query service start together, and must agree.
            try:
                os.link(tmp, path)
            except FileExistsError:
                return ensure_token(settings)  # the other process's file, complete (linked once written)
            finally:
                tmp.unlink(missing_ok=True)
            return token
        os.replace(tmp, path)
        return token
    except OSError as exc:
        raise SinkError(f"cannot create the query token {path}: {exc}") from exc


def read_token(settings: Settings) -> str:
    """The token the running sink wrote to ``<home>/query.token``.

    Raises:
        SinkError: the file is missing or unreadable (is the sink running with the same ``ARGUS_HOME``?).
    """
    path = token_path(settings)
    try:
        return path.read_text().strip()
    except OSError as exc:
        raise SinkError(f"cannot read the query token {path} (the sink writes it; same ARGUS_HOME?): {exc}") from exc


class _Handle:
    """One read-only chDB connection of the sink's engine, and its current database."""

    def __init__(self, path: Path, limits: dict[str, Any], database: str) -> None:
        self.path, self.limits, self.default_database = path, limits, database
        self.conn: Any = None
        self.database = ""
        self._open()

    def _open(self) -> None:
        import chdb

        settings = {**self.limits, "readonly": 1}  # readonly last: once set, nothing else can change
        for name, value in settings.items():
            if not _SETTING_VALUE.fullmatch(str(value)):
                raise SinkError(f"query limit {name}={value!r} is not a plain value")
        conn = None
        try:
            conn = chdb.connect(str(self.path))
            for name, value in settings.items():
                conn.query(f"SET {name} = '{value}'" if isinstance(value, str) else f"SET {name} = {value}")
        except Exception as exc:
            if conn is not None:  # never left half set up (without readonly) for the next query
                with contextlib.suppress(Exception):
                    conn.close()
            raise SinkError(f"cannot open a read-only chDB connection: {exc}") from exc
        self.conn, self.database = conn, ""

    def discard(self) -> None:
        """Close the connection after a failed query; the next :meth:`run` opens a fresh one. chDB 4.4 keeps
        the output a query wrote before it failed (up to ``max_result_bytes``) and returns it ahead of the next
        answer on the same connection: another client's query would get it."""
        self.close()
        self.conn = None

    def run(self, sql: str, fmt: str, database: str | None, bound: dict[str, str]) -> Any:
        """The engine's result of ``sql`` (raises the engine's exception, or :class:`SinkError` when a fresh
        connection cannot be opened)."""
        if self.conn is None:
            self._open()
        want = database or self.default_database
        if want != self.database:
            self.conn.query(f"USE `{want.replace('`', '``')}`")
            self.database = want
        return self.conn.query(sql, fmt, params=bound) if bound else self.conn.query(sql, fmt)

    def close(self) -> None:
        try:
            if self.conn is not None:
                self.conn.close()
        except Exception as exc:
            log.debug("closing a chDB query connection: %s", exc)


class QueryServer:
    """The sink's backend on ``127.0.0.1:port`` (see the module's description), in a thread of its own.

    Args:
        store: the sink's store; for embedded chDB the server opens :data:`MAX_CONCURRENT_QUERIES` read-only
            connections of its engine. For a ClickHouse server it serves ``/health`` only (the query service
            and ``argus sql`` go to the server).
        settings: ``home`` (token file) and ``query_port``.
        health: extra fields of ``GET /health`` (the sink's counters), read at each request.
        port: overrides ``settings.query_port`` (0: any free port, see :attr:`port`).
        limits: overrides :data:`QUERY_LIMITS`.
        request_deadline_s: seconds a client has to send a whole request.

    Raises:
        SinkError: the token file or a read-only connection cannot be created.
        OSError: the port is taken.
    """

    def __init__(self, store: ClickHouseStore, settings: Settings, health: dict[str, Any] | None = None,
                 port: int | None = None, limits: dict[str, Any] | None = None,
                 request_deadline_s: float = REQUEST_DEADLINE_S) -> None:
        self.health = health if health is not None else {}
        self.settings = settings
        self.token = ensure_token(settings)
        self._handles: queue.Queue[_Handle] = queue.Queue()
        self.serves_queries = store.embedded and store.clickhouse.chdb_path is not None
        if self.serves_queries:
            path = store.clickhouse.chdb_path
            assert path is not None
            for _ in range(MAX_CONCURRENT_QUERIES):
                self._handles.put(_Handle(path, limits if limits is not None else QUERY_LIMITS, store.database))
        self.refused_functions = self._unknown_table_functions() if self.serves_queries else frozenset()
        self._http = BoundedHttpServer(
            "127.0.0.1", settings.query_port if port is None else port, self._handle, fast=self._fast,
            max_connections=MAX_CONNECTIONS, request_deadline_s=request_deadline_s, max_body_bytes=MAX_SQL_BYTES,
            workers=MAX_CONCURRENT_QUERIES, queue_wait_s=request_deadline_s, name="argus-query-backend")
        self.port = self._http.port
        self.allowed_hosts = frozenset({f"127.0.0.1:{self.port}", f"localhost:{self.port}"})

    def _unknown_table_functions(self) -> frozenset[str]:
        """Every table function this ClickHouse has beyond the safe ones: refused even if not listed here."""
        handle = self._handles.get()
        try:
            data = bytes(handle.run("SELECT name FROM system.table_functions", "TabSeparated", None, {}).bytes())
        except Exception as exc:
            log.warning("cannot list table functions (only the built-in list is refused): %s", exc)
            return frozenset()
        finally:
            self._handles.put(handle)
        return frozenset(data.decode().lower().split()) - SAFE_TABLE_FUNCTIONS

    def start(self) -> None:
        self._http.start()
        announce(self.settings.home, BACKEND_ENDPOINT, self.port)  # local clients send their token here only
        log.info("query backend on 127.0.0.1:%d", self.port)

    def stop(self) -> None:
        """Stop serving and close the read-only connections."""
        withdraw(self.settings.home, BACKEND_ENDPOINT)
        self._http.stop()
        while not self._handles.empty():
            self._handles.get_nowait().close()

    def _refusal(self, req: Request) -> tuple[int, str] | None:
        """Why a request from a browser page or another host is refused (None: it is not)."""
        if req.headers.get("host", "").lower() not in self.allowed_hosts:
            return HTTPStatus.FORBIDDEN, "Host must be the endpoint's own address"
        origin = req.headers.get("origin")
        if origin is not None and origin.lower() not in {f"http://{h}" for h in self.allowed_hosts}:
            return HTTPStatus.FORBIDDEN, "cross-origin requests are refused"
        return None

    def _fast(self, req: Request) -> Response | None:
        refusal = self._refusal(req)
        if refusal is None and req.method == "POST" and req.path == "/query":
            refusal = self._post_refusal(req)
            return None if refusal is None else _text(*refusal, close=True)
        if refusal is not None:
            return _text(*refusal, close=True)
        if req.method == "GET" and req.path == "/health":
            data = json.dumps({"ok": True, **self.health}, default=str).encode()
            return Response(HTTPStatus.OK, data, [("Content-Type", "application/json")])
        return _text(HTTPStatus.NOT_FOUND, "GET /health or POST /query")

    def _post_refusal(self, req: Request) -> tuple[int, str] | None:
        auth = req.headers.get("authorization", "").encode()
        if not hmac.compare_digest(auth, f"Bearer {self.token}".encode()):
            # The file may have been replaced since (found readable by others): its token is the one.
            with contextlib.suppress(SinkError):
                self.token = read_token(self.settings)
            if not hmac.compare_digest(auth, f"Bearer {self.token}".encode()):
                return HTTPStatus.UNAUTHORIZED, "a bearer token is required (see <ARGUS_HOME>/query.token)"
        ctype = req.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != _CONTENT_TYPE:
            return HTTPStatus.UNSUPPORTED_MEDIA_TYPE, f"Content-Type must be {_CONTENT_TYPE}"
        return None

    def _handle(self, req: Request) -> Response:
        """Check, normalize and run one statement on a free read-only connection (a worker thread)."""
        try:
            return self.query(req)
        except ClickHouseError as exc:
            return exc.response()

    def query(self, req: Request) -> Response:
        """The answer to ``POST /query``. Raises :class:`ClickHouseError`."""
        if not self.serves_queries:
            raise ClickHouseError(48, "this sink writes to a ClickHouse server: query the server itself")
        try:
            stmt = prepare_statement(req.body.decode("utf-8"), self.refused_functions)
        except UnicodeDecodeError:
            raise ClickHouseError(62, "SQL must be UTF-8", status=400) from None
        except StatementRefusedError as exc:
            raise ClickHouseError(exc.code, str(exc)) from exc
        fmt = stmt.format or req.headers.get("x-argus-format") or "TabSeparated"
        if fmt not in OUTPUT_FORMATS:
            raise ClickHouseError(UNKNOWN_FORMAT, f"Unknown or unserved output format {fmt[:40]!r}")
        bound = {k[len("param_"):]: v for k, v in req.params if k.startswith("param_")}
        handle = self._handles.get()  # a worker of the server holds at most one: never waits long
        try:
            return _run(handle, stmt.text, fmt, req.headers.get("x-argus-database"), bound)
        finally:
            self._handles.put(handle)


def _run(handle: _Handle, sql: str, fmt: str, database: str | None, bound: dict[str, str]) -> Response:
    """One statement on ``handle``: the engine's bytes with their format and summary."""
    t0 = time.monotonic_ns()
    try:
        res = handle.run(sql, fmt, database, bound)
    except Exception as exc:  # the engine's errors: ClickHouse's text, code included
        handle.discard()
        raise ClickHouseError.from_text(str(exc)) from exc
    size = res.size()
    if size > MAX_RESULT_BYTES:
        raise ClickHouseError(TOO_MANY_ROWS_OR_BYTES, f"answer of {size} bytes is over the {MAX_RESULT_BYTES} "
                              "served; add a LIMIT or aggregate")
    data = bytes(res.bytes())
    summary = {"read_rows": res.rows_read(), "read_bytes": res.bytes_read(), "result_bytes": len(data),
               "elapsed_ns": time.monotonic_ns() - t0}
    return Response(HTTPStatus.OK, data, [("Content-Type", content_type(fmt)), ("X-ClickHouse-Format", fmt),
                                          ("X-Argus-Summary", json.dumps(summary))])


def _text(status: int, message: str, close: bool = False) -> Response:
    return Response(status, message.encode() + b"\n", [("Content-Type", "text/plain; charset=UTF-8")], close)


def endpoint_healthy(settings: Settings, timeout_s: float = 1.0) -> dict[str, Any] | None:
    """The sink's health document, or None when no sink answers on the query port."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{settings.query_port}/health", timeout=timeout_s) as r:
            doc = json.loads(r.read())
            return doc if isinstance(doc, dict) else None
    except (OSError, ValueError):
        return None


def post_query(port: int, token: str, sql: str, timeout_s: float = 60.0) -> QueryResult:
    """Run ``sql`` through the sink's backend on ``127.0.0.1:port`` with ``token`` (answer in ``JSONCompact``).

    Raises:
        SinkError: the backend refused the request or the query, or did not answer in ``timeout_s``.
    """
    req = urllib.request.Request(f"http://127.0.0.1:{port}/query", data=sql.encode(), method="POST", headers={
        "Content-Type": _CONTENT_TYPE, "Authorization": f"Bearer {token}", "X-Argus-Format": "JSONCompact"})
    return _fetch_json(req, f"the sink's query backend on port {port}", timeout_s)


def _fetch_json(req: urllib.request.Request, what: str, timeout_s: float) -> QueryResult:
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return parse_json_compact(r.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode("utf-8", "replace").strip() or str(exc)
        raise SinkError(detail) from exc
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SinkError(f"{what} failed: {exc}") from exc


def service_credentials(settings: Settings, create: bool = False) -> tuple[str, str]:
    """(user, password) of the query service: ``query_user`` and ``query_password``, or the per-home token
    (``<home>/query.token``; ``create``: made when missing, as the service does) when no password is set.

    Raises:
        SinkError: no password is set and the token cannot be read (or created).
    """
    password = settings.query_password.reveal()
    if password:
        return settings.query_user, password
    return settings.query_user, ensure_token(settings) if create else read_token(settings)


def service_address(settings: Settings) -> tuple[str, int]:
    """Where a client on this host reaches the query service (a wildcard bind address is reached on loopback)."""
    host = settings.query_service_host
    return ("127.0.0.1" if host in ("0.0.0.0", "::", "") else host), settings.query_service_port


def service_healthy(settings: Settings, timeout_s: float = 1.0) -> bool:
    """Whether the query service answers ``GET /ping`` with ``Ok.``."""
    host, port = service_address(settings)
    try:
        with urllib.request.urlopen(f"http://{_url_host(host)}:{port}/ping", timeout=timeout_s) as r:
            return bool(r.read(16) == b"Ok.\n")
    except (OSError, ValueError):
        return False


def service_query(settings: Settings, sql: str, timeout_s: float = 60.0, port: int | None = None) -> QueryResult:
    """Run ``sql`` through the query service (ClickHouse's HTTP interface, ``JSONCompact``) on ``port``
    (default the configured one).

    Raises:
        SinkError: the service refused the request or the query, or did not answer in ``timeout_s``.
    """
    host, configured = service_address(settings)
    port = configured if port is None else port
    user, password = service_credentials(settings)
    url = f"http://{_url_host(host)}:{port}/?" + urllib.parse.urlencode(
        {"default_format": "JSONCompact", "database": settings.clickhouse_database})
    req = urllib.request.Request(url, data=sql.encode(), method="POST", headers={
        "X-ClickHouse-User": user, "X-ClickHouse-Key": password, "Content-Type": "text/plain; charset=UTF-8"})
    return _fetch_json(req, f"the query service on {host}:{port}", timeout_s)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def run_query(settings: Settings, sql: str, timeout_s: float = 60.0) -> QueryResult:
    """Run ``sql`` against the configured ClickHouse from any process.

    Through the query service when it runs (read-only); else, for embedded chDB, through the sink's backend
    when a sink runs (read-only, with the token from ``<home>/query.token``) or by opening the directory
    directly (as its owner: any statement); for a server DSN, on the server directly.

    Raises:
        SinkError: the query failed, or the store cannot be reached.
    """
    # Only to a process this home announced and that listens there: never a token to whoever took the port.
    service_port = verified_port(settings.home, SERVICE_ENDPOINT)
    if service_port is not None:
        return service_query(settings, sql, timeout_s, port=service_port)
    backend_port = verified_port(settings.home, BACKEND_ENDPOINT) if settings.chdb_path is not None else None
    if backend_port is not None:
        return post_query(backend_port, read_token(settings), sql, timeout_s)
    store = ClickHouseStore(settings.clickhouse)
    try:
        store.ensure_schema()
        return store.query(sql)
    finally:
        store.close()
