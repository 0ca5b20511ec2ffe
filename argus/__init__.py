"""argus: always-on tracing and fail-slow diagnosis for large GPU training jobs.

``argus.attach(model, optimizer)`` traces a training rank in one line (see :mod:`producers.attach`); it is
imported on first use, so ``import argus`` alone loads neither torch, Faust nor ClickHouse.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from argus.errors import ArgusError
from argus.settings import Settings

if TYPE_CHECKING:
    from producers.attach import attach, current_tracer

__all__ = ["ArgusError", "Settings", "__version__", "attach", "current_tracer"]

__version__ = "0.1.0"

_LAZY = {"attach": "producers.attach", "current_tracer": "producers.attach"}


def __getattr__(name: str) -> Any:
    """``argus.attach`` and ``argus.current_tracer``, imported when first used."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'argus' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
