"""The fake CUPTI activity API (see the package docstring).

While ``CONCURRENT_KERNEL`` (10) is enabled, a daemon thread makes ``KERNELS_PER_TICK`` kernel records every
``TICK_S`` seconds, stamped with the host clock (so the clock offset argus measures is 0), identical on every
rank, and hands them to the registered buffer-completed callback; ``activity_flush_all`` hands over what is
pending at once. ``FAKE_CUPTI_HELD=1`` in the environment makes ``activity_enable`` refuse as CUPTI does when
another tool holds it, until the file named by ``FAKE_CUPTI_HELD_FILE`` disappears (when set).
"""

from __future__ import annotations

import os
import threading
import time
from types import SimpleNamespace
from typing import Any

KIND_CONCURRENT_KERNEL = 10
TICK_S = 0.05
KERNELS_PER_TICK = 4
_NAMES = ("ampere_sgemm_128x64_tn", "vectorized_elementwise_kernel", "reduce_kernel", "softmax_warp_forward")


class ActivityAttribute:
    ATTR_DEVICE_BUFFER_SIZE = 0
    ATTR_DEVICE_BUFFER_PRE_ALLOCATE_VALUE = 7
    ATTR_DEVICE_BUFFER_POOL_LIMIT = 2


class cuptiError(RuntimeError):  # noqa: N801 - the real module's name
    pass


_lock = threading.Lock()
_enabled: set[int] = set()
_completed: Any = None
_pending: list[Any] = []
_thread: threading.Thread | None = None
_corr = 0


def _held() -> bool:
    if os.environ.get("FAKE_CUPTI_HELD") != "1":
        return False
    path = os.environ.get("FAKE_CUPTI_HELD_FILE")
    return path is None or os.path.exists(path)


def activity_set_attribute(attr: int, size: int, ptr: int) -> None:
    pass


def activity_register_callbacks(requested: Any, completed: Any) -> None:
    global _completed
    _completed = completed


def activity_enable(kind: int) -> None:
    global _thread
    if _held():
        raise cuptiError("CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED")
    with _lock:
        _enabled.add(kind)
        if _thread is None:
            _thread = threading.Thread(target=_run, name="fake-cupti", daemon=True)
            _thread.start()


def activity_disable(kind: int) -> None:
    with _lock:
        _enabled.discard(kind)


def activity_flush_period(ms: int) -> None:
    pass


def activity_flush_all(flag: int) -> None:
    _deliver()


def get_timestamp() -> int:
    return time.time_ns()


def get_stream_id_ex(ctx: int, stream: int, per_thread: int) -> int:
    return 7


def _deliver() -> None:
    with _lock:
        recs, _pending[:] = list(_pending), []
        cb = _completed
    if recs and cb is not None:
        cb(recs)


def _run() -> None:
    global _corr
    while True:
        time.sleep(TICK_S)
        with _lock:
            on = KIND_CONCURRENT_KERNEL in _enabled
            if on:
                t = time.time_ns() - 1_000_000
                for i in range(KERNELS_PER_TICK):
                    _corr += 1
                    start = t + i * 100_000
                    _pending.append(SimpleNamespace(kind=KIND_CONCURRENT_KERNEL, name=_NAMES[i % len(_NAMES)],
                                                    start=start, end=start + 50_000 + 10_000 * i, stream_id=7,
                                                    correlation_id=_corr))
        if on:
            _deliver()
