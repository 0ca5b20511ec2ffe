"""ClickHouse tables of argus and the mapping of each record type to their rows.

Every table is a ``ReplacingMergeTree`` whose sorting key is the record's natural identity, so a record that
Kafka re-delivers (at-least-once) replaces its earlier copy instead of doubling it. Query with ``FINAL``
(or ``argMax``) to see the deduplicated view before background merges have run. ``kernel_summaries`` uses
``n_events`` as its version: if a window is ever re-emitted from a partial replay, the complete one wins.
Times are Int64 nanoseconds since the Unix epoch (``*_ns``); ``*_time`` columns are readable aliases.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from argus.topics import Topic
from schemas.records import (
    CpuStack,
    DeadLetter,
    Finding,
    JobLifecycle,
    JobTopology,
    KernelBatch,
    KernelSummary,
    PhaseBatch,
    Step,
)

__all__ = ["TABLES", "TABLE_OF_TOPIC", "Table", "rows_to_arrow"]

_I64, _I32, _STR = pa.int64(), pa.int32(), pa.string()


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
        cols = [f"`{n}` {t}" for n, t, _ in self.columns] + list(self.aliases)
        engine = f"ReplacingMergeTree({self.version})" if self.version else "ReplacingMergeTree"
        return (f"CREATE TABLE IF NOT EXISTS `{database}`.`{self.name}` ({', '.join(cols)}) "
                f"ENGINE = {engine} ORDER BY ({', '.join(self.order_by)})")

    def migrations(self, database: str) -> list[str]:
        """``ADD COLUMN IF NOT EXISTS`` for every column, so tables created by an older argus gain new ones
        (e.g. the findings' impact columns of schema v2); no-ops on current tables."""
        return [f"ALTER TABLE `{database}`.`{self.name}` ADD COLUMN IF NOT EXISTS `{n}` {t}"
                for n, t, _ in self.columns]

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
    for i, (kind, name, group, stream, start, dur) in enumerate(
            zip(r.kinds, r.names, r.groups, r.streams, r.start_ns, r.duration_ns, strict=True)):
        yield (r.job_id, r.rank, r.step, i, kind.value, name, group.value, stream, start, dur)


def _summary_rows(r: KernelSummary) -> Iterable[tuple[Any, ...]]:
    at = 0
    for i, n in enumerate(r.n_clusters):
        sl = slice(at, at + n)
        at += n
        yield (r.job_id, r.kernel, r.stream, r.rank[i], r.window_start_ns[i], r.window_end_ns[i],
               r.n_events[i], n, list(r.cluster_count[sl]), list(r.cluster_p50_ns[sl]),
               list(r.cluster_p99_ns[sl]), list(r.cluster_min_ns[sl]), list(r.cluster_max_ns[sl]),
               list(r.cluster_sum_ns[sl]))


def _topology_rows(r: JobTopology) -> Iterable[tuple[Any, ...]]:
    for i in range(r.world_size):
        yield (r.job_id, r.rank[i], r.host[i], r.dp_group[i], r.tp_group[i], r.pp_group[i], r.ep_group[i],
               r.pp_stage[i], r.world_size, r.dp_size, r.tp_size, r.pp_size, r.ep_size)


def _job_rows(r: JobLifecycle) -> Iterable[tuple[Any, ...]]:
    yield (r.job_id, r.event.value, r.part, r.time_ns, r.world_size, r.source, r.kernel_events, r.steps,
           r.phase_batches)


def _finding_rows(r: Finding) -> Iterable[tuple[Any, ...]]:
    yield (r.job_id, r.finding_id, r.level.value, r.kind, list(r.ranks), r.phase, r.kernel, r.stream,
           list(r.steps), r.score, r.evidence_json, r.time_ns, r.impact_ns_per_step, r.impact_ns)


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
        ("cluster_sum_ns", _A64, _AL)),
          ("job_id", "kernel", "stream", "rank", "window_start_ns"), _summary_rows, version="n_events",
          aliases=("`window_start` DateTime64(9) ALIAS fromUnixTimestamp64Nano(window_start_ns)",)),
    Table("topology", (("job_id", _LC, _STR), ("rank", "Int32", _I32), ("host", _LC, _STR),
                       ("dp_group", "Int32", _I32), ("tp_group", "Int32", _I32), ("pp_group", "Int32", _I32),
                       ("ep_group", "Int32", _I32), ("pp_stage", "Int32", _I32), ("world_size", "Int32", _I32),
                       ("dp_size", "Int32", _I32), ("tp_size", "Int32", _I32), ("pp_size", "Int32", _I32),
                       ("ep_size", "Int32", _I32)),
          ("job_id", "rank"), _topology_rows),
    Table("jobs", (("job_id", _LC, _STR), ("event", _LC, _STR), ("part", _LC, _STR), ("time_ns", "Int64", _I64),
                   ("world_size", "Int32", _I32), ("source", _LC, _STR), ("kernel_events", "Nullable(Int64)", _I64),
                   ("steps", "Nullable(Int64)", _I64), ("phase_batches", "Nullable(Int64)", _I64)),
          ("job_id", "event", "part"), _job_rows),
    Table("findings", (("job_id", _LC, _STR), ("finding_id", "String", _STR), ("level", _LC, _STR),
                       ("kind", _LC, _STR), ("ranks", "Array(Int32)", pa.list_(_I32)),
                       ("phase", "Nullable(String)", _STR), ("kernel", "Nullable(String)", _STR),
                       ("stream", "Nullable(Int64)", _I64), ("steps", _A64, _AL), ("score", "Float64", pa.float64()),
                       ("evidence_json", "String", _STR), ("time_ns", "Int64", _I64),
                       ("impact_ns_per_step", "Float64", pa.float64()), ("impact_ns", "Float64", pa.float64())),
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
}

