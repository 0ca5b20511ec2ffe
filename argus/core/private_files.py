"""Files only their owner may read: credentials, tokens, the endpoints a home announces."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["write_private"]


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by its owner only (mode 0600), whatever the umask. Raises OSError."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
