"""A hang through the real stack: a simulated job stops completing steps while its ranks keep heartbeating,
one rank in its backward and its DP peers blocked in an all-reduce; the worker names the rank
(``hang_wavefront`` with the DP group, ``job_stalled``) and, when steps complete again, closes the episode
with ``job_resumed``; no rank is called silent."""

from __future__ import annotations

import json
import time

import pytest

from argus.core.settings import Settings
from argus.producers.faults import Fault
from argus.producers.publisher import Publisher
from argus.producers.seed_cases import paper_case
from argus.producers.simulator import JobSimulator
from argus.schemas.records import (
    Heartbeat,
    JobLifecycle,
    JobTopology,
    KernelBatch,
    LifecycleEvent,
    ParallelGroup,
    PhaseKind,
    Step,
)
from argus.topics import Topic, job_key
from tests.integration.conftest import SinkThread, WorkerProcess

pytestmark = pytest.mark.integration

JOB = "hung"
HUNG = 5


def test_a_hang_is_named_and_closed(settings: Settings, worker: WorkerProcess, sink: SinkThread) -> None:
    spec = paper_case(Fault.COMPUTE_STRAGGLER, job_id=JOB, steps=10)
    sim = JobSimulator(spec, batch_events=settings.publisher_batch_events)
    topo: JobTopology | None = None
    last_end = 0
    with Publisher(settings, lossless=True) as pub:
        for rec in sim.records():
            if isinstance(rec.record, JobLifecycle) and rec.record.event is LifecycleEvent.END:
                continue
            if isinstance(rec.record, KernelBatch) and rec.record.end_of_stream:
                continue
            if isinstance(rec.record, JobTopology):
                topo = rec.record
            if isinstance(rec.record, Step):
                last_end = max(last_end, rec.record.start_ns + rec.record.wall_ns)
            pub.publish(rec.topic, rec.key, rec.record)
        assert pub.flush(30) == 0 and topo is not None
        dp = topo.dp_group[topo.rank.index(HUNG)]
        peers = [r for r, g in zip(topo.rank, topo.dp_group, strict=True) if g == dp and r != HUNG]
        hang_at = last_end + 10_000_000
        # The ranks stay alive (heartbeats every 250 ms of event and wall time) but no step completes.
        deadline = time.monotonic() + 60
        found = False
        t = hang_at
        while time.monotonic() < deadline and not found:
            for r in topo.rank:
                if r == HUNG:
                    hb = Heartbeat(JOB, r, t, 10, "backward", PhaseKind.BACKWARD)
                elif r in peers:
                    hb = Heartbeat(JOB, r, t, 10, "dp-allreduce", PhaseKind.ALL_REDUCE, PhaseKind.ALL_REDUCE,
                                   ParallelGroup.DP, dp, 7, hang_at)
                else:
                    hb = Heartbeat(JOB, r, t, 10, "forward", PhaseKind.FORWARD)
                pub.publish(Topic.HEARTBEATS, job_key(JOB), hb)
            pub.flush(10)
            time.sleep(0.25)
            t += 250_000_000
            found = sink.scalar(f"SELECT count() FROM {{db}}.findings FINAL WHERE job_id = '{JOB}' "
                                "AND kind = 'hang_wavefront'") > 0
        assert found, "no hang_wavefront within 60 s"
        # The job resumes: every rank completes step 10.
        for r in topo.rank:
            pub.publish(Topic.STEPS, job_key(JOB), Step(JOB, r, 10, hang_at - 100_000_000, t - hang_at + 200_000_000,
                                                        100_000_000))
        assert pub.flush(30) == 0
    sink.wait_for(f"SELECT count() FROM {{db}}.findings FINAL WHERE job_id = '{JOB}' AND kind = 'job_resumed'", 1,
                  timeout_s=60)
    rows = sink.store.query(f"SELECT kind, ranks, evidence_json FROM {sink.store.database}.findings FINAL "
                            f"WHERE job_id = '{JOB}' AND kind IN ('hang_wavefront', 'job_stalled', 'rank_silent', "
                            "'job_resumed')").rows
    kinds = sorted(k for k, _, _ in rows)
    assert "job_stalled" in kinds and "rank_silent" not in kinds, kinds
    waves = [(list(ranks), json.loads(ev)) for k, ranks, ev in rows if k == "hang_wavefront"]
    dp_waves = [(ranks, ev) for ranks, ev in waves if ev["group"] == "DP"]
    assert len(dp_waves) == 1, waves
    ranks, ev = dp_waves[0]
    assert ranks == [HUNG] and ev["victims"] == peers and ev["first_ranks"] == [HUNG]
    assert ev["collective"] == "ALL_REDUCE" and ev["seq"] == 7
