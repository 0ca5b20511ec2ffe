"""kill -9 of the worker, the sink and the broker in the middle of a 32-rank job (issue 8, "Live faults").

Each process is killed twice in one job: while the job publishes (after step 8 of 40, publishing goes on
while it is down) and, once the supervisor has brought it back and the job is published, while the job is
processed (the job's diagnosis is not complete yet). Nobody runs ``argus up`` in between: the supervisor
restarts it. Against a clean run of the same job (same records, another job id, published the same way): the
same steps, phases and summarized kernel events per window (``FINAL``), no duplicate rows surviving
``FINAL``, nothing dead-lettered, and the same findings (ids computed under one job name). A second clean
run checks the baseline itself: the same job twice without faults must store and find the same.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from typing import Any

import pytest

from tests.faults.conftest import (
    DP,
    DUPLICATE_FACTS,
    PP,
    STEPS,
    TP,
    FaultStack,
    JobRun,
    compare_runs,
    publish_job,
)

pytestmark = [pytest.mark.faults, pytest.mark.timeout(1200)]

def test_clean_run_is_complete_and_exact(clean_run: tuple[JobRun, dict[str, Any]]) -> None:
    run, facts = clean_run
    print(json.dumps({"test": "clean", "job": run.job, "published_kernel_events": run.kernel_events,
                      **{k: v for k, v in facts.items() if k != "finding_ids"}}))
    assert facts["steps"] == run.steps == DP * TP * PP * STEPS
    assert facts["kernel_events"] == run.kernel_events
    assert facts["phases"] > 0 and facts["windows"] > 0
    assert facts["dead_letters"] == 0
    assert all(facts[k] == 0 for k in DUPLICATE_FACTS), facts
    assert facts["findings"] > 0, "case1 (a compute straggler) must be found"


def test_second_clean_run_is_identical(fault_stack: FaultStack, clean_run: tuple[JobRun, dict[str, Any]]) -> None:
    """Without faults, the same job again gives the same store and findings: a difference under kill -9 below
    is the fault's, not the diagnosis' own nondeterminism."""
    clean, expect = clean_run
    run = publish_job(fault_stack, f"again-{uuid.uuid4().hex[:6]}")
    compare_runs(fault_stack, run, clean, expect, "clean-again")


@pytest.mark.parametrize("victim", ["worker", "sink", "kafka"])
def test_kill9_while_publishing_and_while_processing(victim: str, fault_stack: FaultStack,
                                                     clean_run: tuple[JobRun, dict[str, Any]]) -> None:
    clean, expect = clean_run
    stack = fault_stack
    stack.wait_all_healthy()  # the previous test's restarts are over
    before = stack.status()[victim]
    assert before["supervised"], f"{victim} is not supervised: {before}"
    kills: list[dict[str, Any]] = []

    def kill() -> None:
        pid = stack.pid(victim)
        assert pid is not None, f"no running {victim} to kill"
        os.kill(pid, signal.SIGKILL)
        kills.append({"pid": pid, "at": time.monotonic()})

    job = f"{victim}-{uuid.uuid4().hex[:6]}"
    outage: list[float] = []
    diagnosed_parts: list[int] = []

    def kill_when_back() -> None:
        # 2: while the job is processed. This runs after the job's last step is queued and before its END, so
        # however fast the victim caught up after the first kill, the job cannot have been diagnosed yet.
        stack.wait_back(victim, kills[0]["pid"])
        outage.append(time.monotonic() - kills[0]["at"])
        kill()
        diagnosed_parts.append(stack.sql(f"SELECT count() FROM `{stack.settings.clickhouse_database}`.jobs FINAL "
                                         f"WHERE job_id = '{job}' AND event = 'DIAGNOSED'")[0][0])

    t0 = time.monotonic()
    run = publish_job(stack, job, on_step={8: kill, STEPS: kill_when_back})  # 1: while it publishes
    published_s = time.monotonic() - t0
    assert len(kills) == 2, kills
    stack.wait_back(victim, kills[1]["pid"])
    after = stack.status()[victim]
    # The supervisor brought it back twice, without anyone running `argus up`, and says so.
    assert after["restarts"] == before["restarts"] + 2 and after["state"] == "running", after
    assert after["last_exit"] is not None and after["last_exit"]["signal"] == "SIGKILL", after
    # The second kill hit a job still being processed (not every detector part had diagnosed it).
    assert diagnosed_parts == [0], diagnosed_parts
    compare_runs(stack, run, clean, expect, f"kill9-{victim}",
             {"publish_s": round(published_s, 1), "first_outage_s": round(outage[0], 1),
              "restarts": [before["restarts"], after["restarts"]], "last_exit": after["last_exit"]})
