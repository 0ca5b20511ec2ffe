"""Give freed heap memory back to the system, periodically, in the long-lived worker and sink processes.

Python's and numpy's freed blocks stay in glibc's heap until the allocator decides to return them, so one
burst (a large job's final diagnosis, a big insert batch) leaves a process's resident memory at its high-water
mark for good, although the objects are gone (seen in ``load_tests/soak.py``: object counts flat, RSS up
25 MB after one burst). ``malloc_trim(0)`` returns the free pages; on a C library without it this is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading

__all__ = ["start_heap_trimmer", "trim_heap"]

log = logging.getLogger(__name__)


def _libc_trim() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None


_TRIM = _libc_trim()


def trim_heap() -> bool:
    """Return the heap's free memory to the system now; whether the C library could."""
    return bool(_TRIM is not None and _TRIM(0))


def start_heap_trimmer(interval_s: float = 60.0) -> threading.Thread | None:
    """A daemon thread that calls :func:`trim_heap` every ``interval_s`` seconds (``None`` without
    ``malloc_trim``)."""
    if _TRIM is None:
        log.info("no malloc_trim in this C library: freed heap memory is returned by the allocator alone")
        return None
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(interval_s):
            trim_heap()

    thread = threading.Thread(target=run, name="argus-heap-trim", daemon=True)
    thread.start()
    return thread
