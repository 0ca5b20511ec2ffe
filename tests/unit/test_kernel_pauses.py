"""Pause spans read back from heartbeats (what ``argus findings`` prints): spans per rank from the first paused
heartbeat to the first that is not, open spans at the end, other jobs and unpaused ranks left out; on a real
embedded chDB, in a child process (one chDB session per process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from argus.sinks.kernel_pauses import PauseSpan, format_pauses

ROOT = Path(__file__).resolve().parents[2]
S = 1_000_000_000
T0 = 1_780_000_000 * S

_CHILD = r"""
import json, sys
from pathlib import Path
from argus.core.settings import Settings
from argus.schemas.records import Heartbeat, PauseReason
from argus.sinks.clickhouse import ClickHouseStore
from argus.sinks.kernel_pauses import kernel_pauses
from argus.sinks.tables import TABLES

home = Path(sys.argv[1])
T0, S = int(sys.argv[2]), 1_000_000_000
settings = Settings.load(env={}, home=home, clickhouse_dsn=f"chdb://{home}/chdb")
store = ClickHouseStore(settings.clickhouse)
store.ensure_schema()
C, P = (PauseReason.CONTROL,), (PauseReason.PROFILER,)
# (rank, second, paused for): rank 0 paused 2-4 s, rank 1 never, rank 2 paused 1-3 s and again from 6 s on.
beats = [(0, 0, ()), (0, 2, C), (0, 3, C), (0, 4, ()), (0, 5, ()),
         (1, 0, ()), (1, 5, ()),
         (2, 0, ()), (2, 1, P), (2, 2, P), (2, 3, ()), (2, 6, C), (2, 7, C)]
rows = [row for r, t, why in beats
        for row in TABLES["heartbeats"].rows(Heartbeat("job-p", r, T0 + t * S, kernels_paused=bool(why),
                                                       pause_reasons=why))]
rows += list(TABLES["heartbeats"].rows(Heartbeat("other", 0, T0, kernels_paused=True, pause_reasons=C)))
store.insert(TABLES["heartbeats"], rows)
print(json.dumps([s.__dict__ for s in kernel_pauses(settings, "job-p", query=store.query)]))
"""


@pytest.mark.slow
def test_pause_spans_from_heartbeats(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path), str(T0)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    spans = [PauseSpan(**d) for d in json.loads(done.stdout.strip().splitlines()[-1])]
    assert spans == [PauseSpan(0, T0 + 2 * S, T0 + 4 * S, "CONTROL", False),
                     PauseSpan(2, T0 + 1 * S, T0 + 3 * S, "PROFILER", False),
                     PauseSpan(2, T0 + 6 * S, T0 + 7 * S, "CONTROL", True)]
    lines = format_pauses(spans)
    assert lines[0].startswith("rank 0: kernel records paused 2026-05-28 ") and "(CONTROL)" in lines[0]
    assert "still paused at the last heartbeat" in lines[2]
