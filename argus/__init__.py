"""argus: always-on tracing and fail-slow diagnosis for large GPU training jobs.

The user's entry points: ``argus.attach(model, optimizer)`` traces a training rank in one line (see
:mod:`argus.producers.attach`), :class:`Tracer` is the tracer it builds, :class:`Settings` the configuration and
:func:`fetch_findings` a job's findings from ClickHouse. Each is imported on first use, so ``import argus``
alone loads neither torch, Faust nor ClickHouse, and the rank-side names load no Faust or ClickHouse (the base
distribution installs none of them: a name whose extra is missing raises
:class:`~argus.core.extras.MissingExtraError` with the pip command, e.g. ``fetch_findings`` without
``argus-failslow[server]``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from argus.core.errors import ArgusError
from argus.core.settings import Settings

if TYPE_CHECKING:
    from argus.producers.attach import attach, current_tracer
    from argus.producers.tracer import Tracer
    from argus.sinks.findings_query import fetch_findings

__all__ = ["ArgusError", "Settings", "Tracer", "__version__", "attach", "current_tracer", "fetch_findings"]

__version__ = "0.1.0"

_LAZY = {"attach": "argus.producers.attach", "current_tracer": "argus.producers.attach",
         "Tracer": "argus.producers.tracer", "fetch_findings": "argus.sinks.findings_query"}


def __getattr__(name: str) -> Any:
    """The names of ``_LAZY``, imported when first used."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'argus' has no attribute {name!r}")
    import importlib

    try:
        value = getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as exc:
        from argus.core.extras import missing_extra

        error = missing_extra(exc, f"argus.{name}")
        if error is None:
            raise
        raise error from exc
    globals()[name] = value
    return value
