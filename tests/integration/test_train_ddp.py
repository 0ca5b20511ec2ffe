"""A plain DDP (gloo) job of 4 processes whose only argus line is ``argus.attach(model, optimizer)``
(examples/train_ddp.py), one rank slowed in its forward: through the real stack (Kafka, the Faust worker, the
chDB sink) the pipeline names that rank and its forward phase, from phases argus found on its own: the whole
model's forward and backward (module hooks), every DDP gradient bucket's all-reduce (the communication hook)
and the optimizer step, with iteration boundaries from ``optimizer.step()``.

The healthy ranks wait for the slowed one inside their DDP all-reduces (they reach their gradient buckets
first); that waiting must be read as waiting: the slowed rank's own all-reduce is the short one
(``collective_short``) and no finding blames a healthy rank for it. As in test_gloo_job (see its docstring),
the machine is a busy 2-core one: the injected slowdown is large (real work, timed by the slowed rank's own
clock) and every assertion compares what the pipeline measured with what the test injected.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from argus.core.settings import Settings
from argus.sinks.findings_query import fetch_findings, wait_diagnosed
from tests.integration.conftest import SinkThread, WorkerProcess
from tests.integration.ranks import EXAMPLES, run_ranks

pytestmark = pytest.mark.integration
torch = pytest.importorskip("torch", reason="torch is a test dependency (extra 'rank'); CI installs it")

WORLD, SLOW, STEPS = 4, 1, 30
#: Extra work per forward on the slowed rank, ms (see test_gloo_job.SLOW_MS).
SLOW_MS = 200
JOB = "ddp-attach"


def test_ddp_job_traced_by_attach_names_the_slowed_rank(settings: Settings, worker: WorkerProcess,
                                                        sink: SinkThread, tmp_path: Path) -> None:
    t0 = time.monotonic()
    run_ranks(EXAMPLES / "train_ddp.py", ["--steps", str(STEPS), "--slow-rank", str(SLOW), "--slow-ms", str(SLOW_MS)],
              world=WORLD, settings=settings, log_dir=tmp_path, extra_env={"ARGUS_JOB_ID": JOB})
    job_s = time.monotonic() - t0
    assert wait_diagnosed(settings, JOB, 120, query=sink.store.query)
    assert sink.scalar(f"SELECT count() FROM {{db}}.steps FINAL WHERE job_id = '{JOB}'") == WORLD * STEPS
    # The phases argus found without code changes, on every rank.
    rows = sink.store.query(f"SELECT name, kind, grp, uniqExact(rank) FROM {sink.store.database}.phases FINAL "
                            f"WHERE job_id = '{JOB}' AND name != '' GROUP BY name, kind, grp ORDER BY name").rows
    names = {(r[0], r[1], r[2]): int(r[3]) for r in rows}
    assert names == {("backward", "BACKWARD", "NONE"): WORLD, ("dp-allreduce", "ALL_REDUCE", "DP"): WORLD,
                     ("forward", "FORWARD", "NONE"): WORLD, ("optimizer", "OPTIMIZER", "NONE"): WORLD}, names
    per_rank = sink.store.query(
        f"SELECT rank, name, round(median(d) / 1e6, 1) FROM (SELECT rank, step, name, sum(duration_ns) AS d "
        f"FROM {sink.store.database}.phases FINAL WHERE job_id = '{JOB}' AND name != '' GROUP BY rank, step, name) "
        f"GROUP BY rank, name ORDER BY rank, name").rows  # median ms per step, for the failure messages
    findings = fetch_findings(settings, JOB, query=sink.store.query)
    stragglers = [f for f in findings if f["level"] == "L2" and f["kind"] == "compute_straggler"]
    assert stragglers, (findings, per_rank, f"job took {job_s:.0f} s")
    top = max(stragglers, key=lambda f: f["score"])
    assert top["ranks"] == [SLOW] and top["phase"] == "forward", (stragglers, per_rank)
    # The healthy ranks waited in their all-reduces: the slowed rank's is the short one.
    assert top["score"] >= 5 and top["evidence"]["collective_short"] is True, top
    excess_ms = top["evidence"]["rank_ms"] - top["evidence"]["peers_median_ms"]
    assert excess_ms >= 0.8 * SLOW_MS, top
    # No finding blames a healthy rank for the waiting: none names one in a collective phase, and whatever a
    # busy machine makes one of them look like costs the job a small fraction of the injection per step.
    healthy = set(range(WORLD)) - {SLOW}
    for f in findings:
        if not healthy & set(f["ranks"]):
            continue
        assert "allreduce" not in (f["phase"] or ""), f
        assert f["evidence"].get("delay_ms_per_step", 0) < SLOW_MS / 4, f

