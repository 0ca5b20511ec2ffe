"""Liveness faults of the simulator through the real stack (Kafka, the worker process, the sink, chDB).

A 32-rank job (DP 8 x TP 2 x PP 2) hangs: from step ``STEP`` rank ``RANK`` never enters its DP all-reduce,
its DP peers block in it, the job keeps heartbeating (every 250 ms, published at the pace of their event
time) for 3 s and then resumes. The worker names the rank (``hang_wavefront``, DP group, the rank as the
suspect and the head of the wavefront) while the job hangs: not before the stall bound has passed since the
last completed step, and before the job resumes. How soon (in step times) is a budget of
``load_tests/detection_latency.py``, not of this test: here the judge's clock is a busy test machine's. A job
whose rank goes silent gets ``rank_silent`` naming it.
"""

from __future__ import annotations

import json
import statistics
import time

import pytest

from argus.core.settings import Settings
from argus.detectors.hangs import HangParams
from argus.producers.faults import FaultSpec
from argus.producers.publisher import Publisher
from argus.producers.simulator import JobSimulator, JobSpec
from argus.producers.topology import build_topology
from tests.integration.conftest import SinkThread, WorkerProcess

pytestmark = pytest.mark.integration

RANK, STEP = 5, 6
HEARTBEAT_S = 0.25


@pytest.fixture
def settings(settings: Settings) -> Settings:
    """The shared per-test settings with a fast heartbeat (the hang detector's tick follows it)."""
    return settings.replace(heartbeat_interval_s=HEARTBEAT_S)


def _run(settings: Settings, job: str, fault: FaultSpec, steps: int) -> JobSimulator:
    spec = JobSpec(job, 8, tp=2, pp=2, steps=steps, layers=2, microbatches=2, fault=fault,
                   heartbeat_interval_ns=int(HEARTBEAT_S * 1e9))
    sim = JobSimulator(spec, batch_events=settings.publisher_batch_events)
    with Publisher(settings, lossless=True) as pub:
        sim.run(pub, realtime_heartbeats=True)
        assert pub.flush(30) == 0
    return sim


def _findings(sink: SinkThread, job: str, kind: str, timeout_s: float = 30) -> list[tuple[list[int], dict, int]]:
    sink.wait_for(f"SELECT count() > 0 FROM {{db}}.findings WHERE job_id = '{job}' AND kind = '{kind}'", 1,
                  timeout_s=timeout_s)
    rows = sink.store.query(f"SELECT ranks, evidence_json, time_ns FROM {sink.store.database}.findings "
                            f"WHERE job_id = '{job}' AND kind = '{kind}' ORDER BY time_ns").rows
    return [(list(r), json.loads(e), int(t)) for r, e, t in rows]


def _median_step_ns(sink: SinkThread, job: str) -> float:
    rows = sink.store.query(f"SELECT wall_ns FROM {sink.store.database}.steps WHERE job_id = '{job}' "
                            f"AND step < {STEP}").rows
    return statistics.median(int(w) for (w,) in rows)


def test_hang_is_named_while_the_job_hangs(settings: Settings, worker: WorkerProcess, sink: SinkThread) -> None:
    job = "sim-hang"
    topo = build_topology(job, 8, 2, 2)
    t0 = time.monotonic()
    hang_ns = 3_000_000_000
    sim = _run(settings, job, FaultSpec.hang(topo, RANK, STEP, hang_ns=hang_ns), steps=STEP + 3)
    assert sim.hang_start_ns is not None
    dp = topo.dp_group[topo.rank.index(RANK)]
    waves = [w for w in _findings(sink, job, "hang_wavefront") if w[1]["group"] == "DP"]
    ranks, ev, first_ns = waves[0]
    assert ranks == [RANK] and ev["group_index"] == dp and ev["first_ranks"] == [RANK], waves[0]
    assert ev["collective"] == "ALL_REDUCE" and ev["step"] == STEP and len(ev["victims"]) == 7
    assert all(w[0] == [RANK] for w in waves)
    median = _median_step_ns(sink, job)
    latency_ns = first_ns - sim.hang_start_ns
    print(f"hang named {latency_ns / 1e9:.3f} s ({latency_ns / median:.2f} step times) after it began; "
          f"run {time.monotonic() - t0:.1f} s")
    # Not early: the job has been stalled for the stall bound (after the last completed step, which is before
    # the hang began); not late: named before the job resumed.
    assert first_ns - sim.hang_start_ns < hang_ns, (latency_ns, median)
    stall_ns = HangParams(heartbeat_interval_ns=int(HEARTBEAT_S * 1e9)).stall_bound_ns(median)
    last_step_end = sink.store.query(f"SELECT max(start_ns + wall_ns) FROM {sink.store.database}.steps "
                                     f"WHERE job_id = '{job}' AND step < {STEP}").rows[0][0]
    assert first_ns - int(last_step_end) >= stall_ns, (first_ns, last_step_end, stall_ns)
    # The job resumes: the episode is closed.
    _findings(sink, job, "job_resumed")


def test_silent_rank_is_named(settings: Settings, worker: WorkerProcess, sink: SinkThread) -> None:
    job = "sim-silent"
    topo = build_topology(job, 8, 2, 2)
    sim = _run(settings, job, FaultSpec.silent_rank(topo, RANK, STEP, hang_ns=3_000_000_000), steps=STEP + 3)
    assert sim.stopped
    silent = _findings(sink, job, "rank_silent")
    assert {tuple(r) for r, _, _ in silent} == {(RANK,)}, silent
