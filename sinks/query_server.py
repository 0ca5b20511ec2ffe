"""SQL over HTTP on loopback, served by the process that owns the embedded chDB directory.

chDB allows one process per data directory, so ``argus sql`` and ``argus findings`` in another process
cannot open it. The sink process (which owns it) serves ``POST /query`` (body: SQL, UTF-8; answer: JSON
``{"columns": [...], "rows": [[...], ...]}``) and ``GET /health`` on ``127.0.0.1:<query_port>`` only.
:func:`run_query` picks the endpoint when a sink is up and the embedded store otherwise, so callers need
not know who owns the directory. With a server DSN (``http(s)://``) queries go straight to the server.
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.error
import urllib.request
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from argus.errors import SinkError
from argus.settings import Settings
from sinks.clickhouse import ClickHouseStore, QueryResult

__all__ = ["QueryServer", "endpoint_healthy", "run_query"]

log = logging.getLogger(__name__)
_MAX_SQL_BYTES = 1_000_000


class QueryServer:
    """Serves a :class:`ClickHouseStore` on ``127.0.0.1:port`` in a daemon thread."""

    def __init__(self, store: ClickHouseStore, port: int, health: dict[str, Any] | None = None) -> None:
        self.store = store
        self.health = health if health is not None else {}
        server_self = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, fmt: str, *args: Any) -> None:
                log.debug("query endpoint: " + fmt, *args)

            def _reply(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body, default=str).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/health":
                    self._reply(HTTPStatus.OK, {"ok": True, **server_self.health})
                else:
                    self._reply(HTTPStatus.NOT_FOUND, {"error": "GET /health or POST /query"})

            def do_POST(self) -> None:
                if self.path != "/query":
                    self._reply(HTTPStatus.NOT_FOUND, {"error": "POST /query"})
                    return
                length = int(self.headers.get("Content-Length") or 0)
                if length > _MAX_SQL_BYTES:
                    self._reply(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, {"error": "SQL too long"})
                    return
                sql = self.rfile.read(length).decode("utf-8", "replace")
                try:
                    res = server_self.store.query(sql)
                except SinkError as exc:
                    self._reply(HTTPStatus.BAD_REQUEST, {"error": str(exc)})
                    return
                self._reply(HTTPStatus.OK, {"columns": list(res.columns), "rows": [list(r) for r in res.rows]})

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="argus-query", daemon=True)

    def start(self) -> None:
        self._thread.start()
        log.info("query endpoint on 127.0.0.1:%d", self._server.server_address[1])

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def endpoint_healthy(settings: Settings, timeout_s: float = 1.0) -> dict[str, Any] | None:
    """The sink's health document, or None when no sink answers on the query port."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{settings.query_port}/health", timeout=timeout_s) as r:
            doc = json.loads(r.read())
            return doc if isinstance(doc, dict) else None
    except (OSError, ValueError):
        return None


def run_query(settings: Settings, sql: str, timeout_s: float = 60.0) -> QueryResult:
    """Run ``sql`` against the configured ClickHouse from any process.

    Embedded chDB: through the sink's endpoint when a sink runs, else by opening the directory directly.

    Raises:
        SinkError: the query failed, or the store cannot be reached.
    """
    if settings.chdb_path is not None and endpoint_healthy(settings) is not None:
        req = urllib.request.Request(f"http://127.0.0.1:{settings.query_port}/query", data=sql.encode(),
                                     method="POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                doc = json.loads(r.read())
        except urllib.error.HTTPError as exc:
            try:
                detail = json.loads(exc.read()).get("error", str(exc))
            except ValueError:
                detail = str(exc)
            raise SinkError(detail) from exc
        except OSError as exc:
            raise SinkError(f"query endpoint on port {settings.query_port} failed: {exc}") from exc
        return QueryResult(tuple(doc["columns"]), [tuple(r) for r in doc["rows"]])
    store = ClickHouseStore(settings)
    try:
        store.ensure_schema()
        return store.query(sql)
    finally:
        store.close()
