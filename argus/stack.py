"""The local stack behind ``argus up``: Apache Kafka, the Faust worker and the ClickHouse sink, supervised.

``up`` starts the broker in the foreground (the first run fetches its jars and formats its storage, with
progress), creates the topics, then starts the stack's supervisor (:mod:`argus.supervisor`): a background
process, in a session of its own, that runs the worker, the sink and the query service as its children and
restarts any of them, and the broker, when they exit. ``up`` is idempotent (a running supervisor and healthy
services are reused; there is never a second supervisor per home) and waits until everything is healthy. ``down`` stops
the supervisor, which stops the sink and then the worker, then the broker. Logs and pid files are under
``<home>/run``; the sink owns the embedded chDB directory, and the query service answers SQL for other
processes over ClickHouse's HTTP interface (see :mod:`argus.sinks.query_service`).
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
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

from argus.core.errors import ArgusError
from argus.core.settings import Settings
from argus.local_kafka import LocalKafka, pid_alive
from argus.sinks.query_server import endpoint_healthy
from argus.supervisor import (
    SUPERVISOR_MODULE,
    Service,
    health_url_of_query_service,
    read_state,
    service_pid,
    supervisor_pid,
    terminate,
)
from argus.topics import ensure_topics

__all__ = ["Service", "Stack"]

log = logging.getLogger(__name__)

#: A service that exits this often while ``up`` waits for it is not going to come up: ``up`` gives up early.
_CRASHES_BEFORE_GIVING_UP = 3
_SUPERVISOR_STOP_TIMEOUT_S = 90.0


class Stack:
    """Start, stop and inspect the local services for ``settings``."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.run_dir = (settings.home / "run").resolve()
        self.kafka = LocalKafka(settings)

    def up(self, progress: Callable[[str], None] | None = None, timeout_s: float = 120.0) -> dict[str, Any]:
        """Start whatever is not running and wait until all of it is healthy.

        Raises:
            ArgusError: a service did not become healthy in ``timeout_s``, or kept exiting (its log path and
                the end of its log are in the message); a supervisor this call started is stopped again.
        """
        say = progress or (lambda _m: None)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # Two `argus up` at once must not both find no supervisor and both start one.
        with open(self.run_dir / "up.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            say("kafka: starting (first run downloads Apache Kafka from Maven Central)")
            self.kafka.start(timeout_s=timeout_s)
            created = ensure_topics(self.settings)
            say(f"kafka: healthy on {self.settings.bootstrap_servers}; topics created: {len(created)}")
            running = supervisor_pid(self.run_dir)
            spawned = running is None
            if running is None:
                pid = self._spawn_supervisor()
                say(f"supervisor: started (pid {pid}); it restarts the worker, the sink and kafka if they exit")
            else:
                pid = running
                say(f"supervisor: already running (pid {pid})")
            try:
                self._wait_healthy(pid, say, timeout_s)
            except ArgusError:
                if spawned:
                    self._stop_supervisor()
                raise
        return self.status()

    def _wait_healthy(self, sup_pid: int, say: Callable[[str], None], timeout_s: float) -> None:
        for service in Service:
            if self.healthy(service):
                say(f"{service.value}: already running")
            else:
                say(f"{service.value}: starting")
        deadline = time.monotonic() + timeout_s
        first = {s.value: self._supervised(s.value).get("restarts", 0) for s in Service}
        for service in Service:
            while not self.healthy(service):
                if not pid_alive(sup_pid):
                    raise ArgusError(f"the supervisor exited; see {self.supervisor_log}:\n{_tail(self.supervisor_log)}")
                restarts = self._supervised(service.value).get("restarts", 0) - first[service.value]
                if restarts >= _CRASHES_BEFORE_GIVING_UP:
                    raise ArgusError(f"{service.value} exited {restarts} times while starting; see "
                                     f"{self.log_path(service)}:\n{_tail(self.log_path(service))}")
                if time.monotonic() > deadline:
                    raise ArgusError(f"{service.value} not healthy after {timeout_s:.0f} s; "
                                     f"see {self.log_path(service)}:\n{_tail(self.log_path(service))}")
                time.sleep(0.2)
            say(f"{service.value}: healthy")

    def down(self, keep_kafka: bool = False) -> None:
        """Stop the supervisor (it stops the sink and the worker), any stray worker or sink, and (unless
        ``keep_kafka``) Kafka. Idempotent."""
        self._stop_supervisor()
        # Left by an argus up that had no supervisor.
        for service in (Service.QUERY_SERVICE, Service.SINK, Service.WORKER):
            pid = service_pid(self.run_dir, service)
            if pid is not None:
                terminate(pid, timeout_s=30)
            self.pid_path(service).unlink(missing_ok=True)
        if not keep_kafka:
            self.kafka.stop()

    def _stop_supervisor(self) -> None:
        pid = supervisor_pid(self.run_dir)
        if pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        # It stops its children first and waits for them, so give it their stop time and some.
        deadline = time.monotonic() + _SUPERVISOR_STOP_TIMEOUT_S
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if pid_alive(pid):
            log.warning("the supervisor (pid %d) ignored SIGTERM for %.0f s; killing it and its children",
                        pid, _SUPERVISOR_STOP_TIMEOUT_S)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                # Its process group holds it and its children (the broker has a session of its own).
                os.killpg(pid, signal.SIGKILL)

    def _spawn_supervisor(self) -> int:
        env = self.settings.child_env()
        with open(self.supervisor_log, "ab") as logf:
            proc = subprocess.Popen(
                [sys.executable, "-m", SUPERVISOR_MODULE], stdin=subprocess.DEVNULL, stdout=logf,
                stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=os.getcwd(),
            )
        # It writes its pid file once it holds its lock; until then this is its pid.
        deadline = time.monotonic() + 30
        while supervisor_pid(self.run_dir) != proc.pid:
            if proc.poll() is not None:
                raise ArgusError(f"the supervisor exited ({proc.returncode}); see {self.supervisor_log}:\n"
                                 f"{_tail(self.supervisor_log)}")
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        log.info("started the supervisor (pid %d)", proc.pid)
        return proc.pid

    def status(self) -> dict[str, Any]:
        """Every process of the stack: ``running``, ``pid``, ``healthy``, ``log``; and from the supervisor
        (``supervised``, ``state``, ``restarts``, ``last_exit``, ``up_since`` in ISO 8601, ``uptime_s``)."""
        sup = supervisor_pid(self.run_dir)
        state = read_state(self.run_dir) if sup is not None else None
        since = state.get("since") if state else None
        out: dict[str, Any] = {
            "supervisor": {"running": sup is not None, "pid": sup, "up_since": _iso(since),
                           "uptime_s": _uptime(since), "log": str(self.supervisor_log)},
            "kafka": self.kafka.status(),
        }
        # Ports are shared by every home on the host: what answers on one is this stack's only when this home
        # started it (its pid file), or, for a broker, when this home's supervisor adopted it as external.
        kafka = out["kafka"]
        adopted = ((state or {}).get("services", {}).get("kafka") or {}).get("state") == "external"
        kafka["foreign"] = bool(kafka["pid"] is None and kafka["healthy"] and not adopted)
        kafka["healthy"] = bool(kafka["healthy"] and not kafka["foreign"])
        for service in Service:
            pid = service_pid(self.run_dir, service)
            answers = self.healthy(service)
            out[service.value] = {"running": pid is not None, "pid": pid, "healthy": pid is not None and answers,
                                  "foreign": pid is None and answers, "log": str(self.log_path(service))}
        for name in ("kafka", *(s.value for s in Service)):
            s = (state or {}).get("services", {}).get(name)
            if s is None:
                out[name].update(supervised=False, state=None, restarts=0, last_exit=None, up_since=None,
                                 uptime_s=None)
                continue
            last = s.get("last_exit")
            out[name].update(supervised=bool(s.get("supervised")), state=s.get("state"),
                             restarts=int(s.get("restarts", 0)), up_since=_iso(s.get("up_since")),
                             uptime_s=_uptime(s.get("up_since")),
                             last_exit=None if last is None else {**last, "at": _iso(last.get("at"))})
        out["sink"]["stats"] = endpoint_healthy(self.settings) if out["sink"]["running"] else None
        out["worker"]["stats"] = self.worker_stats() if out["worker"]["running"] else None
        qs = Service.QUERY_SERVICE.value
        out[qs]["stats"] = _get_json(health_url_of_query_service(self.settings)) if out[qs]["running"] else None
        return out

    def _supervised(self, name: str) -> dict[str, Any]:
        services = (read_state(self.run_dir) or {}).get("services", {})
        s = services.get(name)
        return s if isinstance(s, dict) else {}

    def worker_stats(self) -> dict[str, Any] | None:
        return _get_json(f"http://127.0.0.1:{self.settings.worker_web_port}/stats")

    def healthy(self, service: Service) -> bool:
        if service is Service.SINK:
            return endpoint_healthy(self.settings) is not None
        if service is Service.QUERY_SERVICE:
            return _get_json(health_url_of_query_service(self.settings)) is not None
        return _get_json(f"http://127.0.0.1:{self.settings.worker_web_port}/health") is not None

    @property
    def supervisor_log(self) -> Path:
        return self.run_dir / "supervisor.log"

    def log_path(self, service: Service) -> Path:
        return self.run_dir / f"{service.value}.log"

    def pid_path(self, service: Service) -> Path:
        return self.run_dir / f"{service.value}.pid"


def _iso(ts: Any) -> str | None:
    if not isinstance(ts, int | float):
        return None
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).isoformat(timespec="seconds")


def _uptime(ts: Any) -> float | None:
    return round(time.time() - ts, 1) if isinstance(ts, int | float) else None


def _get_json(url: str) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as r:
            doc = json.loads(r.read())
            return doc if isinstance(doc, dict) else None
    except (OSError, ValueError):
        return None


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
