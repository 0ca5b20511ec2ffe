"""ClickHouse tables of argus and the mapping of each record type to their rows.

Every table is a ``ReplacingMergeTree`` whose sorting key is the record's natural identity, so a record that
Kafka re-delivers (at-least-once) replaces its earlier copy instead of doubling it. Query with ``FINAL``
(or ``argMax``) to see the deduplicated view before background merges have run.

Details and reasoning: docs/internals/sinks.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from argus.core.settings import check_identifier
from argus.schemas.records import (
    CpuStack,
    DeadLetter,
    Finding,
    Heartbeat,
    JobLifecycle,
    JobTopology,
    KernelBatch,
    KernelSummary,
    PhaseBatch,
    Step,
)
from argus.topics import Topic

__all__ = ["LOCAL_SUFFIX", "PHASE_MARKER_IDX", "TABLES", "TABLE_OF_TOPIC", "VIEWS", "Table", "rows_to_arrow",
           "schema_ddl"]

_I64, _I32, _STR = pa.int64(), pa.int32(), pa.string()
#: Suffix of the per-shard table behind each ``Distributed`` table on a cluster.
LOCAL_SUFFIX = "_local"


@dataclass(frozen=True)
class Table:
    """One table: its columns (name, ClickHouse type, Arrow type), engine and how records become rows."""

    name: str
    columns: tuple[tuple[str, str, pa.DataType], ...]
    order_by: tuple[str, ...]
    rows: Callable[[Any], Iterable[tuple[Any, ...]]]
    version: str | None = None
    aliases: tuple[str, ...] = ()

    def ddl(self, database: str) -> str:
        """``CREATE TABLE IF NOT EXISTS`` of this table on one server (or the embedded chDB)."""
        engine = f"ReplacingMergeTree({self.version})" if self.version else "ReplacingMergeTree"
        return (f"CREATE TABLE IF NOT EXISTS `{database}`.`{self.name}` ({self._column_list()}) "
                f"ENGINE = {engine} ORDER BY ({', '.join(self.order_by)})")

    def cluster_ddl(self, database: str, cluster: str) -> list[str]:
        """``CREATE TABLE IF NOT EXISTS ... ON CLUSTER`` of this table on ``cluster``: first ``<name>_local``,
        a ``ReplicatedReplacingMergeTree`` (Keeper path ``/clickhouse/tables/{shard}/<database>/<name>_local``,
        replica ``{replica}``: the servers' macros) with this table's columns, version and sorting key, then
        ``<name>``, a ``Distributed`` table over the local ones with the same columns, sharded by
        :attr:`sharding_key`. Names are not checked here (see :func:`schema_ddl`)."""
        local, on = self.name + LOCAL_SUFFIX, f" ON CLUSTER '{cluster}'"
        replicated = f"'/clickhouse/tables/{{shard}}/{database}/{local}', '{{replica}}'"
        if self.version:
            replicated += f", {self.version}"
        return [
            f"CREATE TABLE IF NOT EXISTS `{database}`.`{local}`{on} ({self._column_list()}) "
            f"ENGINE = ReplicatedReplacingMergeTree({replicated}) ORDER BY ({', '.join(self.order_by)})",
            f"CREATE TABLE IF NOT EXISTS `{database}`.`{self.name}`{on} ({self._column_list()}) "
            f"ENGINE = Distributed('{cluster}', '{database}', '{local}', {self.sharding_key})",
        ]

    @property
    def sharding_key(self) -> str:
        """The expression that picks a row's shard on a cluster: ``cityHash64(`job_id`, `rank`)`` for the
        per-rank tables, ``cityHash64(`job_id`)`` for the other tables of a job (``jobs``, ``findings``), a
        hash of the whole sorting key for ``dead_letters``."""
        # ReplacingMergeTree replaces a row only by another in the same shard (merges and FINAL are per
        # shard), so a re-delivered copy must land where its first copy did: the key may use sorting-key
        # columns only. Within that, (job, rank) and not the job alone: a 10,240-rank job with 150 phases per
        # rank and 200 ms steps writes 7.7 M phase rows/s (docs/scaling.md), far more than one shard takes,
        # so a big job's rows spread over all shards, while each rank's rows stay together: FINAL, the
        # per-rank merge of the view kernel_windows (grouped by job, kernel, stream, rank, window) and joins
        # on (job_id, rank) between per-rank tables (steps, topology, ...) resolve shard-locally.
        # dead_letters' job_id is parsed from a possibly broken message key and is not in its sorting key:
        # it hashes its sorting key, which identifies the message.
        cols = self.order_by
        if "job_id" in cols:
            cols = tuple(c for c in ("job_id", "rank") if c in cols)
        return f"cityHash64({', '.join(f'`{c}`' for c in cols)})"

    def migrations(self, database: str, cluster: str = "") -> list[str]:
        """``ADD COLUMN IF NOT EXISTS`` for every column, so tables created by an older argus gain new ones
        (e.g. the findings' impact columns of schema v2); no-ops on current tables.

        On a ``cluster``: one ``ALTER ... ON CLUSTER`` per table (each is a round through Keeper to every
        server), the ``_local`` tables first, then the ``Distributed`` one, whose columns must match."""
        if not cluster:
            return [f"ALTER TABLE `{database}`.`{self.name}` ADD COLUMN IF NOT EXISTS `{n}` {t}"
                    for n, t, _ in self.columns]
        adds = ", ".join(f"ADD COLUMN IF NOT EXISTS `{n}` {t}" for n, t, _ in self.columns)
        return [f"ALTER TABLE `{database}`.`{name}` ON CLUSTER '{cluster}' {adds}"
                for name in (self.name + LOCAL_SUFFIX, self.name)]

    def _column_list(self) -> str:
        return ", ".join([f"`{n}` {t}" for n, t, _ in self.columns] + list(self.aliases))

    @property
    def arrow_schema(self) -> pa.Schema:
        return pa.schema([(n, a) for n, _, a in self.columns])


def rows_to_arrow(table: Table, rows: list[tuple[Any, ...]]) -> pa.Table:
    """Column-major Arrow table of ``rows`` for an ``insert_arrow``."""
    cols = list(zip(*rows, strict=True)) if rows else [() for _ in table.columns]
    return pa.Table.from_arrays([pa.array(c, type=a) for c, (_, _, a) in zip(cols, table.columns, strict=True)],
                                schema=table.arrow_schema)


def _step_rows(r: Step) -> Iterable[tuple[Any, ...]]:
    yield (r.job_id, r.rank, r.step, r.start_ns, r.wall_ns, r.gpu_ns)


def _phase_rows(r: PhaseBatch) -> Iterable[tuple[Any, ...]]:
    if not r.kinds:
        # A rank's step without phases (an imported trace without annotations) is still a batch the job's END
        # counts: one marker row, idx -1, so the store can tell it arrived (``findings --wait``).
        yield (r.job_id, r.rank, r.step, PHASE_MARKER_IDX, "", "", "", -1, 0, 0)
    for i, (kind, name, group, stream, start, dur) in enumerate(
            zip(r.kinds, r.names, r.groups, r.streams, r.start_ns, r.duration_ns, strict=True)):
        yield (r.job_id, r.rank, r.step, i, kind.value, name, group.value, stream, start, dur)


def _summary_rows(r: KernelSummary) -> Iterable[tuple[Any, ...]]:
    at, pieces = 0, r.pieces()
    for i, n in enumerate(r.n_clusters):
        sl = slice(at, at + n)
        at += n
        yield (r.job_id, r.kernel, r.stream, r.rank[i], r.window_start_ns[i], r.window_end_ns[i],
               r.n_events[i], n, list(r.cluster_count[sl]), list(r.cluster_p50_ns[sl]),
               list(r.cluster_p99_ns[sl]), list(r.cluster_min_ns[sl]), list(r.cluster_max_ns[sl]),
               list(r.cluster_sum_ns[sl]), pieces[i])


def _topology_rows(r: JobTopology) -> Iterable[tuple[Any, ...]]:
    for i in range(r.world_size):
        yield (r.job_id, r.rank[i], r.host[i], r.dp_group[i], r.tp_group[i], r.pp_group[i], r.ep_group[i],
               r.pp_stage[i], r.world_size, r.dp_size, r.tp_size, r.pp_size, r.ep_size, r.gpu_of(i))


def _job_rows(r: JobLifecycle) -> Iterable[tuple[Any, ...]]:
    yield (r.job_id, r.event.value, r.part, r.time_ns, r.world_size, r.source, r.kernel_events, r.steps,
           r.phase_batches, list(r.finding_ids), r.reason, r.last_step)


def _finding_rows(r: Finding) -> Iterable[tuple[Any, ...]]:
    yield (r.job_id, r.finding_id, r.level.value, r.kind.value, list(r.ranks), r.phase, r.kernel, r.stream,
           list(r.steps), r.score, r.evidence_json, r.time_ns, r.impact_ns_per_step, r.impact_ns, r.detector_version,
           list(r.hosts), r.incident, list(r.gpus))


def _dead_letter_rows(r: DeadLetter) -> Iterable[tuple[Any, ...]]:
    events = 0
    if r.topic.endswith(Topic.KERNELS.value):
        try:
            events = len(KernelBatch.decode(r.payload))
        except Exception:
            events = 0
    job_id = (r.key or b"").split(b"/", 1)[0].decode("utf-8", "replace")
    yield (r.topic, r.partition, r.offset, r.stage, job_id, r.key, r.payload, r.reason, r.time_ns, events)


def _cpu_stack_rows(r: CpuStack) -> Iterable[tuple[Any, ...]]:
    yield (r.job_id, r.rank, r.finding_id, r.time_ns, r.host, r.pid, r.stacks_json)


def _heartbeat_rows(r: Heartbeat) -> Iterable[tuple[Any, ...]]:
    yield (r.job_id, r.rank, r.time_ns, r.step, r.phase, r.phase_kind.value if r.phase_kind else "",
           r.collective.value if r.collective else "", r.group.value, r.group_index, r.seq, r.in_flight_since_ns,
           int(r.kernels_paused), ",".join(p.value for p in r.pause_reasons), r.control_ack, r.control_error)


#: ``idx`` of the marker row of a PhaseBatch without phases (see ``_phase_rows``).
PHASE_MARKER_IDX = -1
_LC = "LowCardinality(String)"
_A64 = "Array(Int64)"
_AL = pa.list_(_I64)

TABLES: dict[str, Table] = {t.name: t for t in (
    Table("steps", (("job_id", _LC, _STR), ("rank", "Int32", _I32), ("step", "Int64", _I64),
                    ("start_ns", "Int64", _I64), ("wall_ns", "Int64", _I64), ("gpu_ns", "Nullable(Int64)", _I64)),
          ("job_id", "rank", "step"), _step_rows,
          aliases=("`start_time` DateTime64(9) ALIAS fromUnixTimestamp64Nano(start_ns)",)),
    Table("phases", (("job_id", _LC, _STR), ("rank", "Int32", _I32), ("step", "Int64", _I64), ("idx", "Int32", _I32),
                     ("kind", _LC, _STR), ("name", _LC, _STR), ("grp", _LC, _STR), ("stream", "Int64", _I64),
                     ("start_ns", "Int64", _I64), ("duration_ns", "Int64", _I64)),
          ("job_id", "rank", "step", "idx"), _phase_rows),
    Table("kernel_summaries", (
        ("job_id", _LC, _STR), ("kernel", _LC, _STR), ("stream", "Int64", _I64), ("rank", "Int32", _I32),
        ("window_start_ns", "Int64", _I64), ("window_end_ns", "Int64", _I64), ("n_events", "Int64", _I64),
        ("n_clusters", "Int32", _I32), ("cluster_count", _A64, _AL), ("cluster_p50_ns", _A64, _AL),
        ("cluster_p99_ns", _A64, _AL), ("cluster_min_ns", _A64, _AL), ("cluster_max_ns", _A64, _AL),
        ("cluster_sum_ns", _A64, _AL), ("piece", "Int64", _I64)),
          ("job_id", "kernel", "stream", "rank", "window_start_ns", "piece"), _summary_rows, version="n_events",
          aliases=("`window_start` DateTime64(9) ALIAS fromUnixTimestamp64Nano(window_start_ns)",)),
    Table("topology", (("job_id", _LC, _STR), ("rank", "Int32", _I32), ("host", _LC, _STR),
                       ("dp_group", "Int32", _I32), ("tp_group", "Int32", _I32), ("pp_group", "Int32", _I32),
                       ("ep_group", "Int32", _I32), ("pp_stage", "Int32", _I32), ("world_size", "Int32", _I32),
                       ("dp_size", "Int32", _I32), ("tp_size", "Int32", _I32), ("pp_size", "Int32", _I32),
                       ("ep_size", "Int32", _I32),
                       # v3: the rank's GPU (CUDA UUID, else PCI bus id, else cuda:<index>; '' unknown).
                       ("gpu", "String", _STR)),
          ("job_id", "rank"), _topology_rows),
    Table("jobs", (("job_id", _LC, _STR), ("event", _LC, _STR), ("part", _LC, _STR), ("time_ns", "Int64", _I64),
                   ("world_size", "Int32", _I32), ("source", _LC, _STR), ("kernel_events", "Nullable(Int64)", _I64),
                   ("steps", "Nullable(Int64)", _I64), ("phase_batches", "Nullable(Int64)", _I64),
                   ("finding_ids", "Array(String)", pa.list_(_STR)),
                   # ABANDONED: why argus closed the job, and the last step it had seen ('' and -1 otherwise).
                   ("reason", "String", _STR), ("last_step", "Int64", _I64)),
          ("job_id", "event", "part"), _job_rows),
    Table("findings", (("job_id", _LC, _STR), ("finding_id", "String", _STR), ("level", _LC, _STR),
                       ("kind", _LC, _STR), ("ranks", "Array(Int32)", pa.list_(_I32)),
                       ("phase", "Nullable(String)", _STR), ("kernel", "Nullable(String)", _STR),
                       ("stream", "Nullable(Int64)", _I64), ("steps", _A64, _AL), ("score", "Float64", pa.float64()),
                       ("evidence_json", "String", _STR), ("time_ns", "Int64", _I64),
                       ("impact_ns_per_step", "Float64", pa.float64()), ("impact_ns", "Float64", pa.float64()),
                       ("detector_version", _LC, _STR),
                       # Schema v4: the hosts of its ranks, and its incident (the lead's finding_id; a finding
                       # written before v4 is its own): GROUP BY arrayJoin(hosts) or incident_id.
                       ("hosts", "Array(LowCardinality(String))", pa.list_(_STR)), ("incident_id", "String", _STR),
                       ("gpus", "Array(String)", pa.list_(_STR))),
          ("job_id", "finding_id"), _finding_rows),
    Table("dead_letters", (("topic", _LC, _STR), ("partition", "Int32", _I32), ("offset", "Int64", _I64),
                           ("stage", _LC, _STR), ("job_id", _LC, _STR), ("key", "Nullable(String)", pa.binary()),
                           ("payload", "String", pa.binary()), ("reason", "String", _STR),
                           ("time_ns", "Int64", _I64), ("kernel_events", "Int64", _I64)),
          ("topic", "partition", "offset", "stage"), _dead_letter_rows),
    Table("cpu_stacks", (("job_id", _LC, _STR), ("rank", "Int32", _I32), ("finding_id", "String", _STR),
                         ("time_ns", "Int64", _I64), ("host", _LC, _STR), ("pid", "Int32", _I32),
                         ("stacks_json", "String", _STR)),
          ("job_id", "rank", "finding_id", "time_ns"), _cpu_stack_rows,
          aliases=("`time` DateTime64(9) ALIAS fromUnixTimestamp64Nano(time_ns)",)),
    # Heartbeats: what each rank was doing when (``collective``/``phase_kind`` '' when none), for hang forensics.
    Table("heartbeats", (("job_id", _LC, _STR), ("rank", "Int32", _I32), ("time_ns", "Int64", _I64),
                         ("step", "Int64", _I64), ("phase", _LC, _STR), ("phase_kind", _LC, _STR),
                         ("collective", _LC, _STR), ("grp", _LC, _STR), ("group_index", "Int32", _I32),
                         ("seq", "Int64", _I64), ("in_flight_since_ns", "Int64", _I64),
                         # v2: kernel records paused (1) and why (comma-separated PauseReason), control acks.
                         ("kernels_paused", "UInt8", pa.uint8()), ("pause_reasons", _LC, _STR),
                         ("control_ack", "String", _STR), ("control_error", "String", _STR)),
          ("job_id", "rank", "time_ns"), _heartbeat_rows,
          aliases=("`time` DateTime64(9) ALIAS fromUnixTimestamp64Nano(time_ns)",)),
)}

TABLE_OF_TOPIC: dict[Topic, Table] = {
    Topic.STEPS: TABLES["steps"],
    Topic.PHASES: TABLES["phases"],
    Topic.SUMMARIES: TABLES["kernel_summaries"],
    Topic.TOPOLOGY: TABLES["topology"],
    Topic.LIFECYCLE: TABLES["jobs"],
    Topic.FINDINGS: TABLES["findings"],
    Topic.DEAD_LETTER: TABLES["dead_letters"],
    Topic.STACKS: TABLES["cpu_stacks"],
    Topic.HEARTBEATS: TABLES["heartbeats"],
}



_CLUSTER_COLUMNS = ("cluster_count", "cluster_p50_ns", "cluster_p99_ns", "cluster_min_ns", "cluster_max_ns",
                    "cluster_sum_ns")

#: Views over the tables, ``{name: SELECT}`` (``{db}`` is the database). ``kernel_windows``: one row per
#: (job, kernel, stream, rank, window) with its pieces merged (events summed, clusters concatenated).
VIEWS: dict[str, str] = {
    "kernel_windows": (
        "SELECT job_id, kernel, stream, rank, window_start_ns, any(window_end_ns) AS window_end_ns, "
        "sum(n_events) AS n_events, count() AS pieces, sum(n_clusters) AS n_clusters, "
        + ", ".join(f"groupArrayArray({c}) AS {c}" for c in _CLUSTER_COLUMNS)
        + " FROM `{db}`.kernel_summaries FINAL GROUP BY job_id, kernel, stream, rank, window_start_ns"),
}


def schema_ddl(database: str, cluster: str = "") -> list[str]:
    """Every statement that creates argus's schema in ``database``, in order (each idempotent: ``IF NOT
    EXISTS``): the database, each table of :data:`TABLES` with its :meth:`Table.migrations`, each view.

    ``cluster`` empty (default): one server or the embedded chDB. Otherwise everything ``ON CLUSTER
    '<cluster>'``, tables as :meth:`Table.cluster_ddl`; views read the ``Distributed`` tables.

    Raises:
        ConfigError: ``cluster`` or, with a cluster, ``database`` is not a plain name (see
            :func:`argus.core.settings.check_identifier`).
    """
    on = ""
    if cluster:
        check_identifier("clickhouse_cluster", cluster)
        check_identifier("clickhouse_database", database)
        on = f" ON CLUSTER '{cluster}'"
    out = [f"CREATE DATABASE IF NOT EXISTS `{database}`{on}"]
    for table in TABLES.values():
        out += table.cluster_ddl(database, cluster) if cluster else [table.ddl(database)]
        out += table.migrations(database, cluster)
    out += [f"CREATE VIEW IF NOT EXISTS `{database}`.`{name}`{on} AS " + select.replace("{db}", database)
            for name, select in VIEWS.items()]
    return out
