"""Progress of the long commands (``import-kineto``, ``replay``, ``demo``, ``export-trace``).

On a terminal, a tqdm bar with its rate and ETA; otherwise (a pipe, a log file, CI) a plain line at most every
``interval_s`` seconds and one at the end, so logs stay readable. Library code reports progress through plain
callbacks (``advance(done, total)``); the command line turns them into a :class:`Meter`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from types import TracebackType
from typing import IO, Any

__all__ = ["Advance", "Meter"]

#: ``advance(done, total)``: ``done`` units of ``total`` (``None``: not known yet) are finished.
Advance = Callable[[int, int | None], None]


class Meter:
    """A progress meter on ``stream`` (default stderr) for ``total`` units (``None``: unknown).

    ``tty``: force the bar (True) or plain lines (False); default: whether ``stream`` is a terminal.
    Use it as a context manager, or call :meth:`close`.
    """

    def __init__(self, desc: str, total: int | None = None, unit: str = "it", stream: IO[str] | None = None,
                 interval_s: float = 5.0, tty: bool | None = None) -> None:
        self.desc, self.unit, self.total = desc, unit, total
        self.stream = stream if stream is not None else sys.stderr
        self.interval_s = interval_s
        self.done = 0
        self._t0 = self._last = time.monotonic()
        self._bar: Any = None
        self._finished = False
        if tty if tty is not None else _isatty(self.stream):
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit, file=self.stream, leave=True,
                             dynamic_ncols=True)

    def __call__(self, done: int, total: int | None = None) -> None:
        """Set the absolute progress (the :data:`Advance` callback)."""
        if total is not None and total != self.total:
            self.total = total
            if self._bar is not None:
                self._bar.total = total
        self.update(done - self.done)

    def say(self, msg: str) -> None:
        """A line of text beside the meter (above the bar on a terminal)."""
        if self._bar is not None:
            self._bar.write(f"  · {msg}", file=self.stream)
        else:
            self.stream.write(f"  · {msg}\n")
            self.stream.flush()

    def update(self, n: int = 1) -> None:
        """``n`` more units done."""
        if self.done == 0 and n > 0:
            self._t0 = self._last = time.monotonic()  # the rate counts from the first unit, not from set-up
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
            return
        now = time.monotonic()
        if self.total is not None and self.done >= self.total and not self._finished:
            self._finished = True  # said once, when it happens, not when the command ends
            self._line(now, final=True)
        elif now - self._last >= self.interval_s and not self._finished:
            self._last = now
            self._line(now)

    def _line(self, now: float, final: bool = False) -> None:
        elapsed = max(now - self._t0, 1e-9)
        rate = self.done / elapsed
        of = f"/{self.total:,}" if self.total is not None else ""
        eta = ""
        if not final and self.total is not None and rate > 0 and self.done < self.total:
            eta = f", ETA {(self.total - self.done) / rate:.0f} s"
        state = "done" if final else "…"
        self.stream.write(f"  · {self.desc}: {self.done:,}{of} {self.unit} {state} "
                          f"({rate:,.0f} {self.unit}/s, {elapsed:.1f} s{eta})\n")
        self.stream.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif not self._finished:
            self._finished = True
            self._line(time.monotonic(), final=True)

    def __enter__(self) -> Meter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _isatty(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
