"""The unit tier runs without a broker: a test here that starts one fails at once, naming the tier it belongs
to (the integration tier's session broker lives in tests/integration/conftest.py and is never loaded here).

Tests marked ``slow`` (pyproject.toml) stay in this tier, broker-free, but out of ``scripts/test --fast``; see
docs/testing.md for what earns the mark.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NoReturn

import pytest

from argus.local_kafka import LocalKafka


def _no_broker(*_args: object, **_kwargs: object) -> NoReturn:
    raise AssertionError("tests/unit runs without a Kafka broker: a test that starts one belongs in "
                         "tests/integration (it uses the session's broker there, the `kafka` fixture)")


@pytest.fixture(autouse=True)
def _unit_tests_start_no_broker() -> Iterator[None]:
    # Per test, not per session: in a run of every tier the integration tests that follow must start brokers.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LocalKafka, "start", _no_broker)
        mp.setattr(LocalKafka, "launch", _no_broker)
        yield
