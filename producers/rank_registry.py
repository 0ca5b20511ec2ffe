"""A host-local registry of which process runs which rank of which job.

The tracer writes one small JSON file per rank when it starts and removes it when it closes; the stack
collector (:mod:`producers.cpu_stacks`) reads it to find the pid of a rank a finding names. The pid thus comes
from this machine's own files, never from a Kafka record. Each entry also stores the process's start time
(``/proc/<pid>/stat`` field 22, clock ticks since boot) so that a pid reused by another process after the rank
exited is recognized and refused.

Layout: ``<directory>/<job-file-name>/<rank>.json`` where the job's folder name is the job id when it is a
safe file name (``[A-Za-z0-9._-]``, not starting with a dot, at most 100 characters) and otherwise
``job-<sha1 of the job id>``. The directory defaults to ``$ARGUS_RANK_REGISTRY`` or
``<tmp>/argus-ranks-<uid>``; it is created with mode 0700.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["RankEntry", "RankRegistry", "default_registry_dir", "process_start_ticks"]

log = logging.getLogger(__name__)

_SAFE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}$")


def default_registry_dir() -> Path:
    """``$ARGUS_RANK_REGISTRY``, else ``<tmp>/argus-ranks-<uid>``."""
    env = os.environ.get("ARGUS_RANK_REGISTRY")
    if env:
        return Path(env).expanduser()
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return Path(tempfile.gettempdir()) / f"argus-ranks-{uid}"


def process_start_ticks(pid: int) -> int | None:
    """Start time of process ``pid`` in clock ticks since boot (Linux ``/proc``), or None if unknown/gone."""
    try:
        stat = Path(f"/proc/{int(pid)}/stat").read_text()
    except (OSError, ValueError):
        return None
    # The command name (field 2) may contain spaces and parentheses: split after its closing parenthesis.
    rest = stat.rsplit(")", 1)[-1].split()
    try:
        return int(rest[19])  # field 22 overall = index 19 after "state" (field 3) at index 0
    except (IndexError, ValueError):
        return None


@dataclass(frozen=True)
class RankEntry:
    """One rank's process on this host."""

    job_id: str
    rank: int
    pid: int
    host: str
    start_ticks: int | None
    registered_ns: int

    def alive(self) -> bool:
        """The process still runs and is the same one (same start time)."""
        ticks = process_start_ticks(self.pid)
        if ticks is None:
            return False
        return self.start_ticks is None or ticks == self.start_ticks


class RankRegistry:
    """Reads and writes rank entries under ``directory`` (see the module docstring)."""

    def __init__(self, directory: Path | str | None = None) -> None:
        self.directory = Path(directory) if directory is not None else default_registry_dir()

    @staticmethod
    def job_dir_name(job_id: str) -> str:
        if _SAFE.match(job_id):
            return job_id
        return "job-" + hashlib.sha1(job_id.encode("utf-8", "replace")).hexdigest()

    def path(self, job_id: str, rank: int) -> Path:
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise ValueError(f"rank must be a non-negative int, got {rank!r}")
        return self.directory / self.job_dir_name(job_id) / f"{rank}.json"

    def register(self, job_id: str, rank: int, pid: int | None = None, host: str | None = None) -> Path:
        """Write (atomically) the entry of ``rank`` = this process unless ``pid`` is given. Raises OSError."""
        pid = os.getpid() if pid is None else int(pid)
        path = self.path(job_id, rank)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        entry = {"job_id": job_id, "rank": rank, "pid": pid, "host": host or socket.gethostname(),
                 "start_ticks": process_start_ticks(pid), "registered_ns": time.time_ns()}
        fd, tmp = tempfile.mkstemp(prefix=".rank-", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(entry, f)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    def unregister(self, job_id: str, rank: int, pid: int | None = None) -> None:
        """Remove the entry if it is (still) this process's (or ``pid``'s). Never raises."""
        try:
            entry = self.lookup(job_id, rank)
            if entry is not None and entry.pid == (os.getpid() if pid is None else pid):
                self.path(job_id, rank).unlink(missing_ok=True)
        except (OSError, ValueError) as exc:
            log.debug("rank registry entry %s/%s not removed: %s", job_id, rank, exc)

    def lookup(self, job_id: str, rank: int) -> RankEntry | None:
        """The entry of ``rank`` of ``job_id`` on this host, or None. Malformed files count as absent."""
        try:
            path = self.path(job_id, rank)
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        try:
            pid, r = data["pid"], data["rank"]
            ticks = data.get("start_ticks")
            if (not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0 or r != rank
                    or data.get("job_id") != job_id or not (ticks is None or isinstance(ticks, int))):
                return None
            return RankEntry(job_id=job_id, rank=rank, pid=pid, host=str(data.get("host", "")),
                             start_ticks=ticks, registered_ns=int(data.get("registered_ns", 0)))
        except (KeyError, TypeError, ValueError):
            return None
