"""Which local process serves a home's endpoints, so a client sends its token to that process only.

Ports are shared by every user of a host: a process that takes the query port first would receive the token
of whoever asks it, and could answer with forged rows. So a serving process *announces* itself in its home
(``<home>/run/<name>.endpoint``: its pid and port, written 0600 into the user's own 0700 home, which no other
user can write), and a client uses an endpoint only when :func:`verified_port` finds that this very process
listens on that port (on Linux, the socket's inode in ``/proc/net/tcp`` among the process's open files).
Elsewhere, the announcing process must be alive: weaker, but the announcement is still the home's own.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from argus.core.private_files import write_private

__all__ = ["announce", "listens", "verified_port", "withdraw"]

_PROC_NET = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))
_LISTEN = "0A"


def _path(home: Path, name: str) -> Path:
    return home / "run" / f"{name}.endpoint"


def announce(home: Path, name: str, port: int) -> Path:
    """Record that this process serves ``name`` on ``port`` (after it bound the port). Raises OSError."""
    path = _path(home, name)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    write_private(tmp, json.dumps({"pid": os.getpid(), "port": int(port)}))
    tmp.replace(path)
    return path


def withdraw(home: Path, name: str) -> None:
    """Remove this process's announcement of ``name`` (another process's is left alone)."""
    path = _path(home, name)
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError, AttributeError):
        pass


def verified_port(home: Path, name: str) -> int | None:
    """The port of ``name`` as announced in ``home``, if the announcing process is alive and listens on it;
    ``None`` when nothing of this home serves it (then no token may be sent to whatever holds the port)."""
    try:
        doc = json.loads(_path(home, name).read_text())
        pid, port = int(doc["pid"]), int(doc["port"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return port if listens(pid, port) else None


def listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` has a TCP socket listening on ``port`` (any address). Without ``/proc``
    (not Linux): whether ``pid`` is alive."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: never this home's
        return False
    if not _PROC_NET[0].exists():
        return True
    inodes = _listening_inodes(port)
    if not inodes:
        return False
    try:
        for fd in os.scandir(f"/proc/{pid}/fd"):
            try:
                if os.readlink(fd.path) in inodes:
                    return True
            except OSError:
                continue
    except OSError:
        return False
    return False


def _listening_inodes(port: int) -> set[str]:
    """``socket:[inode]`` of every TCP socket listening on ``port``."""
    want = f"{port:04X}"
    out = set()
    for table in _PROC_NET:
        try:
            lines = table.read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 9 and cols[3] == _LISTEN and cols[1].rsplit(":", 1)[-1] == want:
                out.add(f"socket:[{cols[9]}]")
    return out
