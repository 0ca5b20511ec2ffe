"""Integration fixtures: one real Kafka broker and one chDB per test session (per pytest-xdist worker), started
by the first test that asks for them; per-test topics, groups, databases and a real Faust worker process.
A module whose tests only publish jobs of their own and read their findings may share one settings, worker
and sink among its tests (:func:`running_worker`, :func:`running_sink`), as one deployment serves many jobs.

The broker is the project's own local Apache Kafka (started here, on its own port, from the jar cache);
chDB allows one directory per process, so the session shares one store and each test gets a database.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from argus.core.errors import KafkaLocalError
from argus.core.settings import Settings
from argus.local_kafka import LocalKafka
from argus.sinks.clickhouse import ClickHouseStore
from argus.sinks.writer import SinkWriter
from argus.topics import ensure_topics
from load_tests.detection_eval import free_port

logger = logging.getLogger(__name__)


def _fixed_bootstrap() -> str | None:
    """Where this session's broker must listen when ``ARGUS_TEST_BOOTSTRAP`` is set: that address for worker
    ``gw0``, ``2 * N`` ports above it for worker ``gwN`` (a broker takes its port and the next, its KRaft
    controller's). None when unset: each worker's broker then takes a free port pair of its own."""
    fixed = os.environ.get("ARGUS_TEST_BOOTSTRAP")
    if not fixed:
        return None
    host, _, port = fixed.rpartition(":")
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    return f"{host}:{int(port) + 2 * worker}"


#: Launches of a session broker on a free port pair before giving up: a port found free can be taken by
#: another process (another suite on the machine, an outgoing connection's ephemeral port) before the broker
#: binds it, and the broker then exits during start-up.
BROKER_LAUNCHES = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    fixed = _fixed_bootstrap()
    for launch in range(1, BROKER_LAUNCHES + 1):
        home = tmp_path_factory.mktemp("kafka-home")
        address = fixed or f"127.0.0.1:{free_port(pair=True)}"
        broker = LocalKafka(Settings.load(env={}, home=home, bootstrap_servers=address))
        try:
            bootstrap = broker.start(timeout_s=120)
            break
        except KafkaLocalError:
            if fixed or launch == BROKER_LAUNCHES:
                raise
            logger.warning("the session broker on %s did not start (launch %d); another port", address, launch,
                           exc_info=True)
    yield bootstrap
    broker.stop()


@pytest.fixture(scope="session")
def chdb_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClickHouseStore]:
    path = tmp_path_factory.mktemp("chdb")
    store = ClickHouseStore(Settings.load(env={}, clickhouse_dsn=f"chdb://{path}").clickhouse)
    yield store
    store.close()


@pytest.fixture
def settings(kafka: str, tmp_path: Path) -> Settings:
    return fresh_settings(kafka, tmp_path)


def fresh_settings(kafka: str, tmp_path: Path) -> Settings:
    """Settings of one test: its own topic prefix, consumer groups, database and ports."""
    tag = uuid.uuid4().hex[:8]
    s = Settings.load(
        env={}, bootstrap_servers=kafka, topic_prefix=f"t{tag}.", app_id=f"argus-test-{tag}",
        sink_group=f"sink-{tag}", clickhouse_database=f"test_{tag}", partitions=4, session_timeout_s=6,
        worker_web_port=_free_port(), query_port=_free_port(), sink_metrics_port=_free_port(), home=tmp_path,
        query_service_port=_free_port(),
        window_ns=1_000_000_000,
        allowed_lateness_ns=500_000_000, publisher_batch_events=2048,
    )
    ensure_topics(s)
    return s


class WorkerProcess:
    """The real stream worker (``argus worker``) as a child process."""

    def __init__(self, settings: Settings, log_path: Path) -> None:
        self.settings = settings
        self.log_path = log_path
        env = {**os.environ, **settings.to_env()}
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([sys.executable, "-m", "argus.cli", "worker"], stdout=self._log,
                                     stderr=subprocess.STDOUT, env=env)

    def stats(self) -> dict[str, Any] | None:
        from argus.stack import _get_json

        return _get_json(f"http://127.0.0.1:{self.settings.worker_web_port}/stats")

    def wait_healthy(self, timeout_s: float = 240) -> None:
        """Wait until the worker serves its stats. The bound is generous: the first worker of a fresh clone
        compiles its bytecode and numba caches, and on a busy 2-core CI machine that took over 60 s."""
        start = time.monotonic()
        while self.stats() is None:
            exited = self.proc.poll()
            if exited is not None or time.monotonic() - start > timeout_s:
                state = f"exited with {exited}" if exited is not None else f"no stats after {timeout_s:.0f} s"
                raise AssertionError(f"worker did not start ({state}):\n{self.log_path.read_text()[-3000:]}")
            time.sleep(0.2)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


@contextlib.contextmanager
def running_worker(settings: Settings, log_path: Path) -> Iterator[WorkerProcess]:
    """A healthy worker process for the ``with`` block (stopped at its end, its output in ``log_path``)."""
    w = WorkerProcess(settings, log_path)
    try:
        w.wait_healthy()
        yield w
    finally:
        w.stop()


@pytest.fixture
def worker(settings: Settings, tmp_path: Path) -> Iterator[WorkerProcess]:
    with running_worker(settings, tmp_path / "worker.log") as w:
        yield w


class SinkThread:
    """The real sink loop on the session's chDB, in a thread, writing into the test's database."""

    def __init__(self, settings: Settings, store: ClickHouseStore) -> None:
        self.store = store.with_database(settings.clickhouse_database)
        self.store.ensure_schema()
        self.writer = SinkWriter(settings, self.store)
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self.writer.run, args=(self.stop_event,), daemon=True)
        self.thread.start()

    def scalar(self, sql: str) -> Any:
        return self.store.query(sql.replace("{db}", self.store.database)).rows[0][0]

    def wait_for(self, sql: str, expected: Any, timeout_s: float = 90) -> Any:
        deadline = time.monotonic() + timeout_s
        value = None
        while time.monotonic() < deadline:
            value = self.scalar(sql)
            if value == expected:
                return value
            time.sleep(0.3)
        raise AssertionError(f"{sql!r} = {value!r}, expected {expected!r} within {timeout_s} s")

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(30)


@contextlib.contextmanager
def running_sink(settings: Settings, store: ClickHouseStore) -> Iterator[SinkThread]:
    """The sink loop in a thread for the ``with`` block."""
    s = SinkThread(settings, store)
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
def sink(settings: Settings, chdb_store: ClickHouseStore) -> Iterator[SinkThread]:
    with running_sink(settings, chdb_store) as s:
        yield s
