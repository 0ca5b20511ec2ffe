"""Stream processing of argus: event-time windows, KDE compression and the Faust agents."""

from streams.compression import summarize_windows
from streams.windows import ClosedWindow, WindowBuffer, WindowUpdate

__all__ = ["ClosedWindow", "WindowBuffer", "WindowUpdate", "summarize_windows"]
