"""The query service: argus's tables over ClickHouse's HTTP interface, read-only, in a process of its own.

``argus query-service`` (supervised by ``argus up``) listens on ``query_service_host:query_service_port``
(default ``127.0.0.1:18123``) and answers what ClickHouse clients send (clickhouse-connect's ``query``,
``query_arrow`` and ``query_df``, curl, Grafana's datasource over HTTP; see :mod:`argus.sinks.clickhouse_http`):
``GET /ping`` and ``GET /`` answer ``Ok.``, ``GET /health`` JSON, ``GET|POST /`` (or ``/query``) one statement.
Clients log in as ``query_user`` (default ``argus``) with ``query_password``, or with the per-home token
(``<home>/query.token``) when no password is set, which is how ``argus sql`` and ``argus findings`` use it.

Details and reasoning: docs/query-service.md.
"""

from __future__ import annotations

import hmac
import http.client
import json
import logging
import threading
import urllib.parse
import uuid
from http import HTTPStatus
from typing import Any

from argus.core.endpoints import announce, withdraw
from argus.core.errors import SinkError
from argus.core.settings import Settings
from argus.sinks.clickhouse_http import (
    ACCESS_DENIED,
    AUTHENTICATION_FAILED,
    NETWORK_ERROR,
    NOT_IMPLEMENTED,
    OUTPUT_FORMATS,
    TOO_MANY_ROWS_OR_BYTES,
    UNKNOWN_FORMAT,
    ClickHouseError,
    QueryRequest,
    parse_query_request,
    result_response,
)
from argus.sinks.http_serve import BoundedHttpServer, Request, Response
from argus.sinks.query_server import (
    MAX_RESULT_BYTES,
    MAX_SQL_BYTES,
    QUERY_LIMITS,
    REQUEST_DEADLINE_S,
    SERVICE_ENDPOINT,
    read_token,
    service_credentials,
)
from argus.sinks.sql_guard import Statement, StatementRefusedError, prepare_statement

__all__ = ["MAX_CONNECTIONS", "QueryService", "serve_query_service"]

log = logging.getLogger(__name__)

#: Connections open at once (coroutines: stalled clients cost no thread); more are answered 503 at once.
MAX_CONNECTIONS = 256
#: Statements forwarded at once; more wait for a slot within their request's deadline, then get 503.
MAX_CONCURRENT_QUERIES = 4
#: Seconds to wait for the upstream's answer beyond the statement's ``max_execution_time``.
_UPSTREAM_GRACE_S = 15.0


class QueryService:
    """The query service's server (see the module's description), in a thread of its own.

    Args:
        settings: the address (``query_service_host``/``query_service_port``), the credentials, and where the
            tables are (``clickhouse_dsn``; for embedded chDB the sink's backend on ``query_port``).
        port: overrides ``query_service_port`` (0: any free port, see :attr:`port`).
        request_deadline_s: seconds a client has to send a whole request.

    Raises:
        SinkError: no password is set and the token file cannot be created.
        OSError: the address cannot be bound.
    """

    def __init__(self, settings: Settings, port: int | None = None,
                 request_deadline_s: float = REQUEST_DEADLINE_S) -> None:
        self.settings = settings
        self.user, _ = service_credentials(settings, create=True)
        self.backend = "sink" if settings.chdb_path is not None else "server"
        self.counts = {"queries": 0, "failed": 0, "refused": 0}
        self._lock = threading.Lock()
        self._http = BoundedHttpServer(
            settings.query_service_host, settings.query_service_port if port is None else port, self._handle,
            fast=self._fast, max_connections=MAX_CONNECTIONS, request_deadline_s=request_deadline_s,
            max_body_bytes=MAX_SQL_BYTES, workers=MAX_CONCURRENT_QUERIES, queue_wait_s=request_deadline_s,
            name="argus-query-service")
        self.port = self._http.port

    def start(self) -> None:
        self._http.start()
        announce(self.settings.home, SERVICE_ENDPOINT, self.port)  # local clients send their token here only
        log.info("query service on %s:%d (backend: %s)", self.settings.query_service_host, self.port, self.backend)

    def stop(self) -> None:
        withdraw(self.settings.home, SERVICE_ENDPOINT)
        self._http.stop()

    def health(self) -> dict[str, Any]:
        """``GET /health``: the backend kind, connections and query counts."""
        h = self._http
        with self._lock:
            counts = dict(self.counts)
        return {"ok": True, "backend": self.backend, "open_connections": h.open_connections,
                "refused_connections": h.refused_connections, "timed_out_requests": h.timed_out_requests, **counts}

    # -- on the event loop: what needs no work ----------------------------------------------------
    def _fast(self, req: Request) -> Response | None:
        origin = req.headers.get("origin")
        if origin is not None and urllib.parse.urlsplit(origin).netloc != req.headers.get("host"):
            # A web page's request: a browser sends its page's Origin. Other clients send none.
            return ClickHouseError(ACCESS_DENIED, "cross-origin requests are refused").response()
        has_query = req.param("query") is not None or bool(req.body)
        if req.method in ("GET", "HEAD") and (req.path == "/ping" or (req.path == "/" and not has_query)):
            return Response(HTTPStatus.OK, b"Ok.\n", [("Content-Type", "text/html; charset=UTF-8")])
        if req.method == "GET" and req.path == "/health":
            return Response(HTTPStatus.OK, json.dumps(self.health()).encode(), [("Content-Type", "application/json")])
        if req.path not in ("/", "/query"):
            return Response(HTTPStatus.NOT_FOUND, b"There is no handle " + req.path[:200].encode() + b"\n\n"
                            b"Use / or /ping or /health\n", [("Content-Type", "text/plain; charset=UTF-8")])
        return None

    # -- on a worker thread: one statement --------------------------------------------------------
    def _handle(self, req: Request) -> Response:
        query_id = req.param("query_id") or str(uuid.uuid4())
        try:
            log.debug("query %s: %s %s %s", query_id, req.method, req.params, req.body[:200])
            q = parse_query_request(req, query_id, QUERY_LIMITS)
            self._authenticate(q)
            try:
                stmt = prepare_statement(q.sql)
            except StatementRefusedError as exc:
                raise ClickHouseError(exc.code, str(exc)) from exc
            fmt = stmt.format or q.default_format
            if fmt not in OUTPUT_FORMATS:
                raise ClickHouseError(UNKNOWN_FORMAT, f"Unknown or unserved output format {fmt[:40]!r}")
            if fmt == "Native" and q.protocol_version and self.backend == "sink":
                # The embedded engine writes the plain Native format only; a client reading the revision it
                # asked for would misread it (clickhouse-go, and so Grafana, asks; clickhouse-connect probes).
                raise ClickHouseError(NOT_IMPLEMENTED, f"Native at client_protocol_version {q.protocol_version} is "
                                      "not served by the embedded store; ask for client_protocol_version 0 or another "
                                      "format")
            body, fmt_back, summary = self._forward(stmt, fmt, q)
        except ClickHouseError as exc:
            with self._lock:
                self.counts["refused" if exc.code in (AUTHENTICATION_FAILED, ACCESS_DENIED, 164) else "failed"] += 1
            log.info("query %s refused: %s", query_id, str(exc)[:300])
            return exc.response(query_id)
        with self._lock:
            self.counts["queries"] += 1
        return result_response(body, fmt_back or fmt, query_id, summary, q.compression)

    def _authenticate(self, q: QueryRequest) -> None:
        try:  # read each time: the token may be replaced (when its file was found readable by others)
            _, password = service_credentials(self.settings)
        except SinkError as exc:
            raise ClickHouseError(AUTHENTICATION_FAILED, f"no password to check against: {exc}") from exc
        user_ok = hmac.compare_digest((q.user or "default").encode(), self.user.encode())
        password_ok = hmac.compare_digest((q.password or "").encode(), password.encode())
        if not (user_ok and password_ok):
            raise ClickHouseError(AUTHENTICATION_FAILED, f"{(q.user or 'default')[:64]}: Authentication failed: "
                                  "password is incorrect, or there is no user with such name")

    def _forward(self, stmt: Statement, fmt: str, q: QueryRequest) -> tuple[bytes, str | None, dict[str, Any]]:
        """Run the statement upstream; (answer, its format, summary). Raises :class:`ClickHouseError`."""
        bound = {f"param_{k}": v for k, v in q.bound.items()}
        if self.backend == "sink":
            try:
                token = read_token(self.settings)
            except SinkError as exc:
                raise ClickHouseError(NETWORK_ERROR, f"the sink's query backend is not reachable: {exc}",
                                      status=503) from exc
            host, port, tls = "127.0.0.1", self.settings.query_port, False
            path = "/query?" + urllib.parse.urlencode(bound)
            headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/sql",
                       "X-Argus-Format": fmt, "X-Argus-Database": q.database or self.settings.clickhouse_database,
                       "Host": f"127.0.0.1:{port}"}
        else:
            url = urllib.parse.urlsplit(self.settings.clickhouse_dsn)
            host, tls = url.hostname or "127.0.0.1", url.scheme == "https"
            port = url.port or (8443 if tls else 8123)
            params = {"database": q.database or self.settings.clickhouse_database, "default_format": fmt,
                      "query_id": q.query_id, "client_protocol_version": str(q.protocol_version),
                      **{k: str(v) for k, v in QUERY_LIMITS.items()}, "readonly": "1", **bound}
            path = (url.path or "/") + "?" + urllib.parse.urlencode(params)
            headers = {"X-ClickHouse-User": self.settings.clickhouse_user,
                       "X-ClickHouse-Key": self.settings.clickhouse_password.reveal(),
                       "Content-Type": "text/plain; charset=UTF-8"}
        return _exchange(host, port, tls, path, headers, stmt.text.encode())


def _exchange(host: str, port: int, tls: bool, path: str, headers: dict[str, str],
              body: bytes) -> tuple[bytes, str | None, dict[str, Any]]:
    """POST ``body`` upstream and read the answer, at most :data:`MAX_RESULT_BYTES` of it."""
    timeout_s = float(QUERY_LIMITS["max_execution_time"]) + _UPSTREAM_GRACE_S
    conn_type = http.client.HTTPSConnection if tls else http.client.HTTPConnection
    conn = conn_type(host, port, timeout=timeout_s)
    try:
        conn.request("POST", path, body=body, headers=headers)
        resp = conn.getresponse()
        data = resp.read(MAX_RESULT_BYTES + 1)
        if resp.status != HTTPStatus.OK:
            raise ClickHouseError.from_text(data.decode("utf-8", "replace"), resp.status)
        if len(data) > MAX_RESULT_BYTES:
            raise ClickHouseError(TOO_MANY_ROWS_OR_BYTES, f"answer over the {MAX_RESULT_BYTES} bytes served; add a "
                                  "LIMIT or aggregate")
        summary_text = resp.getheader("X-Argus-Summary") or resp.getheader("X-ClickHouse-Summary") or "{}"
        try:
            summary = json.loads(summary_text)
        except ValueError:
            summary = {}
        return data, resp.getheader("X-ClickHouse-Format"), summary if isinstance(summary, dict) else {}
    except (OSError, http.client.HTTPException) as exc:
        raise ClickHouseError(NETWORK_ERROR, f"the query backend {host}:{port} did not answer: {exc}",
                              status=503) from exc
    finally:
        conn.close()


def serve_query_service(settings: Settings) -> None:
    """Run the query service until SIGTERM/SIGINT (``argus query-service``).

    Raises:
        SinkError: the credentials cannot be set up.
        OSError: the address cannot be bound.
    """
    import signal

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    service = QueryService(settings)
    service.start()
    try:
        stop.wait()
    finally:
        service.stop()
        log.info("query service stopped: %s", service.health())
