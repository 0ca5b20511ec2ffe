"""``argus.trace_export`` without Kafka or ClickHouse: a fake store answers its queries, kernels come from the
summaries; the lanes that keep slices nested; the findings' placement; the refusals of bad arguments."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import argus.trace_export as te
from argus.core.errors import TraceExportError
from argus.core.settings import Settings
from argus.sinks.clickhouse import QueryResult

T0 = 1_767_225_600_000_000_000  # ns
MS = 1_000_000


class FakeStore:
    """Answers the export's SQL from lists of rows, honouring rank, step range, keyset pages and LIMIT."""

    def __init__(self) -> None:
        self.steps = [(r, s, T0 + s * 100 * MS, 100 * MS, 90 * MS) for r in range(4) for s in range(10)]
        # Per step: forward with a nested attention, a DP all-reduce that partly overlaps the forward.
        self.phases = []
        for r, s, start, _, _ in self.steps:
            self.phases += [(r, s, 0, "FORWARD", "forward", "NONE", 7, start, 40 * MS),
                            (r, s, 1, "OTHER", "attention", "NONE", 7, start + 5 * MS, 10 * MS),
                            (r, s, 2, "ALL_REDUCE", "dp-allreduce", "DP", 13, start + 30 * MS, 20 * MS),
                            (r, s, 3, "ALL_REDUCE", "dp-allreduce-2", "DP", 13, start + 45 * MS, 20 * MS)]
        # 1 s windows; the first begins before step 0.
        self.summaries = [(r, 7, "gemm", T0 - 500 * MS + w * 1000 * MS, T0 + 500 * MS + w * 1000 * MS, 10, 50 * MS)
                          for r in range(4) for w in (0, 1)]
        self.findings = [
            ("f1", "L1", "step_regression", [], None, None, None, [3], 4.0, T0 + 900 * 100 * MS, 1e6, 1e7),
            ("f2", "L2", "compute_straggler", [2], "forward", None, None, [], 9.0, T0 + 10_000 * MS, 2e6, 2e7),
            ("f3", "L3", "rank_degraded", [1], None, "gemm", 7, [], 2.0, T0 + 150 * MS, 3e6, 3e7),
            ("f4", "L1", "iteration_spike", [], None, None, None, [9], 3.0, T0 + 950 * MS, 1e6, 1e6),
        ]
        self.queries: list[str] = []

    def __call__(self, sql: str) -> QueryResult:
        self.queries.append(sql)
        job = re.search(r"job_id = '([^']*)'", sql)
        if job is None or job.group(1) != "j":
            rows: list[tuple[Any, ...]] = [(0, 0, 0, 0)] if sql.startswith("SELECT (SELECT count()") else []
            return QueryResult((), rows)
        ranks = {int(m) for m in re.findall(r"rank = (\d+)", sql)}
        if m := re.search(r"rank IN \(([\d, ]+)\)", sql):
            ranks = {int(x) for x in m.group(1).split(",")}
        lo, hi = (int(x) for x in re.search(r"step BETWEEN (-?\d+) AND (-?\d+)", sql).groups()) if "BETWEEN" in sql \
            else (-(2**63), 2**63)
        if sql.startswith("SELECT (SELECT count()"):
            return QueryResult((), [(1, len(self.steps), 0, 9)])
        if sql.startswith("SELECT rank, host"):
            return QueryResult((), [(r, f"h{r // 2}") for r in range(4)])
        if sql.startswith("SELECT count()"):
            return QueryResult((), [(sum(1 for r, s, *_ in self.steps if r in ranks and lo <= s <= hi),)])
        if sql.startswith("SELECT start_ns, step, wall_ns"):
            rows = [(t, s, w, g) for r, s, t, w, g in self.steps if r in ranks and lo <= s <= hi]
            return QueryResult((), self._page(sql, rows, 2))
        if sql.startswith("SELECT start_ns, step, idx"):
            rows = [(t, s, i, k, n, g, st, d) for r, s, i, k, n, g, st, t, d in self.phases
                    if r in ranks and lo <= s <= hi]
            return QueryResult((), self._page(sql, rows, 3))
        if "kernel_summaries" in sql:
            span = [int(x) for x in re.search(r"window_end_ns > (\d+) AND window_start_ns < (\d+)", sql).groups()]
            return QueryResult((), [(st, k, w0, w1, n, total) for r, st, k, w0, w1, n, total in self.summaries
                                    if r in ranks and w1 > span[0] and w0 < span[1]])
        if "findings" in sql:
            chosen = {int(x) for x in re.search(r"hasAny\(ranks, \[([\d, ]+)\]\)", sql).group(1).split(",")}
            return QueryResult((), [f for f in self.findings if not f[3] or set(f[3]) & chosen])
        raise AssertionError(f"unexpected SQL {sql}")

    @staticmethod
    def _page(sql: str, rows: list[tuple[Any, ...]], key: int) -> list[tuple[Any, ...]]:
        rows.sort(key=lambda r: r[:key])
        if m := re.search(r"\) > \(([-\d, ]+)\)", sql):
            after = tuple(int(x) for x in m.group(1).split(","))
            rows = [r for r in rows if r[:key] > after]
        return rows[:int(re.search(r"LIMIT (\d+)", sql).group(1))]


def settings(tmp_path: Path) -> Settings:
    return Settings.load(env={}, home=tmp_path)


def export(tmp_path: Path, store: FakeStore, name: str = "t.json", ranks: tuple[int, ...] = (1, 2),
           steps: tuple[int, int] = (2, 5), **kw: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    out = tmp_path / name
    stats = te.export_trace(settings(tmp_path), "j", list(ranks), *steps, out, kernels="summaries", query=store, **kw)
    raw = out.read_bytes()
    return stats, json.loads(gzip.decompress(raw) if name.endswith(".gz") else raw)


def by(doc: dict[str, Any], **match: Any) -> list[dict[str, Any]]:
    return [e for e in doc["traceEvents"] if all(e.get(k) == v for k, v in match.items())]


def test_slices_per_rank_and_units(tmp_path: Path) -> None:
    store = FakeStore()
    stats, doc = export(tmp_path, store)
    assert doc["displayTimeUnit"] == "ns" and doc["otherData"]["origin_ns"] == T0 + 2 * 100 * MS
    assert stats["events"]["step"] == 8 and stats["events"]["phase"] == 16 and stats["events"]["collective"] == 16
    assert stats["bytes"] == (tmp_path / "t.json").stat().st_size and not (tmp_path / "t.json.part").exists()
    names = {e["pid"]: e["args"]["name"] for e in by(doc, name="process_name")}
    assert names == {2: "rank 1 (h0)", 3: "rank 2 (h1)"}
    step = by(doc, name="step 3", pid=2)[0]
    # Microseconds since the origin, from integer ns; the absolute start in args.
    assert step["ts"] == 100_000.0 and step["dur"] == 100_000.0 and step["args"]["start_ns"] == T0 + 300 * MS
    coll = by(doc, cat="collective")
    assert coll and all(e["args"]["group"] == "DP" for e in coll)


def test_lanes_nest_or_split(tmp_path: Path) -> None:
    _, doc = export(tmp_path, FakeStore(), ranks=(1,), steps=(0, 0))
    tracks = {e["tid"]: e["args"]["name"] for e in by(doc, name="thread_name")}
    track = {e["name"]: tracks[e["tid"]] for e in doc["traceEvents"] if e["ph"] == "X"}
    # attention nests in forward on one track; the second all-reduce partly overlaps the first: next lane.
    assert track["forward"] == track["attention"] == "phases"
    assert track["dp-allreduce"] == "collectives DP" and track["dp-allreduce-2"] == "collectives DP #2"
    assert len(set(tracks)) == len(tracks)  # thread ids are unique across processes


def test_summary_counters_start_at_origin_and_close(tmp_path: Path) -> None:
    stats, doc = export(tmp_path, FakeStore(), ranks=(1,), steps=(0, 9))
    assert stats["kernel_source"] == {1: "summaries"} and not stats["raw_kernels"]
    busy = by(doc, ph="C", name="stream 7")
    # Window 1 began before step 0 (the origin): shown from 0; windows are contiguous, zero after the last.
    assert [e["ts"] for e in busy] == [0.0, 500_000.0, 1_500_000.0]
    assert busy[0]["args"] == {"busy_pct": 5.0, "kernels": 10} and busy[-1]["args"] == {"busy_pct": 0, "kernels": 0}
    mean = by(doc, ph="C", name="gemm (stream 7)")
    assert mean[0]["args"] == {"mean_us": 5000.0}


def test_findings_placement(tmp_path: Path) -> None:
    stats, doc = export(tmp_path, FakeStore(), ranks=(1, 2), steps=(2, 5))
    found = {e["args"]["finding_id"]: e for e in by(doc, cat="finding")}
    # f1 (job-wide, step 3, time outside): global, at step 3; f2 (rank 2, no steps, later): rank 2's process at
    # the span's end, clamped; f3 (rank 1, time before the span): rank 1 at the span's start; f4 (step 9): left out.
    assert set(found) == {"f1", "f2", "f3"} and stats["findings_outside"] == 1
    assert found["f1"]["s"] == "g" and found["f1"]["ts"] == 100_000.0
    assert found["f2"]["s"] == "p" and found["f2"]["pid"] == 3 and found["f2"]["ts"] == 400_000.0
    assert found["f2"]["args"]["clamped"] and found["f3"]["pid"] == 2 and found["f3"]["ts"] == 0.0
    assert {"kind", "level", "score", "impact_ns"} <= set(found["f2"]["args"])


def test_pages_and_gzip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(te, "PAGE_ROWS", 3)
    store = FakeStore()
    stats, doc = export(tmp_path, store, name="t.json.gz")
    plain, _ = export(tmp_path, FakeStore(), name="t.json")
    assert stats["events"] == plain["events"] and stats["bytes"] < plain["bytes"]
    assert sum(1 for q in store.queries if ") > (" in q) > 4
    assert [int(e["name"].split()[1]) for e in by(doc, cat="step", pid=2)] == [2, 3, 4, 5]


@pytest.mark.parametrize(("job", "ranks", "steps", "match"), [
    ("j", (1,), (5, 2), "after"),
    ("nope", (1,), (0, 1), "no job 'nope'"),
    ("j", (1, 7, 8), (0, 1), "ranks 0-3; unknown: 7-8"),
    ("j", (1,), (50, 60), "has steps 0..9: none of ranks 1 in 50..60"),
    ("j", (), (0, 1), "no ranks"),
])
def test_bad_arguments(tmp_path: Path, job: str, ranks: tuple[int, ...], steps: tuple[int, int], match: str) -> None:
    with pytest.raises(TraceExportError, match=match):
        te.export_trace(settings(tmp_path), job, list(ranks), *steps, tmp_path / "x.json", kernels="summaries",
                        query=FakeStore())
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(TraceExportError, match="kernels must be"):
        te.export_trace(settings(tmp_path), "j", [1], 0, 1, tmp_path / "x.json", kernels="raw", query=FakeStore())


def test_unwritable_output(tmp_path: Path) -> None:
    with pytest.raises(TraceExportError, match="cannot write"):
        export(tmp_path, FakeStore(), name="missing/t.json")


def test_raw_kernels_by_stream_and_start(tmp_path: Path) -> None:
    names = ["b", "a"]
    k = te._Kernels(names, [(np.array([13, 7, 7], np.uint32), np.array([T0 + 5, T0 + 9, T0 + 1]),
                             np.array([1, 2, 3]), np.array([0, 0, 0], np.int32), np.array([0, 1, 0], np.int32))])
    w = te._Writer(tmp_path / "k.json", T0)
    k.write(w, te._Tracks(w, 0, ""))
    w.close({})
    doc = json.loads((tmp_path / "k.json").read_text())
    assert [(e["name"], e["ts"]) for e in by(doc, cat="kernel")] == [("b", 0.001), ("a", 0.009), ("b", 0.005)]
    assert by(doc, name="process_name")[0]["args"]["name"] == "rank 0"
