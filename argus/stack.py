"""The local stack behind ``argus up``: Apache Kafka, the Faust worker and the ClickHouse sink.

Each service runs as its own background process (new session, log file and pid file under
``<home>/run``), so the stack outlives the command that started it; ``up`` is idempotent (healthy
services are reused) and ``down`` stops them in reverse order. The sink owns the embedded chDB directory
and answers SQL for other processes (see :mod:`sinks.query_server`).
"""

from __future__ import annotations

import enum
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from argus.errors import ArgusError
from argus.local_kafka import LocalKafka, pid_alive
from argus.settings import Settings
from argus.topics import ensure_topics
from sinks.query_server import endpoint_healthy

__all__ = ["Service", "Stack"]

log = logging.getLogger(__name__)


class Service(enum.Enum):
    WORKER = "worker"
    SINK = "sink"


class Stack:
    """Start, stop and inspect the local services for ``settings``."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.run_dir = (settings.home / "run").resolve()
        self.kafka = LocalKafka(settings)

    def up(self, progress: Callable[[str], None] | None = None, timeout_s: float = 120.0) -> dict[str, Any]:
        """Start whatever is not running and wait until all of it is healthy.

        Raises:
            ArgusError: a service did not become healthy in ``timeout_s`` (its log path is in the message).
        """
        say = progress or (lambda _m: None)
        say("kafka: starting (first run downloads Apache Kafka from Maven Central)")
        self.kafka.start(timeout_s=timeout_s)
        created = ensure_topics(self.settings)
        say(f"kafka: healthy on {self.settings.bootstrap_servers}; topics created: {len(created)}")
        for service in Service:
            if self.healthy(service):
                say(f"{service.value}: already running")
                continue
            self._spawn(service)
            say(f"{service.value}: starting")
        deadline = time.monotonic() + timeout_s
        for service in Service:
            while not self.healthy(service):
                if not self._alive(service):
                    raise ArgusError(f"{service.value} exited; see {self.log_path(service)}:\n"
                                     f"{_tail(self.log_path(service))}")
                if time.monotonic() > deadline:
                    raise ArgusError(f"{service.value} not healthy after {timeout_s:.0f} s; "
                                     f"see {self.log_path(service)}")
                time.sleep(0.2)
            say(f"{service.value}: healthy")
        return self.status()

    def down(self, keep_kafka: bool = False) -> None:
        """Stop the sink, the worker and (unless ``keep_kafka``) Kafka. Idempotent."""
        for service in (Service.SINK, Service.WORKER):
            pid = self._pid(service)
            if pid is None:
                continue
            _terminate(pid, timeout_s=30)
            self.pid_path(service).unlink(missing_ok=True)
        if not keep_kafka:
            self.kafka.stop()

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kafka": self.kafka.status()}
        for service in Service:
            out[service.value] = {"running": self._alive(service), "pid": self._pid(service),
                                  "healthy": self.healthy(service), "log": str(self.log_path(service))}
        out["sink"]["stats"] = endpoint_healthy(self.settings)
        out["worker"]["stats"] = self.worker_stats()
        return out

    def worker_stats(self) -> dict[str, Any] | None:
        return _get_json(f"http://127.0.0.1:{self.settings.worker_web_port}/stats")

    def healthy(self, service: Service) -> bool:
        if service is Service.SINK:
            return endpoint_healthy(self.settings) is not None
        return _get_json(f"http://127.0.0.1:{self.settings.worker_web_port}/health") is not None

    def log_path(self, service: Service) -> Path:
        return self.run_dir / f"{service.value}.log"

    def pid_path(self, service: Service) -> Path:
        return self.run_dir / f"{service.value}.pid"

    def _pid(self, service: Service) -> int | None:
        try:
            pid = int(self.pid_path(service).read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if pid_alive(pid) else None

    def _alive(self, service: Service) -> bool:
        return self._pid(service) is not None

    def _spawn(self, service: Service) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.settings.to_env()}
        with open(self.log_path(service), "ab") as logf:
            proc = subprocess.Popen(
                [sys.executable, "-m", "argus.cli", service.value], stdin=subprocess.DEVNULL, stdout=logf,
                stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=os.getcwd(),
            )
        self.pid_path(service).write_text(str(proc.pid))
        log.info("started %s (pid %d)", service.value, proc.pid)


def _get_json(url: str) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as r:
            doc = json.loads(r.read())
            return doc if isinstance(doc, dict) else None
    except (OSError, ValueError):
        return None


def _terminate(pid: int, timeout_s: float) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if pid_alive(pid):
        log.warning("pid %d ignored SIGTERM for %.0f s; killing", pid, timeout_s)
        os.kill(pid, signal.SIGKILL)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
