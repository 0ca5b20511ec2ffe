"""The heap trimmer of the worker and sink processes (glibc's malloc_trim)."""

from __future__ import annotations

import sys
import time

import pytest

from argus.heap_trim import start_heap_trimmer, trim_heap


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="malloc_trim is glibc's")
def test_trimming_runs_now_and_in_the_background() -> None:
    blocks = [bytearray(64 * 1024) for _ in range(2000)]  # ~128 MB freed below: something to give back
    del blocks
    trim_heap()  # returns whether memory was released: either is fine; it must not raise
    thread = start_heap_trimmer(interval_s=0.05)
    assert thread is not None and thread.daemon
    time.sleep(0.2)
    assert thread.is_alive()
