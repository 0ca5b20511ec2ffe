"""ClickHouse schema DDL for a cluster (``ARGUS_CLICKHOUSE_CLUSTER``) and unchanged DDL without one.

A real cluster (Keeper, several servers) cannot run here. What is checked instead: the statements' shape for
every table of ``TABLES`` (engine, Keeper path, ``ON CLUSTER``, Distributed sharding key, migrations, views);
that each ``_local`` table is exactly the single-node table plus replication; and, in a throwaway chDB in a
child process (chDB allows one data directory per process), that every cluster statement parses and that
the local tables, migrations and views run once the replication and ``ON CLUSTER`` are taken out.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest

from argus import cli
from argus.core.errors import ConfigError
from argus.core.settings import Settings
from argus.sinks import clickhouse
from argus.sinks.tables import LOCAL_SUFFIX, TABLES, VIEWS, schema_ddl

DB, CLUSTER = "metrics", "gpu-fleet_1"
ON = f" ON CLUSTER '{CLUSTER}'"
SERVER = "http://ch.example:8123"
_REPLICATED = re.compile(r"ReplicatedReplacingMergeTree\('([^']*)', '\{replica\}'(?:, (\w+))?\)")


def _single_node_ddl_as_before(database: str) -> list[str]:
    """The statements ``ClickHouseStore.ensure_schema`` ran before clusters existed, written out as it built
    them, so any change to the single-node DDL shows here."""
    out = [f"CREATE DATABASE IF NOT EXISTS `{database}`"]
    for t in TABLES.values():
        cols = [f"`{n}` {ty}" for n, ty, _ in t.columns] + list(t.aliases)
        engine = f"ReplacingMergeTree({t.version})" if t.version else "ReplacingMergeTree"
        out.append(f"CREATE TABLE IF NOT EXISTS `{database}`.`{t.name}` ({', '.join(cols)}) "
                   f"ENGINE = {engine} ORDER BY ({', '.join(t.order_by)})")
        out += [f"ALTER TABLE `{database}`.`{t.name}` ADD COLUMN IF NOT EXISTS `{n}` {ty}" for n, ty, _ in t.columns]
    out += [f"CREATE VIEW IF NOT EXISTS `{database}`.`{name}` AS " + select.replace("{db}", database)
            for name, select in VIEWS.items()]
    return out


def _creates(statements: list[str]) -> dict[str, str]:
    """``{table name: CREATE TABLE statement}``."""
    out = {}
    for sql in statements:
        m = re.match(r"CREATE TABLE IF NOT EXISTS `[^`]+`\.`([^`]+)`", sql)
        if m:
            out[m.group(1)] = sql
    return out


def _columns(create: str) -> str:
    """The parenthesized column list of a CREATE TABLE (up to the ENGINE clause)."""
    head = create.split(") ENGINE = ", 1)[0]
    return head.split(" (", 1)[1]


@pytest.mark.parametrize("database", ["argus", "test_abc123"])
def test_without_a_cluster_the_ddl_is_byte_identical_to_before(database: str) -> None:
    assert schema_ddl(database) == _single_node_ddl_as_before(database)
    assert schema_ddl(database, "") == schema_ddl(database)
    assert not any("CLUSTER" in s or "Replicated" in s or "Distributed" in s for s in schema_ddl(database))


def test_cluster_ddl_covers_every_table_with_a_replicated_local_and_a_distributed_table() -> None:
    statements = schema_ddl(DB, CLUSTER)
    assert statements[0] == f"CREATE DATABASE IF NOT EXISTS `{DB}`{ON}"
    assert all(ON in s for s in statements)
    creates = _creates(statements)
    assert set(creates) == {n for t in TABLES for n in (t, t + LOCAL_SUFFIX)}
    for name, table in TABLES.items():
        local, dist = creates[name + LOCAL_SUFFIX], creates[name]
        assert statements.index(local) < statements.index(dist)  # a Distributed table reads existing locals
        m = _REPLICATED.search(local)
        assert m is not None, local
        assert m.group(1) == f"/clickhouse/tables/{{shard}}/{DB}/{name}{LOCAL_SUFFIX}"
        assert m.group(2) == table.version  # the replacing version column as on one server (or none)
        assert local.endswith(f" ORDER BY ({', '.join(table.order_by)})")
        assert f"`{DB}`.`{name}{LOCAL_SUFFIX}`{ON} (" in local
        # The local table is the single-node table, renamed, ON CLUSTER and replicated: nothing else differs.
        plain = _REPLICATED.sub(lambda g: f"ReplacingMergeTree({g.group(2)})" if g.group(2) else "ReplacingMergeTree",
                                local.replace(ON, ""))
        assert plain == table.ddl(DB).replace(f"`{name}`", f"`{name}{LOCAL_SUFFIX}`", 1)
        assert dist.endswith(f" ENGINE = Distributed('{CLUSTER}', '{DB}', '{name}{LOCAL_SUFFIX}', "
                             f"{table.sharding_key})")
        assert f"`{DB}`.`{name}`{ON} (" in dist
        assert _columns(dist) == _columns(local)  # inserts and queries through `name` see every column


def test_sharding_key_keeps_duplicates_and_ranks_on_one_shard() -> None:
    for table in TABLES.values():
        cols = re.fullmatch(r"cityHash64\((.+)\)", table.sharding_key)
        assert cols is not None
        used = [c.strip().strip("`") for c in cols.group(1).split(",")]
        # Rows that replace each other have equal sorting keys, so they must hash alike: sorting-key columns only.
        assert set(used) <= set(table.order_by), table.name
        if "rank" in table.order_by:
            assert used == ["job_id", "rank"], table.name  # a rank's rows of every per-rank table on one shard
        elif "job_id" in table.order_by:
            assert used == ["job_id"], table.name
    assert TABLES["phases"].sharding_key == "cityHash64(`job_id`, `rank`)"
    assert TABLES["findings"].sharding_key == "cityHash64(`job_id`)"
    assert TABLES["dead_letters"].sharding_key == "cityHash64(`topic`, `partition`, `offset`, `stage`)"


def test_cluster_migrations_alter_the_local_then_the_distributed_table_on_the_cluster() -> None:
    statements = schema_ddl(DB, CLUSTER)
    for name, table in TABLES.items():
        alters = [s for s in statements if s.startswith("ALTER TABLE ") and re.match(
            rf"ALTER TABLE `{DB}`\.`{name}({LOCAL_SUFFIX})?`{ON} ", s)]
        assert [s.split("`")[3] for s in alters] == [name + LOCAL_SUFFIX, name]
        assert statements.index(alters[0]) > statements.index(_creates(statements)[name])
        for sql in alters:
            adds = sql.split(f"{ON} ", 1)[1]
            assert adds == ", ".join(f"ADD COLUMN IF NOT EXISTS `{n}` {t}" for n, t, _ in table.columns)
        assert table.migrations(DB, CLUSTER) == alters


def test_cluster_views_are_on_the_cluster_and_read_the_distributed_tables() -> None:
    statements = schema_ddl(DB, CLUSTER)
    for name, select in VIEWS.items():
        view = f"CREATE VIEW IF NOT EXISTS `{DB}`.`{name}`{ON} AS " + select.replace("{db}", DB)
        assert view in statements
        assert statements.index(view) > max(statements.index(s) for s in _creates(statements).values())
        assert LOCAL_SUFFIX not in view  # FINAL through Distributed: each shard deduplicates its own rows


@pytest.mark.parametrize("cluster", ["a b", "x'y", "{cluster}", "1abc", "a/b", "c\\d", "é", "c" * 129, "-x"])
def test_an_invalid_cluster_name_fails_at_start_up(cluster: str) -> None:
    with pytest.raises(ConfigError, match="clickhouse_cluster"):
        Settings.load(env={"ARGUS_CLICKHOUSE_CLUSTER": cluster, "ARGUS_CLICKHOUSE_DSN": SERVER})
    with pytest.raises(ConfigError, match="clickhouse_cluster"):
        schema_ddl(DB, cluster)


def test_cluster_setting_from_env_needs_a_server_and_a_plain_database() -> None:
    assert Settings.load(env={}).clickhouse_cluster == ""
    s = Settings.load(env={"ARGUS_CLICKHOUSE_CLUSTER": CLUSTER, "ARGUS_CLICKHOUSE_DSN": SERVER})
    assert s.clickhouse_cluster == CLUSTER
    assert s.to_env()["ARGUS_CLICKHOUSE_CLUSTER"] == CLUSTER  # child processes get it too
    with pytest.raises(ConfigError, match="chDB"):
        Settings.load(env={"ARGUS_CLICKHOUSE_CLUSTER": CLUSTER})
    with pytest.raises(ConfigError, match="clickhouse_database"):
        Settings.load(env={}, clickhouse_dsn=SERVER, clickhouse_cluster=CLUSTER, clickhouse_database="a'b")
    with pytest.raises(ConfigError, match="clickhouse_database"):
        schema_ddl("a/b", CLUSTER)
    # Without a cluster the database name is not restricted, as before.
    assert Settings.load(env={}, clickhouse_database="odd name").clickhouse_database == "odd name"


class _FakeClient:
    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = settings
        self.commands: list[str] = []

    def command(self, sql: str) -> None:
        self.commands.append(sql)

    def close(self) -> None:
        pass


@pytest.mark.parametrize("cluster", ["", CLUSTER])
def test_ensure_schema_runs_the_ddl_and_cluster_inserts_are_synchronous(
        cluster: str, monkeypatch: pytest.MonkeyPatch) -> None:
    clients: list[_FakeClient] = []

    def get_client(**kw: Any) -> _FakeClient:
        clients.append(_FakeClient(dict(kw["settings"])))
        return clients[-1]

    monkeypatch.setattr(clickhouse.clickhouse_connect, "get_client", get_client)
    settings = Settings.load(env={}, clickhouse_dsn=SERVER, clickhouse_cluster=cluster, clickhouse_database=DB)
    store = clickhouse.ClickHouseStore(settings.clickhouse)
    store.ensure_schema()
    assert clients[0].commands == schema_ddl(DB, cluster)
    # On a cluster an insert returns once the shards hold the rows (the sink commits Kafka offsets after it).
    assert clients[0].settings == ({"insert_distributed_sync": 1} if cluster else {})
    store.reader({"max_execution_time": 5})
    assert clients[1].settings == {"max_execution_time": 5, "readonly": 1}


def test_cli_prints_the_cluster_ddl_without_connecting(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_connection(**kw: Any) -> None:
        raise AssertionError("argus ddl must not connect")

    monkeypatch.setattr(clickhouse.clickhouse_connect, "get_client", no_connection)
    for key in [k for k in os.environ if k.startswith("ARGUS_")]:
        monkeypatch.delenv(key)
    out = io.StringIO()
    with redirect_stdout(out):
        assert cli.main(["ddl", "--cluster", CLUSTER, "--database", DB]) == 0
    assert out.getvalue().splitlines() == [s + ";" for s in schema_ddl(DB, CLUSTER)]
    out = io.StringIO()
    with redirect_stdout(out):
        assert cli.main(["ddl"]) == 0  # no cluster configured: the single-node DDL of the default database
    assert out.getvalue().splitlines() == [s + ";" for s in schema_ddl("argus")]
    with redirect_stdout(io.StringIO()):
        assert cli.main(["ddl", "--cluster", "bad name"]) == 1


_CHDB_CHECK = r"""
import json, re, sys
from chdb import session
from argus.sinks.tables import LOCAL_SUFFIX, TABLES, VIEWS, schema_ddl

db, cluster = sys.argv[2], sys.argv[3]
on = f" ON CLUSTER '{cluster}'"
s = session.Session(sys.argv[1])
q = lambda sql: s.query(sql, "JSONCompact")
report = {"parsed": 0, "run": 0}
statements = schema_ddl(db, cluster)
for sql in statements:
    text = json.loads(q("SELECT formatQuery(" + "'" + sql.replace("\\", "\\\\").replace("'", "\\'") + "')")
                      .bytes())["data"][0][0]
    assert "ON CLUSTER" in text, text
    report["parsed"] += 1
# What one replica of one shard would run: ON CLUSTER and replication out. The Distributed tables cannot
# exist without the cluster; a Merge table over each local one, with the Distributed table's columns, stands
# in for it, so the migrations and the views run against the same names.
replicated = re.compile(r"ReplicatedReplacingMergeTree\('[^']*', '\{replica\}'(?:, (\w+))?\)")
replica = []
for sql in statements:
    sql = sql.replace(on, "")
    sql = replicated.sub(lambda g: f"ReplacingMergeTree({g.group(1)})" if g.group(1) else "ReplacingMergeTree", sql)
    m = re.match(r"(CREATE TABLE IF NOT EXISTS `[^`]+`\.`([^`]+)` .*) ENGINE = Distributed\(", sql)
    replica.append(f"{m.group(1)} ENGINE = Merge('{db}', '^{m.group(2)}{LOCAL_SUFFIX}$')" if m else sql)
for sql in replica + replica:  # twice: the sink runs the DDL at every start
    q(sql)
report["run"] = len(replica)
describe = lambda t: json.loads(q(f"DESCRIBE TABLE `{db}`.`{t}`").bytes())["data"]
report["same_columns"] = all(describe(t) == describe(t + LOCAL_SUFFIX) for t in TABLES)
# Two copies of one summary (a re-delivery with more events): the view sees the newer one once.
row = "('j', 'k', 7, 3, 10, 20, {n}, 1, [{n}], [1], [2], [1], [2], [{n}], 0)"
q(f"INSERT INTO `{db}`.`kernel_summaries{LOCAL_SUFFIX}` (job_id, kernel, stream, rank, window_start_ns, "
  "window_end_ns, n_events, n_clusters, cluster_count, cluster_p50_ns, cluster_p99_ns, cluster_min_ns, "
  "cluster_max_ns, cluster_sum_ns, piece) VALUES " + row.format(n=5) + ", " + row.format(n=7))
report["view"] = json.loads(q(f"SELECT n_events, pieces FROM `{db}`.kernel_windows").bytes())["data"]
print(json.dumps(report))
"""


@pytest.mark.slow
def test_chdb_accepts_the_cluster_ddl_as_one_replica_runs_it(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", _CHDB_CHECK, str(tmp_path / "chdb"), DB, CLUSTER],
                          capture_output=True, text=True, cwd=root, timeout=240,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    n = len(schema_ddl(DB, CLUSTER))
    assert report["parsed"] == n and report["run"] == n
    assert report["same_columns"] is True
    assert report["view"] == [[7, 1]]
