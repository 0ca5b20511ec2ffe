"""Poison messages in the middle of a healthy job, on the real broker, Faust worker and chDB: each one is
dead-lettered with its stage and reason, and the job is still diagnosed as if they had not been sent."""

from __future__ import annotations

import time

import numpy as np
import pytest
from confluent_kafka import Producer

from argus.core.settings import Settings
from argus.producers.faults import Fault
from argus.producers.publisher import Publisher
from argus.producers.seed_cases import paper_case
from argus.producers.simulator import JobSimulator, SimRecord
from argus.schemas.records import JobLifecycle, KernelBatch, LifecycleEvent, Step
from argus.sinks.findings_query import fetch_findings, wait_diagnosed
from argus.topics import Topic, job_key, rank_key
from tests.integration.conftest import SinkThread, WorkerProcess

pytestmark = pytest.mark.integration

JOB = "poisoned"


def _publish(settings: Settings, records: list[SimRecord]) -> None:
    with Publisher(settings, lossless=True) as pub:
        for rec in records:
            assert pub.publish(rec.topic, rec.key, rec.record)
        assert pub.flush(30) == 0


def _kernels(rank: int, seq: int, starts: list[int], names: tuple[str, ...] = ("gemm_poison",)) -> KernelBatch:
    n = len(starts)
    return KernelBatch(JOB, rank, seq, names, np.zeros(n), np.full(n, 7), np.array(starts, dtype=np.int64),
                       np.full(n, 1000), np.zeros(n))


def test_poison_messages_are_dead_lettered_and_the_job_is_still_diagnosed(
        settings: Settings, worker: WorkerProcess, sink: SinkThread) -> None:
    spec = paper_case(Fault.COMPUTE_STRAGGLER, job_id=JOB, steps=30)
    records = list(JobSimulator(spec, batch_events=settings.publisher_batch_events).records())
    kernel_events = sum(len(r.record) for r in records if r.topic is Topic.KERNELS)
    first_kernel = next(r.record for r in records if r.topic is Topic.KERNELS and r.record.rank == 1)
    t_mid = int(first_kernel.start_ns[0])
    half = len(records) // 2
    job_keyed = sum(1 for r in records[:half] if r.topic is not Topic.KERNELS)

    _publish(settings, records[:half])
    # The worker has read the job's topology (the rank checks need it) before the poison arrives.
    deadline = time.monotonic() + 90
    while (worker.stats() or {}).get("diagnosis", {}).get("records", 0) < job_keyed:
        assert time.monotonic() < deadline, f"worker did not read the first half: {worker.stats()}"
        time.sleep(0.3)

    raw = Producer({"bootstrap.servers": settings.bootstrap_servers})
    poison = [
        # start_ns near the int64 limit: its summary's window end would overflow.
        (Topic.KERNELS, rank_key(JOB, 2), _kernels(2, 10_000, [2**63 - 1])),
        # A lifecycle record of a job with no ranks.
        (Topic.LIFECYCLE, job_key(JOB), JobLifecycle(JOB, LifecycleEvent.START, t_mid, 0)),
        # Ranks outside the job's 8-rank topology: a step, and kernels that become summary rows.
        (Topic.STEPS, job_key(JOB), Step(JOB, 8, 3, t_mid, 1_000_000, 900_000)),
        (Topic.KERNELS, rank_key(JOB, 8), _kernels(8, 0, [t_mid + i * 1000 for i in range(20)])),
        # One event 10^18 ns in the future among a rank's ordinary ones.
        (Topic.KERNELS, rank_key(JOB, 1), _kernels(1, 10_001, [t_mid + 10**18])),
    ]
    for topic, key, rec in poison:
        raw.produce(topic.full(settings), rec.encode(), key)
    assert raw.flush(10) == 0
    _publish(settings, records[half:])

    assert wait_diagnosed(settings, JOB, 120, query=sink.store.query), "diagnosis did not complete"
    time.sleep(1.0)
    findings = fetch_findings(settings, JOB, query=sink.store.query)
    stragglers = {r for f in findings if f["level"] == "L2" for r in f["ranks"]}
    assert stragglers == {5}, findings

    sink.wait_for("SELECT count() FROM {db}.dead_letters FINAL", 5)
    rows = sink.store.query(f"SELECT topic, stage, reason FROM {sink.store.database}.dead_letters FINAL").rows
    assert len(rows) == 5, rows
    got = {(t.split(".")[-1], stage): reason for t, stage, reason in rows if stage != "compress"}
    assert "world_size value 0" in got[("lifecycle", "sink")]
    assert "rank 8 is not in job" in got[("steps", "diagnose-jobs")]
    assert "rows of ranks [8]" in got[("summaries", "diagnose-kernels")]
    compress = sorted(r for t, s, r in rows if s == "compress" and t.endswith("kernels"))
    assert len(compress) == 2, compress
    assert "poisoned/2" in compress[0] and "start_ns value 9223372036854775807 outside" in compress[0]
    assert compress[1].startswith("skew: 1 events of poisoned/1")

    # The far-future event did not move rank 1's watermark: every ordinary event was summarized, none late.
    summarized = sink.scalar("SELECT sum(n_events) FROM {db}.kernel_summaries FINAL "
                             f"WHERE job_id = '{JOB}' AND rank != 8")
    assert summarized == kernel_events
    stats = worker.stats()
    assert stats is not None and stats["late_events"] == 0 and stats["skewed_events"] == 1
    assert stats["pending_messages"] == 0 and stats["diagnosis"]["dead_letters"] == 2


def test_ranks_outside_the_job_are_dead_lettered_before_its_topology_and_after_its_end(
        settings: Settings, worker: WorkerProcess, sink: SinkThread) -> None:
    """The job topics are read independently: a step of a rank outside the job read before the job's topology
    and START (nothing tells yet that it is foreign) is dead-lettered once the topology arrives, and one read
    after the job finished is dead-lettered too; the job is diagnosed as without them."""
    job = "late-topology"
    spec = paper_case(Fault.COMPUTE_STRAGGLER, job_id=job, steps=30)
    records = list(JobSimulator(spec, batch_events=settings.publisher_batch_events).records())
    first = [r for r in records if r.topic in (Topic.TOPOLOGY, Topic.LIFECYCLE)][:2]
    assert {r.topic for r in first} == {Topic.TOPOLOGY, Topic.LIFECYCLE}
    rest = [r for r in records if all(r is not f for f in first)]
    step0 = next(r.record for r in rest if r.topic is Topic.STEPS)
    foreign = Step(job, 8, 3, step0.start_ns, 1_000_000, 900_000)
    raw = Producer({"bootstrap.servers": settings.bootstrap_servers})
    raw.produce(Topic.STEPS.full(settings), foreign.encode(), job_key(job))
    assert raw.flush(10) == 0
    deadline = time.monotonic() + 90
    while (worker.stats() or {}).get("diagnosis", {}).get("records", 0) < 1:
        assert time.monotonic() < deadline, f"worker did not read the step: {worker.stats()}"
        time.sleep(0.3)
    _publish(settings, first + rest)
    assert wait_diagnosed(settings, job, 120, query=sink.store.query), "diagnosis did not complete"
    deadline = time.monotonic() + 90
    # Until every L3 part is diagnosed the job's context (its topology) is kept; the late step must be judged
    # without it too, against the world size kept for the finished job.
    while any(j["job"] == job for j in (worker.stats() or {}).get("diagnosis", {}).get("jobs", [{"job": job}])):
        assert time.monotonic() < deadline, f"the job's records were not released: {worker.stats()}"
        time.sleep(0.3)
    after = Step(job, 9, 40, step0.start_ns, 1_000_000, 900_000)  # after the job's end
    raw.produce(Topic.STEPS.full(settings), after.encode(), job_key(job))
    assert raw.flush(10) == 0

    sink.wait_for(f"SELECT count() FROM {{db}}.dead_letters FINAL WHERE job_id = '{job}'", 2)
    rows = sink.store.query(f"SELECT stage, reason FROM {sink.store.database}.dead_letters FINAL "
                            f"WHERE job_id = '{job}' ORDER BY reason").rows
    assert len(rows) == 2 and {s for s, _ in rows} == {"diagnose-jobs"}, rows
    assert "rank 8 is not in job" in rows[0][1] and "rank 9 is not in job" in rows[1][1], rows
    findings = fetch_findings(settings, job, query=sink.store.query)
    assert {r for f in findings if f["level"] == "L2" for r in f["ranks"]} == {5}, findings
