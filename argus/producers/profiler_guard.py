"""A profiler alongside: argus steps aside while a torch.profiler session of this process traces the GPU.

CUPTI serves one activity client per process: Kineto (behind ``torch.profiler.profile`` and
``torch.autograd.profiler.profile``) registers its own buffer callbacks and enables its own activities when a
session is prepared, and argus, always on, would otherwise keep the records the user asked their profiler
for, or make it fail (pytorch #117935). :class:`ProfilerGuard` wraps the three methods every such session goes
through, on ``torch.autograd.profiler.profile``: see docs/internals/producers.md.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["ProfilerGuard"]

log = logging.getLogger(__name__)

_METHODS = ("_prepare_trace", "_start_trace", "__exit__")


def _traces_gpu(prof: Any) -> bool:
    """Whether a profiler session traces the GPU (it then takes CUPTI); True when it cannot be told."""
    try:
        from torch.autograd import ProfilerActivity

        activities = getattr(prof, "kineto_activities", None)
        return activities is None or ProfilerActivity.CUDA in activities
    except Exception:
        return True


class ProfilerGuard:
    """Pauses argus's kernel records while torch.profiler sessions of this process trace the GPU.

    Args:
        pause, resume: called (on the thread that starts or stops the session) when the first GPU session
            starts and when the last one stops. They must not raise into the profiler; errors are logged.
    """

    def __init__(self, pause: Callable[[], None], resume: Callable[[], None]) -> None:
        self._pause, self._resume = pause, resume
        self._lock = threading.Lock()
        self._active: set[int] = set()  # id() of the sessions that hold argus aside
        self._installed: dict[str, tuple[Any, Any]] = {}  # method -> (what it wrapped, its wrapper)
        self._on = False
        #: Profiler sessions that made argus step aside so far.
        self.sessions = 0

    @property
    def active(self) -> bool:
        """A GPU profiler session of this process is running now."""
        return bool(self._active)

    def install(self) -> bool:
        """Wrap the profiler's methods; False when torch (or its profiler) is not there. Idempotent."""
        if self._on:
            return True
        try:
            from torch.autograd import profiler as autograd_profiler

            cls = autograd_profiler.profile
        except Exception as exc:
            log.debug("torch profiler not available: %s", exc)
            return False
        for name in _METHODS:
            original = getattr(cls, name)
            wrapper = self._wrap(name, original)
            setattr(cls, name, wrapper)
            self._installed[name] = (original, wrapper)
        self._cls = cls
        self._on = True
        return True

    def uninstall(self) -> None:
        """Undo :meth:`install` (a wrapper installed on top of this one since stays, and this one passes through).
        A session still running then no longer holds argus aside."""
        if not self._on:
            return
        self._on = False
        for name, (original, wrapper) in self._installed.items():
            if getattr(self._cls, name, None) is wrapper:
                setattr(self._cls, name, original)
        self._installed.clear()
        with self._lock:
            self._active.clear()

    def _wrap(self, name: str, original: Any) -> Any:
        if name == "__exit__":
            @functools.wraps(original)
            def stop(prof: Any, *args: Any, **kwargs: Any) -> Any:
                try:
                    return original(prof, *args, **kwargs)
                finally:
                    self._stopped(prof)
            return stop

        @functools.wraps(original)
        def start(prof: Any, *args: Any, **kwargs: Any) -> Any:
            self._starting(prof)
            return original(prof, *args, **kwargs)
        return start

    def _starting(self, prof: Any) -> None:
        if not self._on or not getattr(prof, "enabled", True) or not _traces_gpu(prof):
            return
        with self._lock:
            if id(prof) in self._active:
                return  # prepared before: already aside
            first = not self._active
            self._active.add(id(prof))
            if first:
                self.sessions += 1
        if first:
            log.info("a torch.profiler session takes CUPTI: argus kernel records paused until it stops")
            self._call(self._pause)

    def _stopped(self, prof: Any) -> None:
        with self._lock:
            if id(prof) not in self._active:
                return
            self._active.discard(id(prof))
            last = not self._active
        if last:
            log.info("torch.profiler sessions done: argus takes CUPTI back")
            self._call(self._resume)

    @staticmethod
    def _call(fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:  # never into the user's profiler
            log.warning("argus: kernel pause/resume around a profiler failed: %s: %s", type(exc).__name__, exc)
