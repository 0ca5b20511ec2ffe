"""SQL over HTTP on loopback, served by the process that owns the embedded chDB directory.

chDB allows one process per data directory, so ``argus sql`` and ``argus findings`` in another process
cannot open it. The sink process (which owns it) serves ``POST /query`` (body: one SQL statement, UTF-8,
``Content-Type: application/sql``, ``Authorization: Bearer <token>``; answer: JSON
``{"columns": [...], "rows": [[...], ...]}``) and ``GET /health`` on ``127.0.0.1:<query_port>`` only.
:func:`run_query` picks the endpoint when a sink is up and the embedded store otherwise, so callers need
not know who owns the directory. With a server DSN (``http(s)://``) queries go straight to the server.

The endpoint is read-only and only for the local user:

* **Token.** ``<home>/query.token`` (mode 0600, created by the server when missing or unsafe) holds a
  random bearer token; :func:`run_query` reads it, so only users who can read the argus home can query.
* **Browsers.** Requests with an ``Origin`` other than the endpoint itself, a ``Host`` other than the bound
  address (DNS rebinding) or a ``Content-Type`` other than ``application/sql`` (which a cross-site form or
  ``fetch`` cannot send without a preflight, which is never answered) are refused.
* **Statements.** :func:`check_statement` lets through one ``SELECT``/``WITH``/``SHOW``/``DESCRIBE``/
  ``DESC``/``EXPLAIN``/``EXISTS`` statement without table functions or functions that reach files, URLs,
  other servers or programs, and without ``INTO OUTFILE``; the connection runs with ``readonly=1`` as well,
  since chDB's ``readonly`` alone still lets ``file()`` and ``INTO OUTFILE`` through.
* **Limits.** Request body up to 1 MB, socket timeout 10 s, ``max_execution_time`` 50 s,
  ``max_result_rows`` 500,000, ``max_result_bytes`` 256 MiB, at most 64 MiB of JSON per answer, two queries at
  a time on their own connections: a long query never holds up the sink's inserts.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import queue
import re
import secrets
import stat
import threading
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from argus.core.errors import SinkError
from argus.core.settings import Settings
from argus.sinks.clickhouse import ClickHouseStore, QueryResult

__all__ = [
    "MAX_SQL_BYTES",
    "QUERY_LIMITS",
    "REFUSED_FUNCTIONS",
    "QueryServer",
    "check_statement",
    "endpoint_healthy",
    "ensure_token",
    "post_query",
    "read_token",
    "run_query",
    "token_path",
]

log = logging.getLogger(__name__)

#: Largest request body, bytes.
MAX_SQL_BYTES = 1_000_000
#: Largest JSON answer, bytes; larger results are refused (add a LIMIT).
MAX_RESPONSE_BYTES = 64 * 1024 * 1024
#: Seconds a client may take to send its request before the socket is closed.
SOCKET_TIMEOUT_S = 10.0
#: Queries that may run at once (each on its own read-only connection); more wait up to the socket timeout.
MAX_CONCURRENT_QUERIES = 2
#: Connections served at once; more are closed unanswered.
MAX_CONNECTIONS = 32
#: ClickHouse settings of the query connections (``readonly=1`` is added last, so none can be changed):
#: ``max_execution_time`` in seconds (under :func:`run_query`'s 60 s client timeout), result rows and
#: uncompressed result bytes, and the memory one query may use (bytes).
QUERY_LIMITS: dict[str, Any] = {
    "max_execution_time": 50,
    "max_result_rows": 500_000,
    "max_result_bytes": 256 * 1024 * 1024,
    "result_overflow_mode": "throw",
    "max_memory_usage": 4 * 1024 * 1024 * 1024,
}
_TOKEN_FILE = "query.token"
_CONTENT_TYPE = "application/sql"

_ALLOWED_FIRST = frozenset({"select", "with", "show", "describe", "desc", "explain", "exists"})
#: Table functions that only compute or read argus's own tables; every other name that can be called as a
#: table function (or as ``file``, a scalar function reading files) is refused, so new ones fail closed.
_SAFE_TABLE_FUNCTIONS = frozenset(name.lower() for name in (
    "numbers", "numbers_mt", "zeros", "zeros_mt", "generate_series", "generateSeries", "primes", "values",
    "null", "view", "viewExplain", "viewIfPermitted", "merge", "format", "generateRandom", "loop",
    "SQLStandardValues", "dictionary", "mergeTreeIndex", "mergeTreeProjection",
))
#: Functions that reach outside the database: the table functions of ClickHouse 26.9 / chDB 4.4 that are not
#: in the safe list (files, URLs, object stores, other databases, clusters, programs, Python objects of the
#: serving process), plus the scalar ``file``. The server adds whatever else ``system.table_functions`` lists.
REFUSED_FUNCTIONS = frozenset(name.lower() for name in (
    "file", "fileCluster", "filesystem", "url", "urlCluster", "remote", "remoteSecure", "cluster",
    "clusterAllReplicas", "s3", "s3Cluster", "gcs", "oss", "cosn", "hdfs", "hdfsCluster", "azureBlobStorage",
    "azureBlobStorageCluster", "mysql", "postgresql", "mongodb", "redis", "sqlite", "jdbc", "odbc", "bigquery",
    "executable", "executablePool", "input", "python", "eval", "arrowstream", "arrowFlight", "ytsaurus", "hive",
    "iceberg", "icebergS3", "icebergAzure", "icebergHDFS", "icebergLocal", "icebergCluster", "icebergS3Cluster",
    "icebergAzureCluster", "icebergHDFSCluster", "icebergLocalCluster", "deltaLake", "deltaLakeS3",
    "deltaLakeAzure", "deltaLakeLocal", "deltaLakeCluster", "deltaLakeS3Cluster", "deltaLakeAzureCluster", "hudi",
    "hudiCluster", "paimon", "paimonS3", "paimonAzure", "paimonHDFS", "paimonLocal", "paimonCluster",
    "paimonS3Cluster", "paimonAzureCluster", "paimonHDFSCluster", "prometheusQuery", "prometheusQueryRange",
    "timeSeriesData", "timeSeriesMetrics", "timeSeriesTags", "timeSeriesSamples", "timeSeriesSelector",
    "timeSeriesMetricFamilies", "mergeTreeAnalyzeIndexes", "mergeTreeAnalyzeIndexesUUID",
    "mergeTreeCodecBlockCounts", "mergeTreeTextIndex", "fuzzJSON", "fuzzQuery",
))
#: Families refused by prefix, whatever a newer ClickHouse names their members.
_REFUSED_PREFIXES = ("s3", "hdfs", "azure", "iceberg", "deltalake", "hudi", "paimon", "remote", "url", "file",
                     "mysql", "postgres", "mongo", "executable", "python", "arrowflight")
#: Words refused anywhere outside strings: writing the result to a file (``INTO OUTFILE``) or reading one.
_REFUSED_WORDS = frozenset({"outfile", "infile"})
_WORD = re.compile(r"[A-Za-z0-9_]+")


def check_statement(sql: str, refused_functions: Iterable[str] = ()) -> None:
    """Accept one read-only statement or raise :class:`SinkError` saying why not.

    The statement is tokenized the way ClickHouse does (strings with ``\\`` escapes and doubled quotes,
    quoted identifiers, ``--`` and ``/* */`` comments); anything ambiguous is refused rather than guessed:
    ``#`` comments, nested comments, ``$`` (heredocs), control characters, backslashes in quoted identifiers,
    unterminated strings, identifiers or comments. It must start with ``SELECT``, ``WITH``, ``SHOW``,
    ``DESCRIBE``, ``DESC``, ``EXPLAIN`` or ``EXISTS``, hold one statement (a trailing ``;`` is fine), call no
    function in :data:`REFUSED_FUNCTIONS` or ``refused_functions`` (any case, quoted or not) and not use
    ``INTO OUTFILE``.
    """
    refused = REFUSED_FUNCTIONS | {f.lower() for f in refused_functions}
    tokens = list(_tokens(sql))
    words = [(i, kind, text) for i, (kind, text) in enumerate(tokens) if kind in ("word", "ident")]
    if not tokens or tokens[0][0] != "word" or tokens[0][1].lower() not in _ALLOWED_FIRST:
        first = tokens[0][1] if tokens else ""
        raise SinkError(f"only SELECT, WITH, SHOW, DESCRIBE, EXPLAIN and EXISTS are served here, not {first[:40]!r}")
    for i, (kind, text) in enumerate(tokens):
        if kind == "punct" and text == ";" and i != len(tokens) - 1:
            raise SinkError("one statement per query")
    for i, kind, text in words:
        name = text.lower()
        if kind == "word" and name in _REFUSED_WORDS:
            raise SinkError(f"{text.upper()} is not allowed: the endpoint does not read or write files")
        called = i + 1 < len(tokens) and tokens[i + 1] == ("punct", "(")
        if called and (name in refused or name.startswith(_REFUSED_PREFIXES)):
            raise SinkError(f"function {text}() is not allowed: it reaches outside the database")


def _tokens(sql: str) -> Iterator[tuple[str, str]]:
    """(kind, text) of the significant tokens: ``word`` (bare), ``ident`` (quoted identifier, unquoted text),
    ``string`` and ``punct`` (one character). Whitespace and comments are dropped; raises :class:`SinkError`
    on what ClickHouse might read differently."""
    i, n = 0, len(sql)
    while i < n:
        c = sql[i]
        if c in " \t\n\r\f\v" or ord(c) > 0x7F:
            # ClickHouse skips Unicode whitespace and rejects other non-ASCII outside strings: a separator here.
            i += 1
        elif ord(c) < 0x20 or c == "\x7f":
            raise SinkError(f"control character {ord(c):#04x} outside a string")
        elif sql.startswith("--", i):
            # End at any line break: ending earlier than ClickHouse only makes more text checked.
            ends = [j for j in (sql.find("\n", i), sql.find("\r", i)) if j >= 0]
            i = min(ends) if ends else n
        elif sql.startswith("/*", i):
            end = sql.find("*/", i + 2)
            if end < 0:
                raise SinkError("unterminated /* comment")
            if "/*" in sql[i + 2:end]:
                raise SinkError("nested /* comments are not allowed")
            i = end + 2
        elif c in "'\"`":
            end, text = _quoted(sql, i)
            if c != "'" and "\\" in text:
                raise SinkError("backslash escapes in quoted identifiers are not allowed")
            yield ("string" if c == "'" else "ident", text.replace(c * 2, c))
            i = end
        elif c in "#$":
            raise SinkError(f"{c!r} outside a string is not allowed (comments and heredocs: use -- and '...')")
        elif (m := _WORD.match(sql, i)) is not None:
            yield ("word", m.group())
            i = m.end()
        else:
            yield ("punct", c)
            i += 1


def _quoted(sql: str, start: int) -> tuple[int, str]:
    """End index and raw content of the quoted token at ``start`` (``\\`` escapes the next character, a
    doubled quote is one quote)."""
    q, i, n = sql[start], start + 1, len(sql)
    while i < n:
        c = sql[i]
        if c == "\\":
            i += 2
        elif c == q:
            if i + 1 < n and sql[i + 1] == q:
                i += 2
            else:
                return i + 1, sql[start + 1:i]
        else:
            i += 1
    raise SinkError(f"unterminated {q}-quoted text")


def token_path(settings: Settings) -> Path:
    """The query endpoint's token file, ``<home>/query.token``."""
    return settings.home.resolve() / _TOKEN_FILE


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
        tmp = path.with_name(f".{_TOKEN_FILE}.{os.getpid()}")
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
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


class QueryServer:
    """Serves read-only SQL on ``127.0.0.1:port`` in a daemon thread, on its own connections to the store.

    Args:
        store: the sink's store; for embedded chDB the server opens :data:`MAX_CONCURRENT_QUERIES` read-only
            connections of it (``store.reader``), so the store's own lock is never taken by a query. For a
            ClickHouse server it serves ``/health`` only (clients query the server directly).
        settings: ``home`` (token file) and ``query_port``.
        health: extra fields of ``GET /health`` (the sink's counters), read at each request.
        port: overrides ``settings.query_port`` (0: any free port, see :attr:`port`).
        limits: overrides :data:`QUERY_LIMITS`.

    Raises:
        SinkError: the token file or a read-only connection cannot be created.
        OSError: the port is taken.
    """

    def __init__(self, store: ClickHouseStore, settings: Settings, health: dict[str, Any] | None = None,
                 port: int | None = None, limits: dict[str, Any] | None = None) -> None:
        self.health = health if health is not None else {}
        self.token = ensure_token(settings)
        self._readers: queue.Queue[ClickHouseStore] = queue.Queue()
        # A ClickHouse server is queried directly (run_query), with its own users and grants; the endpoint only
        # serves what nobody else can open, the embedded directory.
        self.serves_queries = store.embedded
        if self.serves_queries:
            for _ in range(MAX_CONCURRENT_QUERIES):
                self._readers.put(store.reader(limits if limits is not None else QUERY_LIMITS))
        self.refused_functions = self._unknown_table_functions() if self.serves_queries else frozenset()
        self._server = _Server(("127.0.0.1", settings.query_port if port is None else port), _Handler)
        self._server.app = self
        self.port = int(self._server.server_address[1])
        self.allowed_hosts = frozenset({f"127.0.0.1:{self.port}", f"localhost:{self.port}"})
        self._thread = threading.Thread(target=self._server.serve_forever, name="argus-query", daemon=True)

    def _unknown_table_functions(self) -> frozenset[str]:
        """Every table function this ClickHouse has beyond the safe ones: refused even if not listed here."""
        reader = self._readers.get()
        try:
            rows = reader.query("SELECT name FROM system.table_functions").rows
        except SinkError as exc:
            log.warning("cannot list table functions (only the built-in list is refused): %s", exc)
            return frozenset()
        finally:
            self._readers.put(reader)
        return frozenset(str(r[0]).lower() for r in rows) - _SAFE_TABLE_FUNCTIONS

    def start(self) -> None:
        self._thread.start()
        log.info("query endpoint on 127.0.0.1:%d", self.port)

    def stop(self) -> None:
        """Stop serving and close the read-only connections."""
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()
        while not self._readers.empty():
            self._readers.get_nowait().close()

    def query(self, sql: str) -> QueryResult:
        """Check and run one statement on a free read-only connection. Raises :class:`SinkError`."""
        if not self.serves_queries:
            raise SinkError("this sink writes to a ClickHouse server: query the server itself")
        check_statement(sql, self.refused_functions)
        try:
            reader = self._readers.get(timeout=SOCKET_TIMEOUT_S)
        except queue.Empty:
            raise SinkError(f"{MAX_CONCURRENT_QUERIES} queries are running; try again") from None
        try:
            return reader.query(sql)
        finally:
            self._readers.put(reader)


class _Server(ThreadingHTTPServer):
    """One thread per connection, at most :data:`MAX_CONNECTIONS` at once."""

    daemon_threads = True
    app: QueryServer

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        super().__init__(address, handler)
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = SOCKET_TIMEOUT_S  # applied to the socket: a stalled client cannot hold a thread for long

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("query endpoint: " + format, *args)

    def _reply(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body, default=str).encode()
        if len(data) > MAX_RESPONSE_BYTES:
            status = HTTPStatus.REQUEST_ENTITY_TOO_LARGE
            data = json.dumps({"error": f"result over {MAX_RESPONSE_BYTES} bytes of JSON; add a LIMIT"}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Cache-Control", "no-store")
        if status == HTTPStatus.UNAUTHORIZED:
            self.send_header("WWW-Authenticate", "Bearer")
        self.end_headers()
        self.wfile.write(data)

    def _refusal(self) -> tuple[int, str] | None:
        """Why a request from a browser page or another host is refused (None: it is not)."""
        app = self.server.app
        if (self.headers.get("Host") or "").lower() not in app.allowed_hosts:
            return HTTPStatus.FORBIDDEN, "Host must be the endpoint's own address"
        origin = self.headers.get("Origin")
        if origin is not None and origin.lower() not in {f"http://{h}" for h in app.allowed_hosts}:
            return HTTPStatus.FORBIDDEN, "cross-origin requests are refused"
        return None

    def do_GET(self) -> None:
        refusal = self._refusal()
        if refusal is not None:
            self._reply(refusal[0], {"error": refusal[1]})
        elif self.path == "/health":
            self._reply(HTTPStatus.OK, {"ok": True, **self.server.app.health})
        else:
            self._reply(HTTPStatus.NOT_FOUND, {"error": "GET /health or POST /query"})

    def do_POST(self) -> None:
        refusal = self._refusal() or self._post_refusal()
        if refusal is not None:
            self.close_connection = True  # the body may be unread; never parse it as the next request
            self._reply(refusal[0], {"error": refusal[1]})
            return
        length = int(self.headers["Content-Length"])
        try:
            sql = self.rfile.read(length).decode("utf-8")
        except UnicodeDecodeError:
            self._reply(HTTPStatus.BAD_REQUEST, {"error": "SQL must be UTF-8"})
            return
        except OSError as exc:  # the socket timeout: the client stopped sending
            log.debug("query endpoint: reading the request failed: %s", exc)
            self.close_connection = True
            return
        try:
            res = self.server.app.query(sql)
        except SinkError as exc:
            self._reply(HTTPStatus.BAD_REQUEST, {"error": str(exc)})
            return
        self._reply(HTTPStatus.OK, {"columns": list(res.columns), "rows": [list(r) for r in res.rows]})

    def _post_refusal(self) -> tuple[int, str] | None:
        if self.path != "/query":
            return HTTPStatus.NOT_FOUND, "POST /query"
        auth = self.headers.get("Authorization") or ""
        if not hmac.compare_digest(auth.encode(), f"Bearer {self.server.app.token}".encode()):
            return HTTPStatus.UNAUTHORIZED, "a bearer token is required (see <ARGUS_HOME>/query.token)"
        ctype = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        if ctype != _CONTENT_TYPE:
            return HTTPStatus.UNSUPPORTED_MEDIA_TYPE, f"Content-Type must be {_CONTENT_TYPE}"
        if self.headers.get("Transfer-Encoding") is not None:
            return HTTPStatus.LENGTH_REQUIRED, "send the SQL with a Content-Length, not chunked"
        raw = self.headers.get("Content-Length") or ""
        if not raw.isascii() or not raw.isdigit():
            return HTTPStatus.LENGTH_REQUIRED, "Content-Length must be a non-negative integer"
        if int(raw) > MAX_SQL_BYTES:
            return HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"SQL over {MAX_SQL_BYTES} bytes"
        return None


def endpoint_healthy(settings: Settings, timeout_s: float = 1.0) -> dict[str, Any] | None:
    """The sink's health document, or None when no sink answers on the query port."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{settings.query_port}/health", timeout=timeout_s) as r:
            doc = json.loads(r.read())
            return doc if isinstance(doc, dict) else None
    except (OSError, ValueError):
        return None


def post_query(port: int, token: str, sql: str, timeout_s: float = 60.0) -> QueryResult:
    """``POST /query`` to the endpoint on ``127.0.0.1:port`` with ``token``.

    Raises:
        SinkError: the endpoint refused the request or the query, or did not answer in ``timeout_s``.
    """
    req = urllib.request.Request(f"http://127.0.0.1:{port}/query", data=sql.encode(), method="POST",
                                 headers={"Content-Type": _CONTENT_TYPE, "Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            doc = json.loads(r.read())
    except urllib.error.HTTPError as exc:
        try:
            detail = json.loads(exc.read()).get("error", str(exc))
        except (ValueError, AttributeError):
            detail = str(exc)
        raise SinkError(detail) from exc
    except (OSError, ValueError) as exc:
        raise SinkError(f"query endpoint on port {port} failed: {exc}") from exc
    return QueryResult(tuple(doc["columns"]), [tuple(r) for r in doc["rows"]])


def run_query(settings: Settings, sql: str, timeout_s: float = 60.0) -> QueryResult:
    """Run ``sql`` against the configured ClickHouse from any process.

    Embedded chDB: through the sink's endpoint (read-only, with the token from ``<home>/query.token``) when a
    sink runs, else by opening the directory directly (as its owner: any statement).

    Raises:
        SinkError: the query failed, or the store cannot be reached.
    """
    if settings.chdb_path is not None and endpoint_healthy(settings) is not None:
        return post_query(settings.query_port, read_token(settings), sql, timeout_s)
    store = ClickHouseStore(settings.clickhouse)
    try:
        store.ensure_schema()
        return store.query(sql)
    finally:
        store.close()
