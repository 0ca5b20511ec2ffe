"""The vertical slice on the real broker, the real Faust worker and chDB: a simulated 8-rank job is
accounted for event by event, lands as the expected summaries, and a replay adds no duplicate rows."""

from __future__ import annotations

import time

import pytest

from argus.core.settings import Settings
from argus.producers.faults import Fault
from argus.producers.publisher import Publisher
from argus.producers.seed_cases import paper_case
from argus.producers.simulator import JobSimulator, SimRecord
from argus.streams.compression import summarize_windows
from argus.streams.windows import WindowBuffer
from argus.topics import Topic
from tests.integration.conftest import SinkThread, WorkerProcess

pytestmark = pytest.mark.integration

COUNTS = """SELECT (SELECT count() FROM {db}.steps FINAL), (SELECT count() FROM {db}.phases FINAL),
                  (SELECT count() FROM {db}.kernel_summaries FINAL), (SELECT count() FROM {db}.topology FINAL),
                  (SELECT count() FROM {db}.jobs FINAL WHERE event IN ('START', 'END'))"""


def expected_summary_rows(records: list[SimRecord], settings: Settings) -> tuple[int, int]:
    """(rows, events) the pure core gives for the same records: what the live pipeline must reproduce."""
    buf = WindowBuffer(settings.window_ns, settings.allowed_lateness_ns)
    rows = events = 0
    for i, rec in enumerate(records):
        if rec.topic is Topic.KERNELS:
            closed = buf.add(rec.record, i).closed
            for s in summarize_windows(closed):
                rows += len(s.rank)
                events += sum(s.n_events)
    return rows, events


def publish(settings: Settings, records: list[SimRecord]) -> None:
    with Publisher(settings, lossless=True) as pub:
        for rec in records:
            assert pub.publish(rec.topic, rec.key, rec.record)
        assert pub.flush(30) == 0
        stats = pub.close()
    assert stats.failed == 0 and stats.dropped == 0


def test_simulated_job_fully_accounted_and_replay_idempotent(
        settings: Settings, worker: WorkerProcess, sink: SinkThread) -> None:
    spec = paper_case(Fault.COMPUTE_STRAGGLER, job_id="it-job", steps=20)
    records = list(JobSimulator(spec, batch_events=settings.publisher_batch_events).records())
    kernel_events = sum(len(r.record) for r in records if r.topic is Topic.KERNELS)
    kernel_batches = sum(1 for r in records if r.topic is Topic.KERNELS)
    want_rows, want_events = expected_summary_rows(records, settings)
    assert want_events == kernel_events and spec.world_size == 8

    publish(settings, records)
    # Every kernel record is accounted for: in = summarized + dead-lettered, none silently lost.
    sink.wait_for("SELECT sum(n_events) FROM {db}.kernel_summaries FINAL WHERE job_id = 'it-job'", kernel_events)
    assert sink.scalar("SELECT count() FROM {db}.dead_letters FINAL") == 0
    assert sink.scalar("SELECT count() FROM {db}.kernel_summaries FINAL") == want_rows
    sink.wait_for("SELECT count() FROM {db}.jobs FINAL WHERE event = 'END'", 1)
    sink.wait_for("SELECT count() FROM {db}.steps FINAL", 8 * 20)
    before = sink.store.query(COUNTS.replace("{db}", sink.store.database)).rows[0]
    assert before == (160, sum(len(r.record.kinds) for r in records if r.topic is Topic.PHASES), want_rows, 8, 2)
    stats = worker.stats()
    assert stats is not None and stats["events_in"] == kernel_events and stats["late_events"] == 0

    # Replay the same records (a postmortem re-import or a producer retry): no duplicate rows appear.
    # The sink's row counts are taken before the replay is published: taken after, the sink may already have
    # inserted part of the replay and the wait below would ask for more rows than the replay holds.
    rows_inserted = dict(sink.writer.stats.rows)
    publish(settings, records)
    t_end = time.monotonic() + 90
    while time.monotonic() < t_end:
        s = worker.stats()
        # The replay went all the way through: the worker recognized every kernel batch as a copy (same rank
        # and seq, not summarized again) and the sink re-inserted the rest.
        if (s is not None and s["duplicate_batches"] >= kernel_batches and s["pending_messages"] == 0
                and s["events_summarized"] == kernel_events
                and sink.writer.stats.rows["jobs"] >= rows_inserted["jobs"] + 2
                and sink.writer.stats.rows["steps"] >= 2 * rows_inserted["steps"]):
            break
        time.sleep(0.3)
    else:
        raise AssertionError(f"replay not processed: worker {worker.stats()}, sink {sink.writer.stats.as_dict()}")
    after = sink.store.query(COUNTS.replace("{db}", sink.store.database)).rows[0]
    assert after == before
    sink.store.command(f"OPTIMIZE TABLE {sink.store.database}.kernel_summaries FINAL")
    assert sink.scalar("SELECT count() FROM {db}.kernel_summaries") == want_rows
    assert sink.scalar("SELECT sum(n_events) FROM {db}.kernel_summaries") == kernel_events
