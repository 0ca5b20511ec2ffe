"""``argus export-trace``: a Chrome/Perfetto trace of chosen ranks and steps of a job (the L4 drill-down).

The output is Chrome Trace Event Format JSON (``{"traceEvents": [...], "displayTimeUnit": "ns", ...}``, gzip when
the path ends in ``.gz``), for ui.perfetto.dev, Perfetto's trace_processor or ``chrome://tracing``:
see docs/internals/application.md.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
import numpy.typing as npt
from confluent_kafka import Consumer, KafkaException, TopicPartition

from argus.core.errors import ArgusError, SchemaError, TraceExportError
from argus.core.kafka_security import client_config
from argus.core.settings import Settings
from argus.schemas.records import KernelBatch, PhaseKind
from argus.sinks.clickhouse import QueryResult, sql_string
from argus.sinks.query_server import run_query
from argus.topics import Topic, key_partition, rank_key

__all__ = ["KERNEL_SOURCES", "MAX_KERNEL_EVENTS", "export_trace"]

log = logging.getLogger(__name__)

Query = Callable[[str], QueryResult]
#: Where kernels come from: ``auto`` (raw batches from Kafka where retained, else summaries), ``summaries``.
KERNEL_SOURCES = ("auto", "summaries")
#: Most raw kernel events one export keeps in memory (~30 bytes each); past it the rest are left out.
MAX_KERNEL_EVENTS = 2_000_000
#: Rows per ClickHouse query page (the query endpoint answers at most 500,000).
PAGE_ROWS = 100_000
#: Counter tracks of the kernels with the most time, per rank, when summaries stand in for raw kernels.
TOP_KERNELS = 8
_KAFKA_TIMEOUT_S = 10.0
_COLLECTIVES = frozenset(k.value for k in PhaseKind if k.is_collective)
_TIDS_PER_RANK = 1000


def export_trace(settings: Settings, job_id: str, ranks: Sequence[int], from_step: int, to_step: int, out: Path,
                 progress: Callable[[int, int], None] | None = None, *, kernels: str = "auto",
                 query: Query | None = None, max_kernel_events: int = MAX_KERNEL_EVENTS) -> dict[str, Any]:
    """Write the trace of ``ranks`` over steps ``from_step..to_step`` (inclusive) of ``job_id`` to ``out``.

    Args:
        progress: called as ``progress(messages_read, messages_to_read)`` while the kernels topic is read.
        kernels: ``auto`` or ``summaries`` (skip Kafka: counter tracks from the summaries only).
        query: runs one SQL statement (default :func:`argus.sinks.query_server.run_query` on ``settings``).
        max_kernel_events: most raw kernel events kept; past it the rest are left out (``kernels_truncated``).

    Returns:
        ``path``, ``bytes`` (file size), ``events`` (count per category, metadata included), ``raw_kernels``
        (whether any raw kernels were written), ``kernel_source`` (per rank: ``raw``, ``summaries`` or
        ``none``), ``kernels_truncated``, ``kafka_error`` (why raw kernels could not be read, or None),
        ``findings_outside`` (findings about other steps only, left out), ``origin_ns``, ``span_ns``, the job,
        ranks and steps.

    Raises:
        TraceExportError: no such job, unknown ranks, an empty or inverted step range, or ``out`` cannot be
            written. SinkError: ClickHouse cannot be reached.
    """
    if kernels not in KERNEL_SOURCES:
        raise TraceExportError(f"kernels must be one of {', '.join(KERNEL_SOURCES)}, not {kernels!r}")
    if from_step > to_step:
        raise TraceExportError(f"from_step {from_step} is after to_step {to_step}")
    chosen = sorted({int(r) for r in ranks})
    if not chosen:
        raise TraceExportError("no ranks chosen")
    run = query if query is not None else (lambda sql: run_query(settings, sql))
    src = _Source(run, settings.clickhouse_database, job_id)
    hosts = src.check(chosen, from_step, to_step)
    steps = {r: src.steps(r, from_step, to_step) for r in chosen}
    spans = {r: (min(s[1] for s in rows), max(s[1] + s[2] for s in rows)) for r, rows in steps.items() if rows}
    origin = min(lo for lo, _ in spans.values())
    raw: dict[int, _Kernels] = {}
    stats: dict[str, Any] = {"kafka_error": None, "kernels_truncated": False}
    if kernels == "auto":
        raw, stats["kafka_error"], stats["kernels_truncated"] = _read_kernels(
            settings, job_id, spans, progress, max_kernel_events)
    writer = _Writer(out, origin)
    try:
        source = {r: _write_rank(writer, src, r, hosts.get(r, ""), steps[r], from_step, to_step, raw.pop(r, None),
                                 spans.get(r)) for r in chosen}
        starts = {(r, s[0]): s[1] for r, rows in steps.items() for s in rows}
        outside = _findings(writer, src, chosen, from_step, to_step, starts,
                            (origin, max(hi for _, hi in spans.values())))
        other = {"exporter": "argus export-trace", "job_id": job_id, "ranks": chosen, "from_step": from_step,
                 "to_step": to_step, "origin_ns": origin, "kernel_source": {str(r): s for r, s in source.items()}}
        size = writer.close(other)
    except BaseException:
        writer.abort()
        raise
    stats.update(path=str(out), bytes=size, events=dict(writer.counts), raw_kernels="raw" in source.values(),
                 kernel_source=source, findings_outside=outside, origin_ns=origin, job_id=job_id, ranks=chosen,
                 from_step=from_step, to_step=to_step,
                 span_ns=max(hi for _, hi in spans.values()) - origin)
    log.info("exported %s ranks %s steps %d..%d to %s: %d bytes, %s", job_id, chosen, from_step, to_step, out,
             size, stats["events"])
    return stats


def _write_rank(writer: _Writer, src: _Source, rank: int, host: str, steps: list[tuple[int, int, int, int | None]],
                from_step: int, to_step: int, raw: _Kernels | None, span: tuple[int, int] | None) -> str:
    """One rank's process, steps, phases and kernels; returns where its kernels came from."""
    tracks = _Tracks(writer, rank, host)
    for step, start, wall, gpu in steps:
        writer.slice(tracks.tid("steps", start, start + wall), f"step {step}", "step", start, wall,
                     {"step": step, "start_ns": start, "wall_ns": wall, "gpu_ns": gpu})
    # By start, the longer first: a phase within another nests on its track.
    for start, step, idx, kind, name, grp, stream, dur in sorted(src.phases(rank, from_step, to_step),
                                                                 key=lambda p: (p[0], -p[7], p[1], p[2])):
        args: dict[str, Any] = {"kind": kind, "step": step, "idx": idx, "stream": stream}
        track, cat = "phases", "phase"
        if kind in _COLLECTIVES:
            track, cat, args["group"] = (f"collectives {grp}" if grp and grp != "NONE" else "collectives",
                                         "collective", grp)
        writer.slice(tracks.tid(track, start, start + dur), name or kind.lower(), cat, start, dur, args)
    if raw is not None:
        raw.write(writer, tracks)
        return "raw"
    if span is not None and _summary_counters(writer, tracks, src, rank, span):
        return "summaries"
    return "none"



def _ranges(values: Iterable[int]) -> str:
    """``0-7, 9`` of a set of ints."""
    out: list[str] = []
    for v in sorted(values):
        if out and out[-1].split("-")[-1] == str(v - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{v}"
        else:
            out.append(str(v))
    return ", ".join(out)


class _Source:
    """The job's rows in ClickHouse (every query ``FINAL``: the deduplicated view)."""

    def __init__(self, run: Query, database: str, job_id: str) -> None:
        self.run, self.db, self.job = run, database, sql_string(job_id)
        self.job_id = job_id

    def _where(self, table: str) -> str:
        return f"FROM `{self.db}`.{table} FINAL WHERE job_id = {self.job}"

    def check(self, ranks: list[int], from_step: int, to_step: int) -> dict[int, str]:
        """Rank -> host of the job's topology; raises :class:`TraceExportError` for a missing job, unknown ranks
        or no chosen rank's step in the range."""
        n_jobs, n_steps, lo, hi = self.run(
            f"SELECT (SELECT count() {self._where('jobs')}), count(), min(step), max(step) {self._where('steps')}"
        ).rows[0]
        if not n_jobs and not n_steps:
            raise TraceExportError(f"no job {self.job_id!r} in database {self.db}")
        topo = {int(r): str(h) for r, h in self.run(f"SELECT rank, host {self._where('topology')}").rows}
        known = set(topo) or {int(r) for (r,) in self.run(f"SELECT DISTINCT rank {self._where('steps')}").rows}
        unknown = sorted(set(ranks) - known)
        if unknown:
            raise TraceExportError(f"job {self.job_id!r} has ranks {_ranges(known) or 'none'}; "
                                   f"unknown: {_ranges(unknown)}")
        (n,) = self.run(f"SELECT count() {self._where('steps')} AND rank IN ({', '.join(map(str, ranks))}) "
                        f"AND step BETWEEN {from_step} AND {to_step}").rows[0]
        if not n:
            held = f"steps {lo}..{hi}" if n_steps else "no steps"
            raise TraceExportError(f"job {self.job_id!r} has {held}: none of ranks {_ranges(ranks)} in "
                                   f"{from_step}..{to_step}")
        return topo

    def _pages(self, sql: str, order: tuple[str, ...]) -> Iterator[tuple[Any, ...]]:
        """Rows of ``sql`` (ends in a WHERE clause) ordered by the unique key ``order`` (its first columns)."""
        after = ""
        while True:
            rows = self.run(f"{sql}{after} ORDER BY {', '.join(order)} LIMIT {PAGE_ROWS}").rows
            yield from rows
            if len(rows) < PAGE_ROWS:
                return
            last = ", ".join(str(int(v)) for v in rows[-1][:len(order)])
            after = f" AND ({', '.join(order)}) > ({last})"

    def steps(self, rank: int, from_step: int, to_step: int) -> list[tuple[int, int, int, int | None]]:
        """(step, start_ns, wall_ns, gpu_ns) of one rank, by start."""
        rows = self._pages(f"SELECT start_ns, step, wall_ns, gpu_ns {self._where('steps')} AND rank = {rank} "
                           f"AND step BETWEEN {from_step} AND {to_step}", ("start_ns", "step"))
        return [(int(step), int(start), int(wall), None if gpu is None else int(gpu))
                for start, step, wall, gpu in rows]

    def phases(self, rank: int, from_step: int, to_step: int) -> Iterator[tuple[int, int, int, str, str, str, int,
                                                                                  int]]:
        """(start_ns, step, idx, kind, name, grp, stream, duration_ns) of one rank, by start."""
        for start, step, idx, kind, name, grp, stream, dur in self._pages(
                f"SELECT start_ns, step, idx, kind, name, grp, stream, duration_ns {self._where('phases')} "
                f"AND rank = {rank} AND step BETWEEN {from_step} AND {to_step} AND idx >= 0",
                ("start_ns", "step", "idx")):
            yield int(start), int(step), int(idx), str(kind), str(name), str(grp), int(stream), int(dur)


class _Writer:
    """Streams the trace's JSON to ``<out>.part`` (gzip for ``.gz``), renamed to ``out`` by :meth:`close`."""

    def __init__(self, out: Path, origin_ns: int) -> None:
        self.out, self.origin = out, origin_ns
        self.part = out.with_name(out.name + ".part")
        self.counts: dict[str, int] = {}
        try:
            raw: IO[bytes] | gzip.GzipFile = gzip.open(self.part, "wb", compresslevel=6) if out.suffix == ".gz" else \
                open(self.part, "wb", buffering=1 << 20)  # noqa: SIM115 - closed in close() or abort()
        except OSError as exc:
            raise TraceExportError(f"cannot write {out}: {exc}") from exc
        self.f = io.TextIOWrapper(raw, encoding="utf-8")
        self.f.write('{"traceEvents":[')
        self._first = True

    def us(self, t_ns: int) -> float:
        """Microseconds since the origin: exact to the ns while the span is under ~100 days."""
        return (t_ns - self.origin) / 1000

    def event(self, ev: dict[str, Any], category: str) -> None:
        self.f.write(("\n" if self._first else ",\n") + json.dumps(ev, separators=(",", ":")))
        self._first = False
        self.counts[category] = self.counts.get(category, 0) + 1

    def slice(self, tid: tuple[int, int], name: str, cat: str, start_ns: int, dur_ns: int,
              args: dict[str, Any] | None = None) -> None:
        ev: dict[str, Any] = {"ph": "X", "pid": tid[0], "tid": tid[1], "name": name, "cat": cat,
                              "ts": self.us(start_ns), "dur": dur_ns / 1000}
        if args:
            ev["args"] = args
        self.event(ev, cat)

    def close(self, other: dict[str, Any]) -> int:
        try:
            self.f.write('\n],"displayTimeUnit":"ns","otherData":' + json.dumps(other) + "}\n")
            self.f.close()
            os.replace(self.part, self.out)
            return self.out.stat().st_size
        except OSError as exc:
            raise TraceExportError(f"cannot write {self.out}: {exc}") from exc

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self.f.close()
        self.part.unlink(missing_ok=True)


class _Tracks:
    """The process of one rank and its threads. :meth:`tid` packs the slices of a track into lanes (threads)
    so that, on each, slices either follow one another or nest: Perfetto drops slices that partly overlap."""

    def __init__(self, writer: _Writer, rank: int, host: str) -> None:
        self.w, self.pid = writer, rank + 1
        #: track -> per lane, the ends (ns) of its open slices, outermost first
        self._open: dict[str, list[list[int]]] = {}
        self._tids: dict[tuple[str, int], int] = {}
        label = f"rank {rank} ({host})" if host else f"rank {rank}"
        for name, args in (("process_name", {"name": label}), ("process_sort_index", {"sort_index": rank})):
            writer.event({"ph": "M", "pid": self.pid, "tid": 0, "name": name, "args": args}, "metadata")

    def tid(self, track: str, start_ns: int, end_ns: int) -> tuple[int, int]:
        """(pid, tid) of the first lane of ``track`` where a slice ``[start_ns, end_ns]`` follows or nests in
        the slices before it. A track's slices must come by start, the longer first at equal starts."""
        lanes = self._open.setdefault(track, [])
        lane = 0
        while lane < len(lanes):
            stack = lanes[lane]
            while stack and stack[-1] <= start_ns:
                stack.pop()
            if not stack or end_ns <= stack[-1]:
                stack.append(end_ns)
                break
            lane += 1
        else:
            lanes.append([end_ns])
        key = (track, lane)
        tid = self._tids.get(key)
        if tid is None:
            tid = self._tids[key] = self.pid * _TIDS_PER_RANK + min(len(self._tids) + 1, _TIDS_PER_RANK - 1)
            order = list(self._open).index(track) * 64 + min(lane, 63)
            name = track if lane == 0 else f"{track} #{lane + 1}"
            for meta, args in (("thread_name", {"name": name}), ("thread_sort_index", {"sort_index": order})):
                self.w.event({"ph": "M", "pid": self.pid, "tid": tid, "name": meta, "args": args}, "metadata")
        return self.pid, tid


@dataclass
class _Kernels:
    """One rank's raw kernels within its span: columns and the export-wide name table."""

    names: list[str]
    parts: list[tuple[npt.NDArray[Any], ...]] = field(default_factory=list)

    def write(self, writer: _Writer, tracks: _Tracks) -> None:
        stream, start, dur, step, name = (np.concatenate(c) for c in zip(*self.parts, strict=True))
        for i in np.lexsort((-dur, start, stream)):
            s, t, d = int(stream[i]), int(start[i]), int(dur[i])
            writer.slice(tracks.tid(f"stream {s}", t, t + d), self.names[int(name[i])], "kernel", t, d,
                         {"step": int(step[i])})


def _read_kernels(settings: Settings, job_id: str, spans: dict[int, tuple[int, int]],
                  progress: Callable[[int, int], None] | None,
                  limit: int) -> tuple[dict[int, _Kernels], str | None, bool]:
    """The chosen ranks' raw kernels within their spans from the kernels topic, read up to the high watermarks
    of the start: (rank -> kernels, why they could not be read or None, truncated at ``limit``).

    Only the partitions holding the ranks' keys (``<job>/<rank>``, :func:`argus.topics.key_partition`, as
    every argus producer partitions) are read."""
    topic = Topic.KERNELS.full(settings)
    keys = {rank_key(job_id, r): r for r in spans}
    names: list[str] = []
    index: dict[str, int] = {}
    found: dict[int, _Kernels] = {}
    kept, truncated = 0, False
    try:
        consumer = Consumer(client_config(settings.kafka, {
            "group.id": f"{settings.app_id}-trace-export", "enable.auto.commit": False,
            "auto.offset.reset": "earliest", "fetch.max.bytes": 64 << 20}))
    except KafkaException as exc:
        return found, f"cannot create a Kafka consumer: {exc}", False
    try:
        meta = consumer.list_topics(topic, timeout=_KAFKA_TIMEOUT_S).topics.get(topic)
        if meta is None or meta.error is not None or not meta.partitions:
            return found, f"topic {topic} not found", False
        ranges: dict[int, tuple[int, int]] = {}
        for p in sorted({key_partition(k, len(meta.partitions)) for k in keys}):
            lo, hi = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=_KAFKA_TIMEOUT_S)
            if hi > lo:
                ranges[p] = (lo, hi)
        total = sum(hi - lo for lo, hi in ranges.values())
        for msg in _bounded(consumer, topic, ranges, progress, total):
            rank = keys.get(msg.key() or b"")
            if rank is None:
                continue
            try:
                batch = KernelBatch.decode(msg.value())
            except SchemaError as exc:
                log.debug("skipping undecodable kernel batch at %s/%d: %s", msg.partition(), msg.offset(), exc)
                continue
            lo, hi = spans[rank]
            sel = np.flatnonzero((batch.start_ns >= lo) & (batch.start_ns < hi))
            if not len(sel):
                continue
            if kept + len(sel) > limit:
                sel, truncated = sel[:limit - kept], True
            remap = np.array([index.setdefault(n, len(index)) for n in batch.names], dtype=np.int32)
            found.setdefault(rank, _Kernels(names)).parts.append(
                (batch.stream[sel], batch.start_ns[sel], batch.duration_ns[sel], batch.step[sel],
                 remap[batch.name_idx[sel]]))
            kept += len(sel)
            if truncated:
                log.warning("raw kernels truncated at %d events (max_kernel_events)", limit)
                break
    except (KafkaException, ArgusError) as exc:
        log.warning("raw kernels of %s unavailable, using summaries: %s", job_id, exc)
        return {}, str(exc), False
    finally:
        consumer.close()
    names[:] = sorted(index, key=index.__getitem__)
    return found, None if found else f"no raw kernels of the chosen ranks' steps retained in {topic}", truncated


def _bounded(consumer: Consumer, topic: str, ranges: dict[int, tuple[int, int]],
             progress: Callable[[int, int], None] | None, total: int) -> Iterator[Any]:
    """Messages of ``ranges`` (partition -> [start, end) offsets), calling ``progress`` after each poll."""
    if not ranges:
        return
    consumer.assign([TopicPartition(topic, p, lo) for p, (lo, _hi) in ranges.items()])
    done = {p: lo for p, (lo, _hi) in ranges.items()}
    idle = 0.0
    while any(done[p] < hi for p, (_lo, hi) in ranges.items()):
        msgs = consumer.consume(num_messages=500, timeout=0.5)
        idle = 0.0 if msgs else idle + 0.5
        for msg in msgs:
            p, offset = msg.partition(), msg.offset()
            if msg.error() is None and p in ranges and offset is not None and offset < ranges[p][1]:
                yield msg
        for tp in consumer.position([TopicPartition(topic, p) for p in ranges]):
            if tp.offset >= 0:  # offsets may have gaps (transaction markers): the position says where reading is
                done[tp.partition] = max(done[tp.partition], min(tp.offset, ranges[tp.partition][1]))
        if progress is not None:
            progress(sum(done[p] - lo for p, (lo, _hi) in ranges.items()), total)
        if idle > _KAFKA_TIMEOUT_S:
            raise ArgusError(f"reading {topic}: nothing for {_KAFKA_TIMEOUT_S:.0f} s before the end offsets")


def _summary_counters(writer: _Writer, tracks: _Tracks, src: _Source, rank: int, span: tuple[int, int]) -> bool:
    """Counter tracks of the rank's kernel summaries overlapping ``span``; whether there were any."""
    rows = src.run(
        f"SELECT stream, kernel, window_start_ns, max(window_end_ns), sum(n_events), "
        f"sum(arraySum(cluster_sum_ns)) {src._where('kernel_summaries')} AND rank = {rank} "
        f"AND window_end_ns > {span[0]} AND window_start_ns < {span[1]} "
        f"GROUP BY stream, kernel, window_start_ns ORDER BY stream, kernel, window_start_ns").rows
    if not rows:
        return False
    busy: dict[tuple[int, int, int], list[int]] = {}
    per_kernel: dict[tuple[int, str], list[tuple[int, int, float]]] = {}
    total: dict[tuple[int, str], int] = {}
    for stream, kernel, start, end, n, sum_ns in rows:
        s, k, t0, t1, n, sum_ns = int(stream), str(kernel), int(start), int(end), int(n), int(sum_ns)
        acc = busy.setdefault((s, t0, t1), [0, 0])
        acc[0] += sum_ns
        acc[1] += n
        if n:
            per_kernel.setdefault((s, k), []).append((t0, t1, sum_ns / n / 1000))
            total[(s, k)] = total.get((s, k), 0) + sum_ns
    pid = tracks.pid
    series: dict[int, list[tuple[int, int, dict[str, float]]]] = {}
    for (s, t0, t1), (sum_ns, n) in sorted(busy.items()):
        series.setdefault(s, []).append((t0, t1, {"busy_pct": 100 * sum_ns / max(t1 - t0, 1), "kernels": n}))
    for s, windows in series.items():
        _counter(writer, pid, f"stream {s}", windows)
    top = sorted(total, key=lambda sk: -total[sk])[:TOP_KERNELS]
    for s, k in top:
        _counter(writer, pid, f"{k} (stream {s})", [(t0, t1, {"mean_us": v}) for t0, t1, v in per_kernel[(s, k)]])
    return True


def _counter(writer: _Writer, pid: int, name: str, windows: list[tuple[int, int, dict[str, float]]]) -> None:
    """One counter track: each window's values at its start (the origin for a window that began before it: no
    negative times), zeros at the end of a window no other follows."""
    for i, (t0, t1, values) in enumerate(windows):
        writer.event({"ph": "C", "pid": pid, "name": name, "ts": writer.us(max(t0, writer.origin)), "args": values},
                     "kernel_summary")
        if i + 1 == len(windows) or windows[i + 1][0] != t1:
            writer.event({"ph": "C", "pid": pid, "name": name, "ts": writer.us(t1),
                          "args": dict.fromkeys(values, 0)}, "kernel_summary")


def _findings(writer: _Writer, src: _Source, ranks: list[int], from_step: int, to_step: int,
              starts: dict[tuple[int, int], int], span: tuple[int, int]) -> int:
    """Instant events of the findings touching ``ranks`` or job-wide; returns how many had no place in the span."""
    outside = 0
    rows = src.run(
        f"SELECT finding_id, level, kind, ranks, phase, kernel, stream, steps, score, time_ns, impact_ns_per_step, "
        f"impact_ns {src._where('findings')} AND (empty(ranks) OR hasAny(ranks, [{', '.join(map(str, ranks))}])) "
        f"ORDER BY time_ns, finding_id").rows
    for fid, level, kind, f_ranks, phase, kernel, stream, f_steps, score, time_ns, per_step, impact in rows:
        f_ranks, f_steps, time_ns = [int(r) for r in f_ranks], [int(s) for s in f_steps], int(time_ns)
        targets = [r for r in ranks if r in f_ranks] if f_ranks else ranks
        clamped = False
        if span[0] <= time_ns <= span[1]:
            at: int | None = time_ns
        elif f_steps:
            at = min((starts[(r, s)] for r in targets for s in f_steps
                      if from_step <= s <= to_step and (r, s) in starts), default=None)
        else:  # about the rank(s) over the analysed steps, not one step: at the span's edge nearest its time
            at, clamped = min(max(time_ns, span[0]), span[1]), True
        if at is None:
            outside += 1
            continue
        args = {"finding_id": fid, "level": level, "kind": kind, "score": float(score),
                "impact_ns": float(impact), "impact_ns_per_step": float(per_step), "ranks": f_ranks,
                "steps": f_steps, "phase": phase, "kernel": kernel, "stream": stream, "time_ns": time_ns,
                "clamped": clamped}
        base = {"ph": "i", "name": f"{level} {kind}", "cat": "finding", "ts": writer.us(at), "args": args}
        if not f_ranks:
            writer.event({**base, "s": "g", "pid": ranks[0] + 1, "tid": (ranks[0] + 1) * _TIDS_PER_RANK}, "finding")
        for r in targets if f_ranks else ():
            writer.event({**base, "s": "p", "pid": r + 1, "tid": (r + 1) * _TIDS_PER_RANK}, "finding")
    return outside
