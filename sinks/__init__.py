"""ClickHouse sinks of argus (embedded chDB or a server), the sink loop and its SQL endpoint."""

from sinks.clickhouse import ClickHouseStore, QueryResult
from sinks.query_server import QueryServer, run_query
from sinks.tables import TABLES, Table
from sinks.writer import SinkWriter

__all__ = ["TABLES", "ClickHouseStore", "QueryResult", "QueryServer", "SinkWriter", "Table", "run_query"]
