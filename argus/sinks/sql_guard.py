"""The statement guard of argus's SQL endpoints: which statements are served, and in what form they run.

One statement is tokenized once, the way ClickHouse reads it (:func:`prepare_statement`): it is checked
(read-only kinds, no functions that reach outside the database, no ``INTO OUTFILE``) and normalized, every run
of whitespace and comments becoming one space, before anything else reads it. The normalized text is what runs,
so the checked statement and the executed one are the same text, and no later parser (clickhouse-connect's
trailing-``LIMIT`` regex backtracks quadratically on long runs of whitespace) ever sees an unbounded gap.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from argus.core.errors import SinkError

__all__ = ["MAX_STATEMENT_BYTES", "PRIVATE_SYSTEM_TABLES", "REFUSED_FUNCTIONS", "SAFE_TABLE_FUNCTIONS", "Statement",
           "StatementRefusedError", "check_statement", "prepare_statement"]

#: Longest statement served once normalized, bytes (UTF-8): dashboards' and argus's own queries are a few KB.
MAX_STATEMENT_BYTES = 256 * 1024


class StatementRefusedError(SinkError):
    """A statement the guard does not let through; ``code`` is the ClickHouse error code it is answered with:
    62 (SYNTAX_ERROR: what ClickHouse might read differently), 164 (READONLY: not one read-only statement),
    497 (ACCESS_DENIED: a function that reaches outside the database, ``INTO OUTFILE``) or 393
    (QUERY_IS_TOO_LARGE)."""

    def __init__(self, message: str, code: int = 62) -> None:
        super().__init__(message)
        self.code = code


_ALLOWED_FIRST = frozenset({"select", "with", "show", "describe", "desc", "explain", "exists"})
#: Table functions that only compute or read argus's own tables; every other name that can be called as a
#: table function (or as ``file``, a scalar function reading files) is refused, so new ones fail closed.
SAFE_TABLE_FUNCTIONS = frozenset(name.lower() for name in (
    "numbers", "numbers_mt", "zeros", "zeros_mt", "generate_series", "generateSeries", "primes", "values",
    "null", "view", "viewExplain", "viewIfPermitted", "format", "SQLStandardValues", "dictionary",
    "mergeTreeIndex", "mergeTreeProjection",
))
#: System tables that show where and how the store keeps its data (paths of disks, parts and tables), the
#: server's own settings and logs, or its users: refused by name (``system.<name>``) so the served SQL tells
#: nothing of the machine. Table discovery goes by ``SHOW TABLES`` / ``DESCRIBE``.
PRIVATE_SYSTEM_TABLES = frozenset({
    "disks", "storage_policies", "parts", "parts_columns", "projection_parts", "projection_parts_columns",
    "detached_parts", "detached_tables", "part_log", "tables", "filesystem_cache", "remote_data_paths",
    "server_settings", "build_options", "user_directories", "named_collections", "stack_trace", "processes",
    "query_log", "query_thread_log", "query_views_log", "text_log", "crash_log", "trace_log", "error_log",
    "users", "roles", "grants", "settings_profiles", "settings_profile_elements", "quotas", "row_policies",
    "dictionaries", "models", "backups", "backup_log", "zookeeper", "mutations", "merges", "moves",
    "replicas", "replication_queue", "distribution_queue", "database_engines", "databases", "metrics",
    "asynchronous_metrics", "events", "asynchronous_metric_log", "metric_log", "session_log", "blob_storage_log",
    "filesystem_cache_log", "s3queue", "azure_queue", "kafka_consumers", "certificates", "user_processes",
})
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
    # Not outside the database, but unbounded work on the serving machine (random data, an endless loop) or
    # any database's tables, the system ones included (merge's regular expressions).
    "generateRandom", "loop", "merge",
))
#: Families refused by prefix, whatever a newer ClickHouse names their members.
_REFUSED_PREFIXES = ("s3", "hdfs", "azure", "iceberg", "deltalake", "hudi", "paimon", "remote", "url", "file",
                     "mysql", "postgres", "mongo", "executable", "python", "arrowflight")
#: Words refused anywhere outside strings: writing the result to a file (``INTO OUTFILE``) or reading one.
_REFUSED_WORDS = frozenset({"outfile", "infile"})
_WORD = re.compile(r"[A-Za-z0-9_]+")
_FORMAT_NAME = re.compile(r"[A-Za-z][A-Za-z0-9]*")


@dataclass(frozen=True)
class Statement:
    """A checked statement as it runs: ``text`` (whitespace and comments collapsed to single spaces, no
    trailing ``;``) and the name in its trailing ``FORMAT`` clause (``None`` without one)."""

    text: str
    format: str | None


def prepare_statement(sql: str, refused_functions: Iterable[str] = (),
                      max_bytes: int = MAX_STATEMENT_BYTES) -> Statement:
    """Check ``sql`` like :func:`check_statement` and return it normalized, with its output format.

    Raises:
        StatementRefusedError: the statement is refused, or longer than ``max_bytes`` once normalized.
    """
    tokens = list(_tokens(sql))
    _check_tokens(tokens, refused_functions)
    if tokens[-1][:2] == ("punct", ";"):
        tokens.pop()
    parts: list[str] = []
    end = tokens[0][2]
    for _kind, _text, start, stop in tokens:
        if start != end:
            parts.append(" ")
        parts.append(sql[start:stop])
        end = stop
    text = "".join(parts)
    if len(text.encode()) > max_bytes:
        raise StatementRefusedError(f"statement of {len(text.encode())} bytes (whitespace and comments collapsed) is "
                               f"over the {max_bytes} served", 393)
    fmt = None
    if len(tokens) >= 3 and tokens[-2][0] == "word" and tokens[-2][1].upper() == "FORMAT" \
            and tokens[-1][0] == "word" and _FORMAT_NAME.fullmatch(tokens[-1][1]):
        fmt = tokens[-1][1]
    return Statement(text, fmt)


def check_statement(sql: str, refused_functions: Iterable[str] = ()) -> None:
    """Accept one read-only statement or raise :class:`StatementRefusedError` saying why not.

    The statement is tokenized the way ClickHouse does (strings with ``\\`` escapes and doubled quotes,
    quoted identifiers, ``--`` and ``/* */`` comments); anything ambiguous is refused rather than guessed:
    ``#`` comments, nested comments, ``$`` (heredocs), control characters, backslashes in quoted identifiers,
    unterminated strings, identifiers or comments. It must start with ``SELECT``, ``WITH``, ``SHOW``,
    ``DESCRIBE``, ``DESC``, ``EXPLAIN`` or ``EXISTS``, hold one statement (a trailing ``;`` is fine), call no
    function in :data:`REFUSED_FUNCTIONS` or ``refused_functions`` (any case, quoted or not) and not use
    ``INTO OUTFILE``.
    """
    _check_tokens(list(_tokens(sql)), refused_functions)


def _check_tokens(tokens: list[tuple[str, str, int, int]], refused_functions: Iterable[str]) -> None:
    refused = REFUSED_FUNCTIONS | {f.lower() for f in refused_functions}
    words = [(i, kind, text) for i, (kind, text, _s, _e) in enumerate(tokens) if kind in ("word", "ident")]
    if not tokens or tokens[0][0] != "word" or tokens[0][1].lower() not in _ALLOWED_FIRST:
        first = tokens[0][1] if tokens else ""
        raise StatementRefusedError(f"only SELECT, WITH, SHOW, DESCRIBE, EXPLAIN and EXISTS are served here, not "
                               f"{first[:40]!r}", 164)
    for i, (kind, text, _s, _e) in enumerate(tokens):
        if kind == "punct" and text == ";" and i != len(tokens) - 1:
            raise StatementRefusedError("one statement per query", 164)
    for i in range(len(tokens) - 2):
        if tokens[i][1].lower() == "system" and tokens[i + 1][:2] == ("punct", ".") \
                and tokens[i + 2][1].lower() in PRIVATE_SYSTEM_TABLES:
            raise StatementRefusedError(f"system.{tokens[i + 2][1]} is not served: it shows the store's paths, "
                                        "settings or users", 497)
    for i, kind, text in words:
        name = text.lower()
        if kind == "word" and name in _REFUSED_WORDS:
            raise StatementRefusedError(f"{text.upper()} is not allowed: the endpoint does not read or write files",
                                        497)
        called = i + 1 < len(tokens) and tokens[i + 1][:2] == ("punct", "(")
        if called and (name in refused or name.startswith(_REFUSED_PREFIXES)):
            raise StatementRefusedError(f"function {text}() is not allowed: it reaches outside the database", 497)


def _tokens(sql: str) -> Iterator[tuple[str, str, int, int]]:
    """(kind, text, start, end) of the significant tokens: ``word`` (bare), ``ident`` (quoted identifier,
    unquoted text), ``string`` and ``punct`` (one character), with their span in ``sql``. Whitespace and
    comments are dropped; raises :class:`StatementRefusedError` on what ClickHouse might read differently."""
    i, n = 0, len(sql)
    while i < n:
        c = sql[i]
        if c in " \t\n\r\f\v" or ord(c) > 0x7F:
            # ClickHouse skips Unicode whitespace and rejects other non-ASCII outside strings: a separator here.
            i += 1
        elif ord(c) < 0x20 or c == "\x7f":
            raise StatementRefusedError(f"control character {ord(c):#04x} outside a string")
        elif sql.startswith("--", i):
            # End at any line break: ending earlier than ClickHouse only makes more text checked.
            ends = [j for j in (sql.find("\n", i), sql.find("\r", i)) if j >= 0]
            i = min(ends) if ends else n
        elif sql.startswith("/*", i):
            end = sql.find("*/", i + 2)
            if end < 0:
                raise StatementRefusedError("unterminated /* comment")
            if "/*" in sql[i + 2:end]:
                raise StatementRefusedError("nested /* comments are not allowed")
            i = end + 2
        elif c in "'\"`":
            end, text = _quoted(sql, i)
            if c != "'" and "\\" in text:
                raise StatementRefusedError("backslash escapes in quoted identifiers are not allowed")
            yield ("string" if c == "'" else "ident", text.replace(c * 2, c), i, end)
            i = end
        elif c in "#$":
            raise StatementRefusedError(f"{c!r} outside a string is not allowed (comments and heredocs: use -- and "
                                        "'...')")
        elif (m := _WORD.match(sql, i)) is not None:
            yield ("word", m.group(), i, m.end())
            i = m.end()
        else:
            yield ("punct", c, i, i + 1)
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
    raise StatementRefusedError(f"unterminated {q}-quoted text")
