"""Stream processing of argus: event-time windows, KDE compression and the Faust agents."""

from argus.streams.compression import summarize_windows
from argus.streams.windows import ClosedWindow, WindowBuffer, WindowUpdate

__all__ = ["ClosedWindow", "WindowBuffer", "WindowUpdate", "summarize_windows"]
