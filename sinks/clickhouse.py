"""ClickHouse access for argus: embedded chDB (``chdb://<dir>``) or a server (``http(s)://...``).

Both go through clickhouse-connect, so the code above this module does not care which. chDB locks its data
directory to one process, and a process can open only one chDB directory: the sink process owns it and
answers other processes' SQL through :mod:`sinks.query_server`. The client is not safe for concurrent use,
so every call here holds one lock.
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

from argus.errors import SinkError
from argus.settings import Settings
from sinks.tables import TABLES, Table, rows_to_arrow

__all__ = ["ClickHouseStore", "QueryResult"]

log = logging.getLogger(__name__)

_ROW_QUERY = re.compile(r"^\s*(\(|SELECT|WITH|SHOW|DESCRIBE|DESC|EXISTS|EXPLAIN)\b", re.IGNORECASE)


@dataclass(frozen=True)
class QueryResult:
    """Rows of a query: column names and row tuples (JSON-friendly values)."""

    columns: tuple[str, ...]
    rows: list[tuple[Any, ...]]

    def as_dicts(self) -> list[dict[str, Any]]:
        return [dict(zip(self.columns, r, strict=True)) for r in self.rows]


class ClickHouseStore:
    """A connection to the configured ClickHouse with argus's tables.

    Raises:
        SinkError: cannot connect, or the chDB directory is locked by another process (then use the
            sink's query endpoint, see ``argus sql``).
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.database = settings.clickhouse_database
        self._lock = threading.RLock()
        path = settings.chdb_path
        try:
            if path is not None:
                path.mkdir(parents=True, exist_ok=True)
                self._client = clickhouse_connect.get_client(dsn=f"chdb://{path}")
            else:
                self._client = clickhouse_connect.get_client(
                    dsn=settings.clickhouse_dsn, username=settings.clickhouse_user,
                    password=settings.clickhouse_password.reveal(),
                )
        except Exception as exc:
            msg = str(exc)
            if "Cannot lock file" in msg or "EmbeddedServer" in msg:
                raise SinkError(
                    f"chDB directory {path} is owned by another process (the argus sink); query it through "
                    f"`argus sql`, which uses the sink's endpoint on 127.0.0.1:{settings.query_port}") from exc
            raise SinkError(f"cannot connect to ClickHouse {settings.clickhouse_dsn}: {msg}") from exc
        self._is_chdb = path is not None

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
        """Create the database and every argus table if missing (idempotent)."""
        self.command(f"CREATE DATABASE IF NOT EXISTS `{self.database}`")
        for table in TABLES.values():
            self.command(table.ddl(self.database))
            for sql in table.migrations(self.database):
                self.command(sql)

    def insert(self, table: Table, rows: list[tuple[Any, ...]]) -> None:
        """Insert ``rows`` into ``table`` as one Arrow block. Raises :class:`SinkError`."""
        if not rows:
            return
        self.insert_arrow(table.name, rows_to_arrow(table, rows))

    def insert_arrow(self, table_name: str, data: pa.Table) -> None:
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
                if not _ROW_QUERY.match(sql):
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


def _plain(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return value
