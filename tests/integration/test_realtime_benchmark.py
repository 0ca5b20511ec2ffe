"""``load_tests/realtime.py`` end to end at a toy size (32 ranks, 10 s) through its own private stack, so that
the benchmark keeps working; its budgets are judged at full size (10,240 ranks, 300 s), not here."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from load_tests import realtime


def test_realtime_publishes_at_the_jobs_pace_and_reports_every_figure(capsys: pytest.CaptureFixture[str]) -> None:
    before = set(Path(tempfile.gettempdir()).glob("argus-realtime-*"))
    realtime.main(["--ranks", "32", "--duration-s", "10", "--kernel-sample", "32"])
    assert set(Path(tempfile.gettempdir()).glob("argus-realtime-*")) <= before  # its private stack's folder went
    out = json.loads(capsys.readouterr().out)
    assert out["steps"] == 20 and out["messages"]["phases"] == out["messages"]["steps"] == 32 * 20
    assert out["messages"]["heartbeats"] == 32 * 5 and out["kernel_events"] > 0
    assert out["published_s"] >= 9.0  # at the job's pace, not as fast as it can
    assert out["worker_rss_mb"]["samples"] >= 4 and out["worker_rss_mb"]["peak"] > 0
    assert set(out["lag_steps"]) >= {"samples", "max", "p50", "p95"} and out["straggler"]["rank"] == 5
    assert isinstance(out["within_budget"], bool) and len(out["load_average"]["end"]) == 3
