"""ClickHouse access for argus: embedded chDB (``chdb://<dir>``) or a server (``http(s)://...``).

Both go through clickhouse-connect, so the code above this module does not care which. chDB locks its data
directory to one process, and a process can open only one chDB directory: the sink process owns it and
answers other processes' SQL through :mod:`argus.sinks.query_server` (behind the query service,
:mod:`argus.sinks.query_service`). The client is not safe for concurrent use,
so every call here holds one lock. :meth:`ClickHouseStore.reader` opens a second, read-only connection with
its own lock and limits: chDB serves several connections of one process at once, so a long query on the
reader does not hold up the sink's inserts.
"""

from __future__ import annotations

import copy
import logging
import re
import threading
from dataclasses import dataclass
from typing import Any

import clickhouse_connect
import pyarrow as pa
from clickhouse_connect.driver.exceptions import OperationalError

from argus.core.errors import SinkError
from argus.core.settings import ClickHouseSettings
from argus.sinks.tables import Table, rows_to_arrow, schema_ddl

__all__ = ["ClickHouseStore", "QueryResult", "is_transient", "sql_string"]

log = logging.getLogger(__name__)

_ROW_QUERY = re.compile(r"^\s*(\(|SELECT|WITH|SHOW|DESCRIBE|DESC|EXISTS|EXPLAIN)\b", re.IGNORECASE)
_CODE = re.compile(r"\bCode: (\d+)")
#: ClickHouse error codes that say nothing about the rows, so the same insert may pass later: unknown table or
#: database (dropped under the sink; it recreates them), timeouts, too many queries, network, memory, read-only
#: table, disk full, too many parts, replicas, cancelled, system and Keeper errors. Every other code is about
#: the data.
_TRANSIENT_CODES = frozenset({60, 81, 159, 160, 202, 209, 210, 241, 242, 243, 252, 285, 394, 425, 999})


@dataclass(frozen=True)
class QueryResult:
    """Rows of a query: column names and row tuples (JSON-friendly values)."""

    columns: tuple[str, ...]
    rows: list[tuple[Any, ...]]

    def as_dicts(self) -> list[dict[str, Any]]:
        return [dict(zip(self.columns, r, strict=True)) for r in self.rows]


class ClickHouseStore:
    """A connection to the configured ClickHouse with argus's tables.

    Args:
        clickhouse: where and as whom (``settings.clickhouse``); its ``query_port`` only names the sink's
            endpoint when the chDB directory is taken.
        client_settings: ClickHouse settings applied to every statement of this connection.

    Raises:
        SinkError: cannot connect, or the chDB directory is locked by another process (then use the
            sink's query endpoint, see ``argus sql``).
    """

    def __init__(self, clickhouse: ClickHouseSettings, client_settings: dict[str, Any] | None = None) -> None:
        self.clickhouse = settings = clickhouse
        self.database = settings.database
        self._lock = threading.RLock()
        #: Settings applied to every statement of this connection (in order; see :meth:`reader`).
        self.client_settings = dict(client_settings or {})
        if settings.cluster and "readonly" not in self.client_settings:
            # Inserts go to Distributed tables, which by default queue the rows on the receiving server and
            # forward them later: the sink would commit Kafka offsets for rows no shard holds yet (lost with
            # that server's disk). Synchronous: an insert returns once every shard it touches took its rows.
            self.client_settings = {"insert_distributed_sync": 1, **self.client_settings}
        path = settings.chdb_path
        try:
            if path is not None:
                path.mkdir(parents=True, exist_ok=True)
                self._client = clickhouse_connect.get_client(dsn=f"chdb://{path}", settings=self.client_settings)
            else:
                self._client = clickhouse_connect.get_client(
                    dsn=settings.dsn, username=settings.user,
                    password=settings.password.reveal(), settings=self.client_settings,
                )
        except Exception as exc:
            msg = str(exc)
            if "Cannot lock file" in msg or "EmbeddedServer" in msg:
                raise SinkError(
                    f"chDB directory {path} is owned by another process (the argus sink); query it through "
                    f"`argus sql` or the query service (`argus query-service`, ClickHouse's HTTP interface), "
                    f"which use the sink's endpoint on 127.0.0.1:{settings.query_port}") from exc
            raise SinkError(f"cannot connect to ClickHouse {settings.dsn}: {msg}") from exc
        self._is_chdb = path is not None
        self.read_only = str(self.client_settings.get("readonly", "0")) != "0"

    def reader(self, limits: dict[str, Any]) -> ClickHouseStore:
        """A second connection to the same ClickHouse for other users' queries: ``readonly=1`` after
        ``limits`` (ClickHouse settings such as ``max_execution_time`` in seconds, ``max_result_rows``), so a
        query can change neither data nor the limits (``readonly=1`` refuses ``SETTINGS`` clauses).

        It has its own client and lock: a long query there never waits on, or holds up, this store's inserts.

        Raises:
            SinkError: the connection or one of the settings was refused.
        """
        # readonly goes last: once it is set, the session refuses to change any other setting.
        return ClickHouseStore(self.clickhouse, {**limits, "readonly": 1}).with_database(self.database)
    def with_database(self, database: str) -> ClickHouseStore:
        """A view of this connection that uses another database (same client and lock).

        One process can open only one chDB directory; this is how one process serves several databases.
        """
        view = copy.copy(self)
        view.database = database
        return view

    @property
    def embedded(self) -> bool:
        return self._is_chdb

    def ensure_schema(self) -> None:
        """Create the database, every argus table and view if missing (idempotent), on the configured
        ``clickhouse_cluster`` if one is set (:func:`argus.sinks.tables.schema_ddl`).

        Raises:
            SinkError: ClickHouse refused a statement.
            ConfigError: the database is no plain name while a cluster is set.
        """
        for sql in schema_ddl(self.database, self.clickhouse.cluster):
            self.command(sql)

    def insert(self, table: Table, rows: list[tuple[Any, ...]]) -> None:
        """Insert ``rows`` into ``table`` as one Arrow block.

        Raises:
            SinkError: the rows do not fit the table's types (e.g. an Int32 column given 2**31) or ClickHouse
                refused the insert; :func:`is_transient` on it tells a retry from bad rows.
        """
        if not rows:
            return
        try:
            data = rows_to_arrow(table, rows)
        except Exception as exc:  # pyarrow raises ArrowInvalid, OverflowError, TypeError, ... per bad value
            raise SinkError(f"rows for {table.name} do not fit its columns: {exc}") from exc
        self.insert_arrow(table.name, data)

    def insert_arrow(self, table_name: str, data: pa.Table) -> None:
        """Insert an Arrow table as it is. Raises :class:`SinkError`."""
        try:
            with self._lock:
                self._client.insert_arrow(f"`{self.database}`.`{table_name}`", data)
        except Exception as exc:
            raise SinkError(f"insert of {data.num_rows} rows into {table_name} failed: {exc}") from exc

    def command(self, sql: str) -> None:
        try:
            with self._lock:
                self._client.command(sql)
        except Exception as exc:
            raise SinkError(f"ClickHouse command failed: {exc}\n  SQL: {sql[:300]}") from exc

    def query(self, sql: str) -> QueryResult:
        """Run ``sql``; statements without a result (DDL, OPTIMIZE, ...) return no rows."""
        try:
            with self._lock:
                if not self.read_only and not _ROW_QUERY.match(sql):
                    self._client.command(sql)
                    return QueryResult((), [])
                res = self._client.query(sql)
        except Exception as exc:
            raise SinkError(f"query failed: {exc}") from exc
        return QueryResult(tuple(res.column_names), [tuple(_plain(v) for v in row) for row in res.result_rows])

    def close(self) -> None:
        with self._lock:
            try:
                self._client.close()
            except Exception as exc:
                log.debug("closing ClickHouse client: %s", exc)


def is_transient(exc: BaseException) -> bool:
    """Whether a failed ClickHouse call may pass when retried unchanged (connection lost, timeout, memory,
    too many parts), as opposed to bad rows or a bad statement. Looks through :class:`SinkError` wrappers."""
    cause: BaseException | None = exc
    while isinstance(cause, SinkError) and cause.__cause__ is not None:
        cause = cause.__cause__
    if cause is None or isinstance(cause, SinkError):
        return False
    code = _CODE.search(str(cause))
    if code is not None:
        return int(code.group(1)) in _TRANSIENT_CODES
    return isinstance(cause, (OSError, OperationalError))


def _plain(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return value


def sql_string(value: str) -> str:
    """``value`` as a ClickHouse string literal (quoted, backslashes and quotes escaped), for SQL built from
    untrusted names: job ids, kernel names."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
