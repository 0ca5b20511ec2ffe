"""ClickHouse sinks of argus (embedded chDB or a server), the sink loop and its SQL endpoint."""

from argus.sinks.clickhouse import ClickHouseStore, QueryResult
from argus.sinks.query_server import QueryServer, run_query
from argus.sinks.tables import TABLES, Table
from argus.sinks.writer import SinkWriter

__all__ = ["TABLES", "ClickHouseStore", "QueryResult", "QueryServer", "SinkWriter", "Table", "run_query"]
