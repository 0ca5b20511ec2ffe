"""Which optional extra of the ``argus-failslow`` distribution a module comes from, and the error that says
how to install it.

The base distribution is the rank side (``argus.attach``, the tracer, the publisher, the heartbeat, the
integrations, ``argus stacks``): confluent-kafka, fastavro, numpy and prometheus-client. The stream worker,
the ClickHouse sink and its query service, reports, replays, trace export, the Kineto importer, the detectors
and the local stack need ``pip install 'argus-failslow[server]'``; torch (extra ``rank``) and cupti-python
(extra ``gpu``) stay the user's. A command or name that needs an extra which is not installed raises
:class:`MissingExtraError` with the pip command, instead of a bare ``ModuleNotFoundError`` from deep inside.
"""

from __future__ import annotations

import enum
import importlib.util
import sys

from argus.core.errors import ArgusError

__all__ = ["Extra", "MissingExtraError", "extra_of", "install_hint", "missing_extra", "require_extra"]


class Extra(enum.Enum):
    """The optional extras of ``argus-failslow`` (``pyproject.toml``)."""

    SERVER = "server"
    RANK = "rank"
    GPU = "gpu"


#: Top-level import names each extra provides (its direct dependencies and the ones argus imports of theirs).
_MODULES: dict[Extra, tuple[str, ...]] = {
    Extra.SERVER: ("faust", "mode", "aiokafka", "scipy", "numba", "llvmlite", "clickhouse_connect", "chdb",
                   "pyarrow", "ijson", "plotly", "tqdm"),
    Extra.RANK: ("torch",),
    Extra.GPU: ("cupti",),
}
_EXTRA_OF = {module: extra for extra, modules in _MODULES.items() for module in modules}


def install_hint(extra: Extra) -> str:
    """What to run to get ``extra``; torch is named as the user's own (a build matching the host's CUDA)."""
    if extra is Extra.RANK:
        return "install torch (your own build; argus supports torch>=2.4,<3) or pip install 'argus-failslow[rank]'"
    return f"pip install 'argus-failslow[{extra.value}]'"


class MissingExtraError(ArgusError, ModuleNotFoundError):
    """A module of an optional extra is not installed. Also a ``ModuleNotFoundError``, so code that treats a
    missing optional import as such (``except ImportError``) still does."""

    def __init__(self, extra: Extra, module: str, what: str) -> None:
        super().__init__(f"{what} needs the '{extra.value}' extra ({module} is not installed): {install_hint(extra)}")
        self.name = module
        self.extra = extra


def extra_of(module: str) -> Extra | None:
    """The extra that provides ``module`` (a dotted name; its top-level package decides), or ``None``."""
    return _EXTRA_OF.get(module.partition(".")[0])


def missing_extra(exc: ModuleNotFoundError, what: str) -> MissingExtraError | None:
    """The error to raise (``from exc``) in place of ``exc`` when the missing module belongs to an extra;
    ``None`` when it does not (a genuinely broken installation: re-raise ``exc``)."""
    if isinstance(exc, MissingExtraError):
        return exc
    extra = extra_of(exc.name or "")
    return MissingExtraError(extra, exc.name or "", what) if extra is not None else None


def require_extra(extra: Extra, what: str) -> None:
    """Check, without importing them, that the modules of ``extra`` are installed (e.g. before ``argus up``
    starts processes that need them).

    Raises:
        MissingExtraError: the first module of ``extra`` that is not installed, with the pip command.
    """
    for module in _MODULES[extra]:
        if module in sys.modules:  # imported already (find_spec refuses a module whose __spec__ is unset)
            continue
        if importlib.util.find_spec(module) is None:
            raise MissingExtraError(extra, module, what)
