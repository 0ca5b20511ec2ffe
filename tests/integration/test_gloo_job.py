"""A real torch.distributed (gloo) job of 4 processes, instrumented with the tracer, one rank slowed in its
forward: the pipeline (real Kafka, Faust, chDB) names that rank."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from argus.settings import Settings
from sinks.findings_query import fetch_findings, wait_diagnosed
from tests.integration.conftest import SinkThread, WorkerProcess, _free_port

pytestmark = pytest.mark.integration
torch = pytest.importorskip("torch", reason="torch is a test dependency (extra 'rank'); CI installs it")

ROOT = Path(__file__).resolve().parents[2]
WORLD, SLOW = 4, 2


def test_gloo_job_slowed_rank_is_flagged(settings: Settings, worker: WorkerProcess, sink: SinkThread,
                                         tmp_path: Path) -> None:
    port = _free_port()
    procs = []
    for rank in range(WORLD):
        env = {**os.environ, **settings.to_env(), "RANK": str(rank), "WORLD_SIZE": str(WORLD),
               "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "ARGUS_EXAMPLE_QUIET": "1", "ARGUS_RANK_REGISTRY": str(tmp_path / "ranks"), "OMP_NUM_THREADS": "1"}
        log = open(tmp_path / f"rank{rank}.log", "wb")  # noqa: SIM115 - closed below
        procs.append((subprocess.Popen([sys.executable, str(ROOT / "examples" / "train_gloo.py"), "--job", "gloo",
                                        "--steps", "40", "--slow-rank", str(SLOW)], env=env, stdout=log,
                                       stderr=subprocess.STDOUT, cwd=ROOT), log))
    for rank, (proc, log) in enumerate(procs):
        rc = proc.wait(timeout=300)
        log.close()
        assert rc == 0, (tmp_path / f"rank{rank}.log").read_text()[-3000:]
    assert wait_diagnosed(settings, "gloo", 120, query=sink.store.query)
    assert sink.scalar("SELECT count() FROM {db}.steps FINAL WHERE job_id = 'gloo'") == WORLD * 40
    findings = fetch_findings(settings, "gloo", query=sink.store.query)
    stragglers = [f for f in findings if f["level"] == "L2" and f["kind"] == "compute_straggler"]
    assert stragglers, findings
    # Four ranks share two cores with the broker, worker and sink here, so a healthy rank can also look
    # slower than its peers; the injected slowdown must be the clear top finding, seen in its forward phase
    # and in its own all-reduce being short (it arrives last, the others wait for it).
    top = max(stragglers, key=lambda f: f["score"])
    assert top["ranks"] == [SLOW] and top["phase"] == "forward", stragglers
    assert top["score"] >= 5 and top["evidence"]["collective_short"] is True
    others = [f for f in stragglers if f is not top]
    assert all(f["score"] < top["score"] / 3 for f in others), stragglers
