"""py-spy stacks for findings: the rank registry, the capture of a real child process, the capturer's
rules (this host only, once per finding, rate limit, stale findings) and the collector's publication."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import argus.producers.cpu_stacks as cs
from argus.producers.cpu_stacks import StackCaptureError, StackCapturer, StackCollector, capture_stacks, find_py_spy
from argus.producers.rank_registry import RankRegistry, process_start_ticks
from argus.schemas.records import CpuStack, Finding, Level
from argus.topics import Topic, rank_key

CHILD = """
import time
def argus_test_spin():
    while True:
        time.sleep(0.005)
argus_test_spin()
"""


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", CHILD])
    time.sleep(0.5)
    yield proc
    proc.kill()
    proc.wait()


def finding(ranks: tuple[int, ...], fid: str = "f-1", job: str = "job-s", age_s: float = 0.0) -> Finding:
    return Finding(fid, job, Level.L2, "phase_straggler", ranks, (3,), 4.0, "{}", time.time_ns() - int(age_s * 1e9))


def dump_or_skip(pid: int) -> str:
    if find_py_spy() is None:
        pytest.skip("py-spy is not installed")
    try:
        return capture_stacks(pid)
    except StackCaptureError as exc:
        if exc.permission:
            pytest.skip(f"py-spy lacks ptrace permission here: {exc}")
        raise


def test_registry_round_trip_and_safety(tmp_path: Path) -> None:
    reg = RankRegistry(tmp_path)
    path = reg.register("job-1", 3)
    entry = reg.lookup("job-1", 3)
    assert entry is not None and entry.alive() and entry.start_ticks == process_start_ticks(entry.pid)
    assert path == tmp_path / "job-1" / "3.json"
    assert reg.lookup("job-1", 4) is None and reg.lookup("job-2", 3) is None
    odd = "../../etc/passwd"
    reg.register(odd, 0)
    assert reg.path(odd, 0).parent.parent == tmp_path and reg.lookup(odd, 0) is not None
    with pytest.raises(ValueError):
        reg.path("job-1", -1)
    reg.unregister("job-1", 3)
    assert reg.lookup("job-1", 3) is None


def test_registry_refuses_reused_pids_and_bad_files(tmp_path: Path) -> None:
    reg = RankRegistry(tmp_path)
    path = reg.register("job-1", 0)
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "start_ticks": data["start_ticks"] + 1}))  # another process now
    entry = reg.lookup("job-1", 0)
    assert entry is not None and not entry.alive()
    path.write_text(json.dumps({**data, "pid": "1; rm -rf /"}))
    assert reg.lookup("job-1", 0) is None
    path.write_text("not json")
    assert reg.lookup("job-1", 0) is None


def test_capture_a_real_process(child: subprocess.Popen[bytes]) -> None:
    text = dump_or_skip(child.pid)
    threads = json.loads(text)
    frames = [f["name"] for t in threads for f in t["frames"]]
    assert "argus_test_spin" in frames


def test_capture_errors_are_clear(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(StackCaptureError, match="invalid pid"):
        capture_stacks(0)
    with pytest.raises(StackCaptureError, match="invalid pid"):
        capture_stacks("12; reboot")  # type: ignore[arg-type]
    calls: list[tuple[Any, dict[str, Any]]] = []

    def fake_run(cmd: Any, **kw: Any) -> subprocess.CompletedProcess[str]:
        calls.append((cmd, kw))
        return subprocess.CompletedProcess(cmd, 1, "", "Error: Operation not permitted (os error 1)\n")

    monkeypatch.setattr(cs.subprocess, "run", fake_run)
    with pytest.raises(StackCaptureError) as err:
        capture_stacks(4242, py_spy="/bin/py-spy")
    assert err.value.permission and "CAP_SYS_PTRACE" in str(err.value)
    cmd, kw = calls[0]
    assert cmd == ["/bin/py-spy", "dump", "--pid", "4242", "--json"] and kw["shell"] is False


def test_capturer_this_host_once_per_finding(tmp_path: Path, child: subprocess.Popen[bytes]) -> None:
    dump_or_skip(child.pid)
    reg = RankRegistry(tmp_path)
    reg.register("job-s", 2, pid=child.pid)
    cap = StackCapturer(reg, host="node-a")
    out = cap.handle(finding((1, 2)))  # rank 1 is not on this host
    assert len(out) == 1
    st = out[0]
    assert (st.job_id, st.rank, st.pid, st.host, st.finding_id) == ("job-s", 2, child.pid, "node-a", "f-1")
    assert any(f["name"] == "argus_test_spin" for t in st.stacks for f in t["frames"])
    assert CpuStack.decode(st.encode()).stacks_json == st.stacks_json
    assert cap.handle(finding((2,))) == []  # same finding again: once only
    assert cap.not_here == 1


def test_capturer_rate_limit_and_stale(tmp_path: Path) -> None:
    reg = RankRegistry(tmp_path)
    for r in range(3):
        reg.register("job-s", r)  # this test process stands in for the ranks
    seen: list[int] = []

    def fake_capture(pid: int, **kw: Any) -> str:
        seen.append(pid)
        return "[]"

    cap = StackCapturer(reg, host="h", burst=2, per_minute=0.001, capture=fake_capture)
    assert len(cap.handle(finding((0, 1, 2)))) == 2 and cap.rate_limited == 1
    assert cap.handle(finding((0,), fid="old", age_s=3600)) == [] and cap.stale == 1

    def failing(pid: int, **kw: Any) -> str:
        raise StackCaptureError("no ptrace", permission=True)

    cap2 = StackCapturer(reg, host="h", capture=failing)
    assert cap2.handle(finding((0,))) == [] and cap2.failed == 1 and cap2.last_error is not None
    assert cap2.last_error.permission


def test_collector_publishes_stacks(tmp_path: Path) -> None:
    reg = RankRegistry(tmp_path)
    reg.register("job-s", 4)

    class Pub:
        def __init__(self) -> None:
            self.records: list[tuple[Topic, bytes, Any]] = []

        def publish(self, topic: Topic, key: bytes, record: Any) -> bool:
            self.records.append((topic, key, record))
            return True

        def flush(self, timeout_s: float = 30.0) -> int:
            return 0

    from argus.core.settings import Settings

    pub = Pub()
    cap = StackCapturer(reg, host="h", capture=lambda pid, **kw: '[{"frames": []}]')
    coll = StackCollector(Settings(), publisher=pub, capturer=cap)
    assert coll.group_id.endswith("-stacks-h")
    assert len(coll.process(finding((4,)).encode())) == 1
    assert coll.process(b"garbage") == [] and coll.undecodable == 1
    (topic, key, rec), = pub.records
    assert topic is Topic.STACKS and key == rank_key("job-s", 4) and isinstance(rec, CpuStack)
