"""Exactly-once results from at-least-once delivery, through the real stack (Kafka, the Faust worker, chDB):
copies of steps and phases count once, kernel events that arrive after their window was summarized are a
further piece (summed, never replaced), ``findings --wait`` waits for the stored counts and findings, and the
same records give the same findings."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from argus.core.settings import Settings
from argus.producers.faults import Fault
from argus.producers.publisher import Publisher
from argus.producers.seed_cases import paper_case
from argus.producers.simulator import JobSimulator
from argus.schemas.records import KernelBatch
from argus.sinks.clickhouse import ClickHouseStore
from argus.sinks.findings_query import diagnosis_complete, fetch_findings, pending_reasons, wait_diagnosed
from argus.topics import Topic, ensure_topics
from tests.integration.conftest import SinkThread, WorkerProcess, _free_port

pytestmark = pytest.mark.integration

HELD_RANK = 3


def test_copies_and_stragglers_count_once(settings: Settings, worker: WorkerProcess, sink: SinkThread) -> None:
    spec = paper_case(Fault.COMPUTE_STRAGGLER, job_id="eo", steps=12)
    sim = JobSimulator(spec, batch_events=settings.publisher_batch_events)
    held: list[Any] = []
    with Publisher(settings, lossless=True) as pub:
        for rec in sim.records():
            if rec.topic in (Topic.STEPS, Topic.PHASES):
                pub.publish(rec.topic, rec.key, rec.record)  # a producer re-send: the same record twice
            if (rec.topic is Topic.KERNELS and isinstance(rec.record, KernelBatch) and rec.record.rank == HELD_RANK
                    and not rec.record.end_of_stream and rec.record.seq == 1):
                held.append(rec)  # delivered late: after the rank's end and the job's END
                continue
            pub.publish(rec.topic, rec.key, rec.record)
        assert pub.flush(30) == 0
        # Let the job end be processed first, so these events find their windows summarized.
        sink.wait_for("SELECT count() FROM {db}.jobs FINAL WHERE job_id = 'eo' AND event = 'DIAGNOSED' "
                      "AND part = 'l1l2'", 1, timeout_s=120)
        assert not diagnosis_complete(settings, "eo", query=sink.store.query)  # the held events are missing
        assert any("kernel events" in why for why in pending_reasons(settings, "eo", query=sink.store.query))
        for rec in held:
            pub.publish(rec.topic, rec.key, rec.record)
        assert pub.flush(30) == 0
    end = sim.end()
    assert wait_diagnosed(settings, "eo", 150, query=sink.store.query), \
        pending_reasons(settings, "eo", query=sink.store.query)
    db = sink.store.database
    assert sink.scalar("SELECT sum(n_events) FROM {db}.kernel_summaries FINAL WHERE job_id = 'eo'") == end.kernel_events
    assert sink.scalar("SELECT sum(n_events) FROM {db}.kernel_windows WHERE job_id = 'eo'") == end.kernel_events
    assert sink.scalar("SELECT count() FROM {db}.dead_letters FINAL") == 0
    assert sink.scalar("SELECT count() FROM {db}.steps FINAL WHERE job_id = 'eo'") == spec.world_size * spec.steps
    assert sink.scalar("SELECT uniqExact(rank, step) FROM {db}.phases FINAL WHERE job_id = 'eo'") == end.phase_batches
    late = sink.store.query(f"SELECT max(pieces) FROM {db}.kernel_windows WHERE job_id = 'eo' AND rank = {HELD_RANK}")
    assert late.rows[0][0] >= 2  # the held events are a further piece of windows already summarized
    # Every finding the DIAGNOSED records list is stored.
    listed = sink.scalar("SELECT uniqExact(id) FROM {db}.jobs FINAL ARRAY JOIN finding_ids AS id "
                         "WHERE job_id = 'eo' AND event = 'DIAGNOSED'")
    assert listed == sink.scalar("SELECT count() FROM {db}.findings FINAL WHERE job_id = 'eo'")


def _second_stack(settings: Settings, tmp_path: Path) -> Settings:
    tag = uuid.uuid4().hex[:8]
    other = settings.replace(topic_prefix=f"t{tag}.", app_id=f"argus-test-{tag}", sink_group=f"sink-{tag}",
                             clickhouse_database=f"test_{tag}", worker_web_port=_free_port(),
                             query_port=_free_port(), home=tmp_path / "second")
    ensure_topics(other)
    return other


def _run(settings: Settings, sink: SinkThread) -> list[dict[str, Any]]:
    spec = paper_case(Fault.LINK_DEGRADATION, job_id="det", steps=20)
    with Publisher(settings, lossless=True) as pub:
        assert JobSimulator(spec, batch_events=settings.publisher_batch_events).run(pub).dropped == 0
    assert wait_diagnosed(settings, "det", 150, query=sink.store.query), \
        pending_reasons(settings, "det", query=sink.store.query)
    return fetch_findings(settings, "det", query=sink.store.query)


def test_same_records_same_findings(settings: Settings, worker: WorkerProcess, sink: SinkThread,
                                    chdb_store: ClickHouseStore, tmp_path: Path) -> None:
    first = _run(settings, sink)
    worker.stop()  # one worker at a time on a small machine
    other = _second_stack(settings, tmp_path)
    w2 = WorkerProcess(other, tmp_path / "worker2.log")
    s2 = SinkThread(other, chdb_store)
    try:
        w2.wait_healthy()
        t0 = time.monotonic()
        second = _run(other, s2)
    finally:
        s2.stop()
        w2.stop()
    assert first, "the degraded link must be found"
    assert second == first, f"after {time.monotonic() - t0:.0f} s: {first} vs {second}"
