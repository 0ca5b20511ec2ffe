"""Hosts and incidents in ClickHouse (the embedded chDB): the columns land, re-deliveries stay single, users can
GROUP BY host and by incident, rows of a table created before them read as their own incidents, and
``argus findings`` reads them back incidents first."""

from __future__ import annotations

import dataclasses
import uuid

from argus.core.kinds import FindingKind
from argus.core.settings import Settings
from argus.detectors.incidents import form_incidents
from argus.sinks.clickhouse import ClickHouseStore
from argus.sinks.findings_query import fetch_findings
from argus.sinks.tables import TABLES
from tests.unit.test_incidents import TOPO, finding, slow_host_findings


def _rows(findings: list) -> list[tuple[object, ...]]:  # type: ignore[type-arg]
    table = TABLES["findings"]
    return [row for f in findings for row in table.rows(f)]


def test_hosts_and_incidents_land_and_group(chdb_store: ClickHouseStore) -> None:
    db = f"inc_{uuid.uuid4().hex[:8]}"
    store = chdb_store.with_database(db)
    store.ensure_schema()
    straggler = finding(FindingKind.RANK_DEGRADED, (40,), 9e9)  # on node0005, larger than the host's
    found = form_incidents([*slow_host_findings(kernels=2), straggler], TOPO)
    table = TABLES["findings"]
    store.insert(table, _rows(found))
    store.insert(table, _rows(found))  # delivered again: nothing doubled
    by_host = store.query(f"SELECT host, count() FROM `{db}`.findings FINAL ARRAY JOIN hosts AS host "
                          "GROUP BY host ORDER BY host").rows
    assert [(h, int(n)) for h, n in by_host] == [("node0001", 1 + 8 + 16), ("node0005", 1)]
    by_incident = store.query(f"SELECT incident_id, count(), groupUniqArray(kind) FROM `{db}`.findings FINAL "
                              "GROUP BY incident_id ORDER BY count() DESC").rows
    node = next(f for f in found if f.kind is FindingKind.NODE_DEGRADED)
    assert [(i, int(n), sorted(k)) for i, n, k in by_incident] == [
        (node.finding_id, 25, ["kernel_degraded", "node_degraded", "rank_degraded"]),
        (straggler.finding_id, 1, ["rank_degraded"])]

    # argus findings: the straggler's incident first (larger impact), then the host's, its lead first.
    settings = Settings.load(env={}, clickhouse_database=db)
    got = fetch_findings(settings, "j", query=store.query)
    assert [f["kind"] for f in got[:3]] == ["rank_degraded", "node_degraded", "rank_degraded"]
    assert got[1]["hosts"] == ["node0001"] and got[1]["incident_id"] == got[1]["finding_id"] == node.finding_id
    assert {f["incident_id"] for f in got[1:]} == {node.finding_id} and len(got) == 26


def test_a_findings_table_from_before_incidents_gains_the_columns_and_reads_as_own_incidents(
        chdb_store: ClickHouseStore) -> None:
    db = f"old_{uuid.uuid4().hex[:8]}"
    store = chdb_store.with_database(db)
    table = TABLES["findings"]
    old = dataclasses.replace(table, columns=table.columns[:-3], rows=lambda f: [next(iter(table.rows(f)))[:-3]])
    store.command(f"CREATE DATABASE IF NOT EXISTS `{db}`")
    store.command(old.ddl(db))
    before = [finding(FindingKind.KERNEL_DEGRADED, (3,), 2e9, kernel="g", stream=7),
              finding(FindingKind.RANK_DEGRADED, (3,), 1e9)]
    store.insert(old, [row for f in before for row in old.rows(f)])
    store.ensure_schema()  # the migration adds hosts, incident_id and gpus
    rows = store.query(f"SELECT finding_id, hosts, incident_id, gpus FROM `{db}`.findings FINAL "
                       "ORDER BY finding_id").rows
    assert [(list(h), i, list(g)) for _, h, i, g in rows] == [([], "", []), ([], "", [])]
    got = fetch_findings(Settings.load(env={}, clickhouse_database=db), "j", query=store.query)
    assert [f["incident_id"] for f in got] == [f["finding_id"] for f in got]  # each its own incident
    assert [f["kind"] for f in got] == ["kernel_degraded", "rank_degraded"]
