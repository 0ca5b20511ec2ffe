"""``argus status`` lists the jobs a worker holds state for."""

from __future__ import annotations

import pytest

from argus.cli import _out_jobs


def test_jobs_table(capsys: pytest.CaptureFixture[str]) -> None:
    jobs = [{"job": f"j{i}", "state": "open", "age_s": 12.3 + i, "idle_s": 1.0, "last_step": i, "held_messages": 40}
            for i in range(3)]
    _out_jobs({"open_jobs": 3, "held_messages": 120, "jobs_abandoned": 1, "jobs_diagnosed": 5, "jobs": jobs},
              limit=2)
    out = capsys.readouterr().out
    assert "open=3" in out and "held messages=120" in out and "abandoned=1" in out
    assert "j0" in out and "j1" in out and "j2" not in out and "1 more" in out
    assert "age_s" in out and "last_step" in out


def test_no_worker_stats_prints_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    _out_jobs(None)
    _out_jobs({"open_jobs": 0, "held_messages": 0})
    out = capsys.readouterr().out
    assert out.count("open=0") == 1 and "job " not in out
