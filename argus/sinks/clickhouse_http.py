"""The pieces of ClickHouse's HTTP interface that argus's query service speaks.

What a ClickHouse client sends (clickhouse-connect, curl, Grafana's datasource over HTTP) is read here into a
:class:`QueryRequest`: the statement from ``?query=`` and/or the body (GET or POST), the credentials
(``X-ClickHouse-User``/``X-ClickHouse-Key`` headers, ``user``/``password`` URL parameters or HTTP basic auth),
``database``, ``default_format`` (or the ``X-ClickHouse-Format`` request header), ``query_id`` and ``param_*``
(server-side bound parameters). Errors are answered the way ClickHouse answers them (:class:`ClickHouseError`):
``Code: N. DB::Exception: ... (NAME)`` in the body, ``X-ClickHouse-Exception-Code`` in the headers and
ClickHouse's HTTP status for the code.

Details and reasoning: docs/query-service.md.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from argus.core.errors import SinkError
from argus.sinks.clickhouse import QueryResult
from argus.sinks.http_serve import Request, Response

__all__ = [
    "OUTPUT_FORMATS",
    "TRANSPORT_PARAMS",
    "ClickHouseError",
    "QueryRequest",
    "compress_response",
    "content_type",
    "parse_json_compact",
    "parse_query_request",
    "result_response",
]

#: ClickHouse error codes answered by argus itself (names as ClickHouse spells them).
NOT_IMPLEMENTED, SYNTAX_ERROR, UNKNOWN_FORMAT, READONLY = 48, 62, 73, 164
TOO_MANY_SIMULTANEOUS_QUERIES, NETWORK_ERROR, AUTHENTICATION_FAILED, ACCESS_DENIED = 202, 210, 516, 497
QUERY_IS_TOO_LARGE, TOO_MANY_ROWS_OR_BYTES, BAD_ARGUMENTS = 393, 396, 36
_NAMES = {NOT_IMPLEMENTED: "NOT_IMPLEMENTED", SYNTAX_ERROR: "SYNTAX_ERROR", UNKNOWN_FORMAT: "UNKNOWN_FORMAT",
          READONLY: "READONLY", TOO_MANY_SIMULTANEOUS_QUERIES: "TOO_MANY_SIMULTANEOUS_QUERIES",
          NETWORK_ERROR: "NETWORK_ERROR", AUTHENTICATION_FAILED: "AUTHENTICATION_FAILED",
          ACCESS_DENIED: "ACCESS_DENIED", QUERY_IS_TOO_LARGE: "QUERY_IS_TOO_LARGE",
          TOO_MANY_ROWS_OR_BYTES: "TOO_MANY_ROWS_OR_BYTES", BAD_ARGUMENTS: "BAD_ARGUMENTS"}
#: ClickHouse's HTTP status per error code (``exceptionCodeToHTTPStatus``), for the codes argus answers and the
#: usual ones from the engine; any other code is 500.
_STATUS = {NOT_IMPLEMENTED: 501, SYNTAX_ERROR: 400, UNKNOWN_FORMAT: 404, AUTHENTICATION_FAILED: 403,
           ACCESS_DENIED: 403, QUERY_IS_TOO_LARGE: 413, BAD_ARGUMENTS: 400, TOO_MANY_SIMULTANEOUS_QUERIES: 503,
           194: 401, 192: 403, 193: 403, 47: 400, 43: 400, 53: 400, 6: 400, 27: 400, 60: 404, 81: 404, 46: 404,
           115: 404, 159: 408, 209: 503}

#: Output formats served (those of ClickHouse that write only to the answer). clickhouse-connect asks for
#: ``Native`` (query, query_df), ``Arrow``/``ArrowStream`` (query_arrow, query_df_arrow) and
#: ``RowBinaryWithNamesAndTypes``; curl users mostly for ``TabSeparated`` and ``JSON*``.
OUTPUT_FORMATS = frozenset({
    "TabSeparated", "TSV", "TabSeparatedRaw", "TSVRaw", "TabSeparatedWithNames", "TSVWithNames",
    "TabSeparatedWithNamesAndTypes", "TSVWithNamesAndTypes", "CSV", "CSVWithNames", "CSVWithNamesAndTypes",
    "CustomSeparated", "Values", "Vertical", "JSON", "JSONStrings", "JSONColumns", "JSONColumnsWithMetadata",
    "JSONCompact", "JSONCompactStrings", "JSONCompactColumns", "JSONEachRow", "JSONEachRowWithProgress",
    "JSONStringsEachRow", "JSONCompactEachRow", "JSONCompactEachRowWithNames",
    "JSONCompactEachRowWithNamesAndTypes", "JSONCompactStringsEachRow", "JSONObjectEachRow", "NDJSON",
    "JSONLines", "TSKV", "Pretty", "PrettyCompact", "PrettyCompactMonoBlock", "PrettySpace", "PrettyNoEscapes",
    "PrettyCompactNoEscapes", "PrettySpaceNoEscapes", "Markdown", "XML", "Native", "RowBinary",
    "RowBinaryWithNames", "RowBinaryWithNamesAndTypes", "Arrow", "ArrowStream", "Parquet", "ORC", "Avro",
    "Null", "LineAsString", "RawBLOB", "Prometheus",
})
_TEXT_FORMATS = ("TabSeparated", "TSV", "CSV", "Pretty", "Vertical", "Values", "Markdown", "TSKV",
                 "CustomSeparated", "LineAsString")
#: URL parameters that only steer the HTTP exchange (handled here, or ignored where they change nothing a
#: read-only client can see); everything else that is no ``param_*`` is a setting, refused (readonly).
TRANSPORT_PARAMS = frozenset({
    "query", "user", "password", "database", "default_format", "query_id", "session_id", "session_timeout",
    "session_check", "compress", "decompress", "enable_http_compression", "http_zlib_compression_level",
    "wait_end_of_query", "send_progress_in_http_headers", "http_headers_progress_interval_ms",
    "cancel_http_readonly_queries_on_client_close", "client_protocol_version", "buffer_size", "readonly",
    "quota_key", "stacktrace", "add_http_cors_header",
})


class ClickHouseError(SinkError):
    """An error answered as ClickHouse answers it; ``str()`` is the whole
    ``Code: <code>. DB::Exception: <message>. (<NAME>)`` line."""

    def __init__(self, code: int, message: str, name: str | None = None, status: int | None = None,
                 text: str | None = None) -> None:
        self.code = code
        self.name = name or _NAMES.get(code, "UNKNOWN_EXCEPTION")
        self.status = status or _STATUS.get(code, 500)
        self.text = text or f"Code: {code}. DB::Exception: {message}. ({self.name})"
        super().__init__(self.text)

    def response(self, query_id: str = "") -> Response:
        headers = [("Content-Type", "text/plain; charset=UTF-8"), ("X-ClickHouse-Exception-Code", str(self.code))]
        if query_id:
            headers.append(("X-ClickHouse-Query-Id", query_id))
        return Response(self.status, (self.text + "\n").encode(), headers)

    @classmethod
    def from_text(cls, text: str, status: int = 500) -> ClickHouseError:
        """The error of an engine message such as ``Code: 60. DB::Exception: Unknown table ... (UNKNOWN_TABLE)``
        (kept whole; ClickHouse's status for its code, else ``status``)."""
        text = text.strip()
        head = text.find("Code: ")
        text = text[head:] if head >= 0 else text
        digits = text[6:].split(".", 1)[0] if head >= 0 else ""
        code = int(digits) if digits.isdigit() else 1000
        name = None
        if text.endswith(")") and "(" in text:
            candidate = text[text.rfind("(") + 1:-1]
            name = candidate if candidate.replace("_", "").isalpha() and candidate.isupper() else None
        return cls(code, text, name, _STATUS.get(code, status), text=text)


@dataclass(frozen=True)
class QueryRequest:
    """What a ClickHouse HTTP client asked for (see the module's description)."""

    sql: str
    user: str | None
    password: str | None
    database: str | None
    default_format: str
    query_id: str
    #: ``param_<name>`` URL parameters, without the prefix.
    bound: dict[str, str]
    #: The response compression asked for with ``enable_http_compression=1``: ``gzip``, ``deflate`` or ``None``.
    compression: str | None
    #: ``client_protocol_version``: the revision of ClickHouse's Native format the client reads (0: the plain one).
    protocol_version: int = 0


def parse_query_request(req: Request, query_id: str, limits: Mapping[str, Any]) -> QueryRequest:
    """Read a ClickHouse HTTP request; ``limits`` are the settings the service enforces (a client may name one
    of them, with an integer value that is not applied: Grafana's datasource sends its ``max_execution_time``).

    Raises:
        ClickHouseError: an empty statement, a body that is not UTF-8 text, an unknown or lifted setting, or a
            compression argus does not do.
    """
    if req.method not in ("GET", "POST", "HEAD"):
        raise ClickHouseError(NOT_IMPLEMENTED, f"HTTP method {req.method} is not served", status=405)
    for name, value in req.params:
        if name.startswith("param_"):
            continue
        if name in limits and value.isdigit():
            continue  # the service's own value stays in force: nothing is lifted
        if name not in TRANSPORT_PARAMS:
            raise ClickHouseError(READONLY, f"Cannot modify '{name}' setting in readonly mode")
        if name == "readonly" and value not in ("1", "2"):
            raise ClickHouseError(READONLY, "Cannot modify 'readonly' setting in readonly mode")
        if name in ("compress", "decompress") and value not in ("", "0"):
            raise ClickHouseError(NOT_IMPLEMENTED, f"{name}=1 (ClickHouse's block compression) is not served; use "
                                  "enable_http_compression=1 with Accept-Encoding: gzip")
    if req.headers.get("content-encoding", "identity").lower() not in ("", "identity"):
        raise ClickHouseError(NOT_IMPLEMENTED, "compressed request bodies are not served")
    if req.headers.get("content-type", "").lower().startswith("multipart/"):
        raise ClickHouseError(NOT_IMPLEMENTED, "external data (multipart bodies) is not served")
    try:
        body = req.body.decode("utf-8")
    except UnicodeDecodeError:
        raise ClickHouseError(SYNTAX_ERROR, "the query must be UTF-8 text", status=400) from None
    sql = "\n".join(part for part in (req.param("query") or "", body) if part)
    if not sql.strip():
        raise ClickHouseError(SYNTAX_ERROR, "Empty query")
    user, password = _credentials(req)
    fmt = req.param("default_format") or req.headers.get("x-clickhouse-format") or "TabSeparated"
    database = req.param("database") or req.headers.get("x-clickhouse-database") or None
    if database is not None and database.lower() == "system":
        # Unqualified names would read the system tables sql_guard refuses by their qualified names.
        raise ClickHouseError(READONLY, "the system database is not served as the default database")
    return QueryRequest(
        sql=sql, user=user, password=password, database=database, default_format=fmt, query_id=query_id,
        bound={k[len("param_"):]: v for k, v in req.params if k.startswith("param_")},
        compression=_compression(req) if req.param("enable_http_compression") == "1" else None,
        protocol_version=int(version) if (version := req.param("client_protocol_version") or "0").isdigit() else 0)


def _credentials(req: Request) -> tuple[str | None, str | None]:
    """(user, password) from the ``X-ClickHouse-*`` headers, basic auth or the URL, in that order."""
    if "x-clickhouse-user" in req.headers or "x-clickhouse-key" in req.headers:
        return req.headers.get("x-clickhouse-user"), req.headers.get("x-clickhouse-key", "")
    auth = req.headers.get("authorization", "")
    if auth[:6].lower() == "basic ":
        try:
            user, _, password = base64.b64decode(auth[6:].strip(), validate=True).decode("utf-8").partition(":")
        except (binascii.Error, UnicodeDecodeError):
            raise ClickHouseError(AUTHENTICATION_FAILED, "malformed basic authorization") from None
        return user, password
    if req.param("user") is not None or req.param("password") is not None:
        return req.param("user"), req.param("password") or ""
    return None, None


def _compression(req: Request) -> str | None:
    accepted = {part.split(";")[0].strip().lower() for part in req.headers.get("accept-encoding", "").split(",")}
    return "gzip" if "gzip" in accepted else "deflate" if "deflate" in accepted else None


def compress_response(body: bytes, encoding: str | None) -> tuple[bytes, list[tuple[str, str]]]:
    """``body`` compressed for ``Content-Encoding: encoding`` (``gzip``, ``deflate`` or ``None``: as it is)."""
    if encoding is None:
        return body, []
    c = zlib.compressobj(3, zlib.DEFLATED, 16 + zlib.MAX_WBITS) if encoding == "gzip" else zlib.compressobj(3)
    return c.compress(body) + c.flush(), [("Content-Encoding", encoding)]


def content_type(fmt: str) -> str:
    """The ``Content-Type`` ClickHouse sends with format ``fmt``."""
    if fmt.startswith("JSON") or fmt == "NDJSON":
        return "application/json; charset=UTF-8"
    if fmt == "XML":
        return "application/xml; charset=UTF-8"
    if fmt.startswith(("TabSeparated", "TSV")):
        return "text/tab-separated-values; charset=UTF-8"
    if fmt.startswith(_TEXT_FORMATS):
        return "text/plain; charset=UTF-8"
    return "application/octet-stream"


def result_response(body: bytes, fmt: str, query_id: str, summary: dict[str, int],
                    compression: str | None) -> Response:
    """A successful answer with the headers ClickHouse clients read (``X-ClickHouse-Format``,
    ``X-ClickHouse-Query-Id``, ``X-ClickHouse-Summary``)."""
    data, extra = compress_response(body, compression)
    summary_text = json.dumps({k: str(v) for k, v in summary.items()}, separators=(",", ":"))
    return Response(HTTPStatus.OK, data, [
        ("Content-Type", content_type(fmt)), ("X-ClickHouse-Format", fmt), ("X-ClickHouse-Query-Id", query_id),
        ("X-ClickHouse-Summary", summary_text), ("X-ClickHouse-Server-Display-Name", "argus"), *extra])


_WIDE_INT = re.compile(r"\b(?:U?Int(?:64|128|256))\b")


def parse_json_compact(data: bytes) -> QueryResult:
    """Rows of a ``JSONCompact`` answer; 64-bit and wider integers (quoted by ClickHouse) become ints again.

    Raises:
        ValueError, KeyError, TypeError: ``data`` is not a ``JSONCompact`` document.
    """
    doc = json.loads(data)
    meta = doc["meta"]
    wide = [bool(_WIDE_INT.search(str(m["type"]))) for m in meta]
    rows = [tuple(_ints(v) if w else v for v, w in zip(row, wide, strict=True)) for row in doc["data"]]
    return QueryResult(tuple(str(m["name"]) for m in meta), rows)


def _ints(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            return value
    if isinstance(value, list):
        return [_ints(v) for v in value]
    return value
