"""A job that never ends, through the real stack (Kafka, the Faust worker, chDB): published without its
END (and without the ranks' end_of_stream batches, as after a crash), it is found stalled, then abandoned
after ``job_idle_timeout_s``: ABANDONED is stored once, its open windows are summarized, its findings
stored, ``findings --wait`` returns, the worker holds nothing for it, and the worker's committed offsets
move past every one of its messages."""

from __future__ import annotations

import time

import pytest
from confluent_kafka import Consumer, TopicPartition

from argus.core.kafka_security import client_config
from argus.core.settings import Settings
from argus.producers.faults import Fault
from argus.producers.publisher import Publisher
from argus.producers.seed_cases import paper_case
from argus.producers.simulator import JobSimulator
from argus.schemas.records import JobLifecycle, KernelBatch, LifecycleEvent
from argus.sinks.findings_query import fetch_findings, pending_reasons, wait_diagnosed
from argus.topics import Topic
from tests.integration.conftest import SinkThread, WorkerProcess

pytestmark = pytest.mark.integration

JOB = "crashed"
#: Topics the worker consumes (its consumer group commits offsets on them).
CONSUMED = (Topic.KERNELS, Topic.STEPS, Topic.PHASES, Topic.TOPOLOGY, Topic.LIFECYCLE, Topic.SUMMARIES)


@pytest.fixture
def settings(settings: Settings) -> Settings:
    """The conftest settings with a short idle timeout."""
    return settings.replace(job_idle_timeout_s=10.0)


def _uncommitted(settings: Settings) -> dict[str, int]:
    """Messages per consumed topic past the worker group's committed offsets."""
    consumer = Consumer(client_config(settings.kafka, {"group.id": settings.app_id, "enable.auto.commit": False}))
    try:
        out = {}
        for topic in CONSUMED:
            name = topic.full(settings)
            parts = [TopicPartition(name, p) for p in range(settings.partitions)]
            committed = consumer.committed(parts, timeout=10)
            behind = 0
            for tp in committed:
                _, hi = consumer.get_watermark_offsets(TopicPartition(name, tp.partition), timeout=10)
                behind += hi - max(tp.offset, 0)
            out[topic.value] = behind
        return out
    finally:
        consumer.close()


def test_a_job_that_never_ends_is_abandoned_and_freed(settings: Settings, worker: WorkerProcess,
                                                      sink: SinkThread) -> None:
    spec = paper_case(Fault.COMPUTE_STRAGGLER, job_id=JOB, steps=30)
    sim = JobSimulator(spec, batch_events=settings.publisher_batch_events)
    events = 0
    with Publisher(settings, lossless=True) as pub:
        for rec in sim.records():
            if isinstance(rec.record, JobLifecycle) and rec.record.event is LifecycleEvent.END:
                continue  # the job crashed: no END ...
            if isinstance(rec.record, KernelBatch):
                if rec.record.end_of_stream:
                    continue  # ... and no rank closed its stream: its last windows stay open
                events += len(rec.record)
            pub.publish(rec.topic, rec.key, rec.record)
        assert pub.flush(30) == 0
    t_published = time.monotonic()

    # While open, the worker lists the job (``argus status``): its state, age, last step and held messages.
    # The job is listed from its first record on; its last step shows once the worker has read a step of it.
    listed: dict[str, dict[str, object]] = {}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        diag = (worker.stats() or {}).get("diagnosis") or {}
        assert isinstance(diag, dict)
        listed = {j["job"]: j for j in diag.get("jobs", [])}
        if JOB in listed and listed[JOB]["last_step"] >= 0:  # type: ignore[operator]
            break
        time.sleep(0.5)
    assert JOB in listed, listed
    assert listed[JOB]["state"] in ("open", "abandoning") and listed[JOB]["held_messages"], listed
    assert 0 <= listed[JOB]["last_step"] < 30, listed  # type: ignore[operator]

    q = sink.store.query
    assert wait_diagnosed(settings, JOB, 150, query=q), pending_reasons(settings, JOB, query=q)
    assert time.monotonic() - t_published >= settings.job_idle_timeout_s  # not before the idle timeout
    assert sink.scalar(f"SELECT count() FROM {{db}}.jobs FINAL WHERE job_id = '{JOB}' AND event = 'ABANDONED'") == 1
    reason, last_step = sink.store.query(f"SELECT reason, last_step FROM {sink.store.database}.jobs FINAL "
                                         f"WHERE job_id = '{JOB}' AND event = 'ABANDONED'").rows[0]
    assert reason.startswith("idle: no record for") and last_step == 29, (reason, last_step)
    assert sink.scalar(f"SELECT count() FROM {{db}}.jobs FINAL WHERE job_id = '{JOB}' AND event = 'END'") == 0
    # Every kernel event published is summarized: the open windows were flushed.
    assert sink.scalar(f"SELECT sum(n_events) FROM {{db}}.kernel_summaries FINAL WHERE job_id = '{JOB}'") == events
    assert sink.scalar(f"SELECT count() FROM {{db}}.jobs FINAL WHERE job_id = '{JOB}' AND event = 'DIAGNOSED'") \
        == 1 + settings.partitions
    findings = fetch_findings(settings, JOB, query=q)
    n_listed = sink.scalar(f"SELECT uniqExact(id) FROM {{db}}.jobs FINAL ARRAY JOIN finding_ids AS id "
                           f"WHERE job_id = '{JOB}' AND event = 'DIAGNOSED'")
    assert findings and len(findings) == n_listed
    assert any(f["kind"] == "compute_straggler" for f in findings), [f["kind"] for f in findings]
    # No heartbeat of the job arrived: silence alone is no hang (the broker may be down, the ranks gone), so the
    # quiet job is not called stalled; the idle timeout closed it.
    assert not any(f["kind"] in ("job_stalled", "rank_silent", "hang_wavefront") for f in findings)

    # Nothing held for the job any more, and the committed offsets move past all its messages.
    deadline = time.monotonic() + 60
    behind: dict[str, int] = {}
    stats: dict[str, object] = {}
    while time.monotonic() < deadline:
        behind = _uncommitted(settings)
        stats = worker.stats() or {}
        diag = stats.get("diagnosis") or {}
        assert isinstance(diag, dict)
        if not any(behind.values()) and stats.get("pending_messages") == 0 and diag.get("open_jobs") == 0 \
                and diag.get("held_messages") == 0:
            break
        time.sleep(1)
    assert not any(behind.values()), behind
    assert stats.get("pending_messages") == 0 and stats.get("open_windows") == 0, stats
    diag = stats["diagnosis"]
    assert isinstance(diag, dict)
    assert diag["jobs_abandoned"] == 1 and diag["jobs_closed_abandoned"] == 1, diag
    assert diag["open_jobs"] == 0 and diag["held_messages"] == 0, diag
    assert diag["jobs"] == [] and diag["context_jobs"] == 0, diag


def test_a_job_of_kernels_only_that_never_ends_is_abandoned_by_the_compressor(
        settings: Settings, worker: WorkerProcess, sink: SinkThread) -> None:
    """Only CUPTI kernels, no steps, topology or lifecycle (the diagnosis agents never see the job), and no
    end: the compressor abandons it after twice the idle timeout; its windows are summarized, L3 finishes,
    ``findings --wait`` returns and nothing is held."""
    job = "kernels-only"
    spec = paper_case(Fault.COMPUTE_STRAGGLER, job_id=job, steps=12)
    events, last_step = 0, -1
    with Publisher(settings, lossless=True) as pub:
        for rec in JobSimulator(spec, batch_events=settings.publisher_batch_events).records():
            if isinstance(rec.record, KernelBatch) and not rec.record.end_of_stream:
                events += len(rec.record)
                last_step = max(last_step, int(rec.record.step.max(initial=-1)))
                pub.publish(rec.topic, rec.key, rec.record)
        assert pub.flush(30) == 0
    t_published = time.monotonic()

    q = sink.store.query
    assert wait_diagnosed(settings, job, 180, query=q), pending_reasons(settings, job, query=q)
    assert time.monotonic() - t_published >= 2 * settings.job_idle_timeout_s
    rows = q(f"SELECT reason, last_step FROM {sink.store.database}.jobs FINAL "
             f"WHERE job_id = '{job}' AND event = 'ABANDONED'").rows
    assert len(rows) == 1 and rows[0][0].startswith("kernels only: no kernel batch for") \
        and rows[0][1] == last_step, rows
    assert sink.scalar(f"SELECT sum(n_events) FROM {{db}}.kernel_summaries FINAL WHERE job_id = '{job}'") == events
    assert sink.scalar(f"SELECT count() FROM {{db}}.jobs FINAL WHERE job_id = '{job}' AND event = 'DIAGNOSED'") \
        == 1 + settings.partitions
    # Without steps L3 has no step time to weigh a kernel's excess against (impact is GPU time lost per step),
    # so the job may have no findings; what it has is what its DIAGNOSED records list.
    n_listed = sink.scalar(f"SELECT uniqExact(id) FROM {{db}}.jobs FINAL ARRAY JOIN finding_ids AS id "
                           f"WHERE job_id = '{job}' AND event = 'DIAGNOSED'")
    assert len(fetch_findings(settings, job, query=q)) == n_listed

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        stats = worker.stats() or {}
        diag = stats.get("diagnosis") or {}
        assert isinstance(diag, dict)
        # The job's shared context goes after its last part is diagnosed: on a loaded machine, a moment after
        # the rest is released.
        if not any(_uncommitted(settings).values()) and stats.get("open_windows") == 0 \
                and stats.get("pending_messages") == 0 and diag.get("held_messages") == 0 \
                and diag.get("jobs") == [] and diag.get("context_jobs") == 0:
            break
        time.sleep(1)
    assert not any(_uncommitted(settings).values())
    assert stats.get("open_windows") == 0 and stats.get("pending_messages") == 0 and stats.get("jobs_abandoned") == 1
    assert diag.get("held_messages") == 0 and diag.get("jobs") == [] and diag.get("context_jobs") == 0, diag
