"""The rank registry as a boundary between users: private folders, entries another user could have written
refused and skipped, strict entries, and the stack capturer acting only on its own user's ranks."""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from argus.producers.cpu_stacks import StackCapturer
from argus.producers.rank_registry import RankEntry, RankRegistry, UnsafeRegistryError, process_uid
from argus.schemas.records import Finding, Level

NOBODY = 65534
needs_root = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                                reason="giving files to another user needs root")


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def finding(ranks: tuple[int, ...], job: str = "job-r") -> Finding:
    return Finding("f-1", job, Level.L2, "phase_straggler", ranks, (3,), 4.0, "{}", time.time_ns())


def test_folders_are_created_private_and_old_ones_narrowed(tmp_path: Path) -> None:
    top = tmp_path / "deep" / "registry"
    old = os.umask(0)  # even a permissive umask gives 0700 folders and a 0600 entry
    try:
        path = RankRegistry(top).register("job-r", 0)
    finally:
        os.umask(old)
    assert mode(top) == 0o700 and mode(path.parent) == 0o700 and mode(path) == 0o600
    top.chmod(0o755)  # as earlier versions left it
    RankRegistry(top).register("job-r", 1)
    assert mode(top) == 0o700


def test_entries_another_user_could_write_are_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    reg = RankRegistry(tmp_path / "reg")
    path = reg.register("job-r", 0)
    assert reg.lookup("job-r", 0) is not None
    caplog.set_level(logging.WARNING, logger="argus.producers.rank_registry")
    for target, bad in ((path, 0o622), (path.parent, 0o770), (reg.directory, 0o757)):
        good = mode(target)
        target.chmod(bad)
        assert reg.lookup("job-r", 0) is None, target
        target.chmod(good)
    assert caplog.text.count("writable by group or others") == 3
    assert reg.lookup("job-r", 0) is not None


def test_symbolic_links_are_refused(tmp_path: Path) -> None:
    real = RankRegistry(tmp_path / "real")
    real.register("job-r", 0)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert RankRegistry(tmp_path / "link").lookup("job-r", 0) is None  # the registry folder itself
    (real.directory / "job-l").symlink_to(real.directory / "job-r")
    assert real.lookup("job-l", 0) is None  # a job folder
    (real.directory / "job-r" / "1.json").symlink_to(real.directory / "job-r" / "0.json")
    assert real.lookup("job-r", 1) is None  # an entry
    with pytest.raises(UnsafeRegistryError, match="not a directory"):
        RankRegistry(tmp_path / "link").register("job-r", 2)


@needs_root
def test_entries_of_other_users_are_refused(tmp_path: Path) -> None:
    reg = RankRegistry(tmp_path / "reg")
    path = reg.register("job-r", 0)
    os.chown(path, NOBODY, NOBODY)
    assert reg.lookup("job-r", 0) is None
    os.chown(path, 0, 0)
    os.chown(path.parent, NOBODY, NOBODY)
    assert reg.lookup("job-r", 0) is None
    os.chown(path.parent, 0, 0)
    # A registry folder planted by another user (e.g. /tmp/argus-ranks-0 made by someone else) is neither
    # read nor written.
    os.chown(reg.directory, NOBODY, NOBODY)
    assert reg.lookup("job-r", 0) is None
    with pytest.raises(UnsafeRegistryError, match="owned by uid 65534"):
        reg.register("job-r", 1)


@needs_root
def test_a_process_of_another_user_is_never_alive(tmp_path: Path) -> None:
    # An entry of ours naming another user's process (here: a child running as nobody) is not acted on.
    child = subprocess.Popen(["sleep", "30"], user=NOBODY, cwd="/")
    try:
        deadline = time.monotonic() + 10
        while process_uid(child.pid) != NOBODY and time.monotonic() < deadline:
            time.sleep(0.05)
        reg = RankRegistry(tmp_path / "reg")
        reg.register("job-r", 0, pid=child.pid)
        entry = reg.lookup("job-r", 0)
        assert entry is not None and entry.uid == 0 and not entry.alive()
        calls: list[int] = []
        cap = StackCapturer(reg, host="h", capture=lambda pid, **kw: calls.append(pid) or "[]")
        assert cap.handle(finding((0,))) == [] and calls == [] and cap.not_here == 1
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize(
    "change",
    [
        {"pid": 1}, {"pid": 0}, {"pid": -5}, {"pid": 1 << 23}, {"pid": True}, {"pid": "123"}, {"pid": 12.0},
        {"start_ticks": None}, {"start_ticks": -1}, {"rank": 1}, {"job_id": "other"}, {"host": 5},
        {"registered_ns": "now"}, {"extra": "key"},
    ],
)
def test_malformed_entries_are_absent(tmp_path: Path, change: dict[str, Any]) -> None:
    reg = RankRegistry(tmp_path / "reg")
    path = reg.register("job-r", 0)
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    assert reg.lookup("job-r", 0) is None


def test_oversized_and_non_object_entries_are_absent(tmp_path: Path) -> None:
    reg = RankRegistry(tmp_path / "reg")
    path = reg.register("job-r", 0)
    good = json.loads(path.read_text())
    path.write_text(json.dumps({**good, "host": "h" * 5000}))
    assert reg.lookup("job-r", 0) is None
    path.write_text("[1, 2]")
    assert reg.lookup("job-r", 0) is None


def test_register_validates_the_pid(tmp_path: Path) -> None:
    reg = RankRegistry(tmp_path / "reg")
    for pid in (0, 1, -3, 1 << 23, True):
        with pytest.raises(ValueError, match="pid"):
            reg.register("job-r", 0, pid=pid)


def test_own_live_entry_is_alive_and_captured(tmp_path: Path) -> None:
    reg = RankRegistry(tmp_path / "reg")
    reg.register("job-r", 3)
    entry = reg.lookup("job-r", 3)
    assert isinstance(entry, RankEntry) and entry.alive() and entry.uid == os.geteuid()
    cap = StackCapturer(reg, host="h", capture=lambda pid, **kw: "[]")
    (st,) = cap.handle(finding((3,)))
    assert st.pid == os.getpid()
