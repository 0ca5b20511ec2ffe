"""A real torch.distributed (gloo) job of 4 processes, instrumented with the tracer, one rank slowed in its
forward: the pipeline (real Kafka, Faust, chDB) names that rank.

It must pass on a busy 2-core machine, where the four ranks share the cores with the broker, the worker, the
sink and whatever else runs: a healthy rank's forward (about 1 ms alone) then stretches to several ms, and its
all-reduce with it. So the injected slowdown is large (:data:`SLOW_MS` of real work per forward, timed by
the slowed rank's own clock: contention can lengthen it, never shorten it) and the assertions compare what
the pipeline measured with what the test injected, not one rank's luck with the scheduler against another's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from argus.core.settings import Settings
from argus.sinks.findings_query import fetch_findings, wait_diagnosed
from tests.integration.conftest import SinkThread, WorkerProcess
from tests.integration.ranks import EXAMPLES, run_ranks

pytestmark = pytest.mark.integration
torch = pytest.importorskip("torch", reason="torch is a test dependency (extra 'rank'); CI installs it")

WORLD, SLOW = 4, 2
#: Extra work per forward on the slowed rank, ms: far above what contention adds to a healthy rank's forward
#: (its median stayed under 5 ms on two cores with a busy loop on each, against 40 ms of injection before).
SLOW_MS = 200


def test_gloo_job_slowed_rank_is_flagged(settings: Settings, worker: WorkerProcess, sink: SinkThread,
                                         tmp_path: Path) -> None:
    run_ranks(EXAMPLES / "train_gloo.py", ["--job", "gloo", "--steps", "40", "--slow-rank", str(SLOW),
                                           "--slow-ms", str(SLOW_MS)], world=WORLD, settings=settings, log_dir=tmp_path)
    assert wait_diagnosed(settings, "gloo", 120, query=sink.store.query)
    assert sink.scalar("SELECT count() FROM {db}.steps FINAL WHERE job_id = 'gloo'") == WORLD * 40
    findings = fetch_findings(settings, "gloo", query=sink.store.query)
    stragglers = [f for f in findings if f["level"] == "L2" and f["kind"] == "compute_straggler"]
    assert stragglers, findings
    # A healthy rank can also look slower than its peers on a busy machine; the injected slowdown must be the
    # clear top finding, seen in its forward phase and in its own all-reduce being short (it arrives last,
    # the others wait for it).
    top = max(stragglers, key=lambda f: f["score"])
    assert top["ranks"] == [SLOW] and top["phase"] == "forward", stragglers
    assert top["score"] >= 5 and top["evidence"]["collective_short"] is True, top
    # A healthy rank's score is its excess over the noise of its peers, and on two loaded cores that noise can
    # be tiny for one rank and large for another: what it costs the job (below, in ms per step) is compared
    # with the injection instead.
    others = [f for f in stragglers if f is not top]
    # Against what the test controls: the slowed rank's forward exceeds its peers' by the injected time (its
    # own clock; its model forward may also be longer or shorter than theirs by contention), and what any
    # other rank adds per step is a small fraction of it.
    excess_ms = top["evidence"]["rank_ms"] - top["evidence"]["peers_median_ms"]
    assert excess_ms >= 0.8 * SLOW_MS, top
    assert all(f["evidence"]["delay_ms_per_step"] < SLOW_MS / 4 for f in others), stragglers
