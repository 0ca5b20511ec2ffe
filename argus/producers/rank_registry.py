"""A host-local registry of which process runs which rank of which job.

The tracer writes one small JSON file per rank when it starts and removes it when it closes; the stack
collector (:mod:`argus.producers.cpu_stacks`) reads it to find the pid of a rank a finding names. The pid thus comes
from this machine's own files, never from a Kafka record. Each entry also stores the process's start time
(``/proc/<pid>/stat`` field 22, clock ticks since boot) so that a pid reused by another process after the rank
exited is recognized and refused.

Layout: ``<directory>/<job-file-name>/<rank>.json`` where the job's folder name is the job id when it is a
safe file name (``[A-Za-z0-9._-]``, not starting with a dot, at most 100 characters) and otherwise
``job-<sha1 of the job id>``. The directory defaults to ``$ARGUS_RANK_REGISTRY`` or
``<tmp>/argus-ranks-<uid>``.

Details and reasoning: docs/internals/producers.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import socket
import stat
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from argus.core.errors import ProducerError

__all__ = ["RankEntry", "RankRegistry", "UnsafeRegistryError", "default_registry_dir", "process_start_ticks",
           "process_uid"]

log = logging.getLogger(__name__)

_SAFE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}$")
_MAX_ENTRY_BYTES = 4096
_PID_MAX_LIMIT = 1 << 22  # Linux's PID_MAX_LIMIT: no pid is ever larger
_ENTRY_KEYS = {"job_id", "rank", "pid", "host", "start_ticks", "registered_ns"}
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafeRegistryError(ProducerError):
    """A registry folder or entry that another user could have written (wrong owner, writable by others,
    a symbolic link): it is not used."""


def _pid_max() -> int:
    try:
        return min(int(Path("/proc/sys/kernel/pid_max").read_text()), _PID_MAX_LIMIT)
    except (OSError, ValueError):
        return _PID_MAX_LIMIT


def _valid_pid(pid: Any) -> bool:
    # pid 1 is init: never a rank, and not a process to pause for a dump.
    return isinstance(pid, int) and not isinstance(pid, bool) and 1 < pid <= _pid_max()


def _check_private(st: os.stat_result, what: str) -> None:
    """Raise :class:`UnsafeRegistryError` unless ``st`` is owned by this user and not writable by others."""
    euid = os.geteuid()
    if st.st_uid != euid:
        raise UnsafeRegistryError(f"{what} is owned by uid {st.st_uid}, not by this user (uid {euid})")
    if st.st_mode & 0o022:
        raise UnsafeRegistryError(f"{what} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})")


def process_uid(pid: int) -> int | None:
    """The (effective) user id owning process ``pid`` (owner of ``/proc/<pid>``), or None if unknown/gone."""
    try:
        return os.stat(f"/proc/{int(pid)}").st_uid
    except (OSError, ValueError):
        return None


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
    #: The user who wrote the entry (its file's owner).
    uid: int = field(default_factory=os.geteuid)

    def alive(self) -> bool:
        """The process still runs, is the same one (same start time) and belongs to the entry's owner."""
        ticks = process_start_ticks(self.pid)
        if ticks is None or self.start_ticks is None or ticks != self.start_ticks:
            return False
        return process_uid(self.pid) == self.uid


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

    def _private_dir(self, path: Path) -> None:
        """Create ``path`` 0700, or check that an existing one is ours (narrowed to 0700) and no link."""
        with contextlib.suppress(FileExistsError):
            path.mkdir(mode=0o700)
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            raise UnsafeRegistryError(f"rank registry folder {path} is not a directory (a link?)")
        if st.st_uid != os.geteuid():
            _check_private(st, f"rank registry folder {path}")
        if stat.S_IMODE(st.st_mode) != 0o700:  # also folders made 0755 by earlier versions
            os.chmod(path, 0o700, follow_symlinks=False)

    def register(self, job_id: str, rank: int, pid: int | None = None, host: str | None = None) -> Path:
        """Write (atomically, 0600) the entry of ``rank`` = this process unless ``pid`` is given.

        Raises:
            OSError: the folder or file cannot be written.
            UnsafeRegistryError: the registry folder belongs to another user or is not a directory.
            ValueError: a negative rank or a pid outside ``2..pid_max``.
        """
        pid = os.getpid() if pid is None else pid
        if not _valid_pid(pid):
            raise ValueError(f"pid must be an int in 2..{_pid_max()}, got {pid!r}")
        path = self.path(job_id, rank)
        self.directory.parent.mkdir(parents=True, exist_ok=True)
        self._private_dir(self.directory)
        self._private_dir(path.parent)
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

    def _read_private(self, path: Path) -> tuple[bytes, int]:
        """The entry file's bytes and owner, each folder on the way and the file opened without following
        links and checked on the opened descriptor (nothing can be swapped in between)."""
        fds: list[int] = []
        try:
            fds.append(os.open(self.directory, _DIR_FLAGS))
            _check_private(os.fstat(fds[-1]), f"rank registry folder {self.directory}")
            fds.append(os.open(path.parent.name, _DIR_FLAGS, dir_fd=fds[-1]))
            _check_private(os.fstat(fds[-1]), f"rank registry folder {path.parent}")
            fds.append(os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                               dir_fd=fds[-1]))
            st = os.fstat(fds[-1])
            if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_ENTRY_BYTES:
                raise UnsafeRegistryError(f"rank registry entry {path} is not a regular file of at most "
                                          f"{_MAX_ENTRY_BYTES} bytes")
            _check_private(st, f"rank registry entry {path}")
            return os.read(fds[-1], _MAX_ENTRY_BYTES + 1), st.st_uid
        finally:
            for fd in fds:
                os.close(fd)

    def lookup(self, job_id: str, rank: int) -> RankEntry | None:
        """The entry of ``rank`` of ``job_id`` on this host, or None.

        Missing and malformed entries count as absent; entries another user could have written are refused
        with a warning (see the module docstring).
        """
        try:
            path = self.path(job_id, rank)
        except ValueError:
            return None
        try:
            raw, uid = self._read_private(path)
        except FileNotFoundError:
            return None
        except UnsafeRegistryError as exc:
            log.warning("refused: %s", exc)
            return None
        except OSError as exc:  # e.g. ELOOP: a symbolic link where a folder or entry should be
            log.warning("refused rank registry entry %s: %s", path, exc)
            return None
        try:
            data = json.loads(raw)
        except ValueError:
            return None
        if not isinstance(data, dict) or set(data) != _ENTRY_KEYS:
            return None
        pid, ticks, host, registered = data["pid"], data["start_ticks"], data["host"], data["registered_ns"]
        ints = (ticks, registered, data["rank"])
        if (data["job_id"] != job_id or data["rank"] != rank or not _valid_pid(pid) or not isinstance(host, str)
                or len(host) > 255 or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                              for v in ints)):
            return None
        return RankEntry(job_id=job_id, rank=rank, pid=pid, host=host, start_ticks=ticks,
                         registered_ns=registered, uid=uid)
