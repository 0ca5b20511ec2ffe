"""argus: always-on tracing and fail-slow diagnosis for large GPU training jobs."""

from argus.errors import ArgusError
from argus.settings import Settings

__all__ = ["ArgusError", "Settings", "__version__"]

__version__ = "0.1.0"
