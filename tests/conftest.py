"""Test-session defaults shared by every tier.

Property tests draw the same examples on every run (Hypothesis' ``derandomize``): a suite that must pass on
a clean clone cannot depend on the luck of a draw. To explore new examples, run
``pytest --hypothesis-profile explore`` (random draws, failures kept in ``.hypothesis``).

Under ``--dist loadfile`` (``scripts/test``) pytest-xdist gives each worker whole files, and here the fault
suite's files go as one unit: its private stack and its 3-broker cluster never run at once. With
``--no-loadscope-reorder`` the units start in the order of ``testpaths``, the longest first (docs/testing.md).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

import pytest
from hypothesis import settings

settings.register_profile("deterministic", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile("deterministic")

FAULTS = "tests/faults"


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_configure(config: pytest.Config) -> None:
    """A run stopped by SIGTERM (a cancelled CI job, a ``timeout``) unwinds as Ctrl-C does: the session's fixtures
    are torn down, so the brokers and servers they started (in sessions of their own) stop with it instead of
    holding their ports for the next run. Each pytest-xdist worker does the same."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """pytest-xdist's file scheduling, with every file of tests/faults in one work unit; ``None`` (xdist's own
    scheduler) for the other ``--dist`` modes."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FaultsTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return FAULTS if nodeid.startswith(f"{FAULTS}/") else super()._split_scope(nodeid)

    return FaultsTogether(config, log)
