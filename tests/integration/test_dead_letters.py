"""Malformed messages go to the dead-letter topic with their reason, and the pipeline keeps running."""

from __future__ import annotations

import pytest
from confluent_kafka import Producer

from argus.core.settings import Settings
from argus.producers.publisher import Publisher
from argus.schemas.codec import codec
from argus.schemas.records import KernelBatch
from argus.topics import Topic, rank_key
from tests.integration.conftest import SinkThread, WorkerProcess
from tests.samples import kernel_batch

pytestmark = pytest.mark.integration


def test_malformed_messages_are_dead_lettered_and_processing_continues(
        settings: Settings, worker: WorkerProcess, sink: SinkThread) -> None:
    raw = Producer({"bootstrap.servers": settings.bootstrap_servers})
    raw.produce(Topic.KERNELS.full(settings), b"not avro at all", b"job-x/0")
    raw.produce(Topic.STEPS.full(settings), b"\xa7\x01\x99", b"job-x/0")
    truncated = kernel_batch(n=50, job="job-x").encode()[:-7]
    raw.produce(Topic.KERNELS.full(settings), truncated, b"job-x/1")
    assert raw.flush(10) == 0

    total = 0
    with Publisher(settings) as pub:
        for rank in range(2):
            b = kernel_batch(n=500, rank=rank, job="job-ok")
            total += len(b)
            pub.publish(Topic.KERNELS, rank_key("job-ok", rank), b)
            eos = KernelBatch("job-ok", rank, 1, (), [], [], [], [], [], end_of_stream=True)
            pub.publish(Topic.KERNELS, rank_key("job-ok", rank), eos)
        assert pub.flush(10) == 0

    sink.wait_for("SELECT count() FROM {db}.dead_letters FINAL", 3)
    rows = sink.store.query(f"SELECT topic, stage, reason FROM {sink.store.database}.dead_letters FINAL "
                            "ORDER BY reason").rows
    got = sorted((t.split(".")[-1], stage, reason.split(":")[0]) for t, stage, reason in rows)
    latest = f"kernel_batch.v{codec('kernel_batch').latest}"  # the truncated batch was written as the newest
    assert got == [("kernels", "compress", "kernel_batch"), ("kernels", "compress", latest),
                   ("steps", "sink", "step.v1")]
    assert any("missing magic byte" in r for _, _, r in rows)
    assert any("corrupt body" in r for t, _, r in rows if t.endswith("kernels"))
    # The agent kept running: the valid job after the bad messages is fully summarized.
    sink.wait_for("SELECT sum(n_events) FROM {db}.kernel_summaries FINAL WHERE job_id = 'job-ok'", total)
    stats = worker.stats()
    assert stats is not None and stats["dead_letters"] == 2 and stats["pending_messages"] == 0
