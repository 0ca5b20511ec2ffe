"""The local stack behind ``argus up``: Apache Kafka, the Faust worker and the ClickHouse sink, supervised.

``up`` starts the broker (or the ``brokers`` nodes of a local cluster, :mod:`argus.kafka_cluster`) in the
foreground (the first run fetches its jars and formats its storage, with progress), creates the topics, then
starts the stack's supervisor (:mod:`argus.supervisor`): a background process, in a session of its own, that
runs the worker, the sink and the query service as its children and restarts any of them, and each broker, when
they exit. ``up`` is idempotent (a running supervisor and healthy services are reused; there is never a second
supervisor per home) and waits until everything is healthy. With ``kafka_secure`` (``argus up --secure``) the
broker takes SASL/SCRAM users per role and ACLs (:mod:`argus.kafka_users`, :mod:`argus.kafka_acls`): ``up``
creates the users and applies the ACLs as the admin, and the supervisor starts each service as its role's user.
``down`` stops the supervisor, which stops the sink and then the worker, then the brokers. Logs and pid files
are under ``<home>/run``; the sink owns the embedded chDB directory, and the query service answers SQL for other
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
from argus.kafka_acls import secure_local_kafka
from argus.kafka_cluster import KafkaCluster, stop_local_brokers
from argus.kafka_users import ensure_passwords, secrets_dir
from argus.local_kafka import pid_alive
from argus.sinks.query_server import endpoint_healthy, rotate_token
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
        self.kafka = KafkaCluster(settings)

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
            nodes = len(self.kafka.nodes)
            say(f"kafka: starting {'a cluster of ' + str(nodes) + ' brokers' if nodes > 1 else 'one broker'} "
                "(first run downloads Apache Kafka from Maven Central)")
            self._check_same_security()
            if self.settings.kafka_secure:
                self._check_secure()
                ensure_passwords(self.settings)
            self.kafka.start(timeout_s=timeout_s)
            self._record_kafka()
            admin = self.kafka.nodes[0].settings  # the settings' own credentials, or the secure home's admin
            created = ensure_topics(admin)
            say(f"kafka: healthy on {self.settings.bootstrap_servers}; topics created: {len(created)} "
                f"(replication factor {self.settings.replication_factor}, "
                f"min.insync.replicas {self.settings.min_insync_replicas})")
            if self.settings.kafka_secure:
                say(self._secure_kafka(admin))
            running = supervisor_pid(self.run_dir)
            spawned = running is None
            if running is None:
                rotate_token(self.settings)  # a new run, a new token: its services make it as they start
                pid = self._spawn_supervisor()
                say(f"supervisor: started (pid {pid}); it restarts the worker, the sink, the query service and "
                    "kafka if they exit")
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

    def _check_same_security(self) -> None:
        """A broker of this home that runs secure (or plain) is not reused by an ``up`` of the other kind: its
        clients could not talk to it, and ``up`` would wait for a health check that never passes."""
        running = self.running_kafka()
        if running is self.kafka or not any(n.pid() is not None for n in running.nodes):
            return
        was, now = running.settings.kafka_secure, self.settings.kafka_secure
        if was != now:
            how = "argus up --secure" if was else "argus up (without --secure and ARGUS_KAFKA_SECURE)"
            raise ArgusError(f"this home's Kafka runs {'with' if was else 'without'} --secure: use {how}, or stop it "
                             "first (argus down)")

    def _check_secure(self) -> None:
        """``--secure`` makes its own users: credentials given in the settings would be ignored, so refuse them."""
        if self.settings.kafka_security_protocol != "PLAINTEXT":
            raise ArgusError("argus up --secure (ARGUS_KAFKA_SECURE=1) runs the local broker with its own users "
                             f"(passwords in {secrets_dir(self.settings)}); unset ARGUS_KAFKA_SECURITY_PROTOCOL and "
                             "the ARGUS_KAFKA_SASL_* settings")

    def _secure_kafka(self, admin: Settings) -> str:
        """Give every role its SCRAM user (the password of its file) and make the broker's ACLs the table's."""
        users, created, extra = secure_local_kafka(admin, self.settings)
        return (f"kafka: SASL/SCRAM users {', '.join(users)} (passwords in {secrets_dir(self.settings)}); ACL "
                f"bindings created: {len(created)}, removed: {len(extra)}")

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
            self.running_kafka().stop()
            stop_local_brokers(self.settings.home)  # a broker of another count started from this home too
            self.kafka_record.unlink(missing_ok=True)

    @property
    def kafka_record(self) -> Path:
        """What ``up`` started (brokers, bootstrap servers), for ``status`` and ``down`` run with other settings."""
        return self.run_dir / "kafka.json"

    def _record_kafka(self) -> None:
        s = self.settings
        doc = {"brokers": s.brokers, "bootstrap_servers": s.bootstrap_servers,
               "replication_factor": s.replication_factor, "secure": s.kafka_secure}
        tmp = self.kafka_record.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc) + "\n")
        os.replace(tmp, self.kafka_record)

    def running_kafka(self) -> KafkaCluster:
        """The local Kafka ``up`` last started from this home (as recorded), else the one of the settings: after
        ``argus up --brokers 3``, a plain ``argus status`` shows the three brokers."""
        try:
            doc = json.loads(self.kafka_record.read_text())
            secure = bool(doc.get("secure", False))
            if doc["brokers"] == self.settings.brokers and secure == self.settings.kafka_secure:
                return self.kafka
            return KafkaCluster(self.settings.replace(brokers=int(doc["brokers"]),
                                                      bootstrap_servers=str(doc["bootstrap_servers"]),
                                                      replication_factor=int(doc["replication_factor"]),
                                                      kafka_secure=secure))
        except (OSError, ValueError, KeyError, TypeError, ArgusError):
            return self.kafka

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
        kafka = self.running_kafka()
        out: dict[str, Any] = {
            "supervisor": {"running": sup is not None, "pid": sup, "up_since": _iso(since),
                           "uptime_s": _uptime(since), "log": str(self.supervisor_log)},
            "kafka": kafka.status(),
        }
        # Ports are shared by every home on the host: what answers on one is this stack's only when this home
        # started it (its pid file), or, for a broker, when this home's supervisor adopted it as external.
        services = (state or {}).get("services", {})
        for service in Service:
            pid = service_pid(self.run_dir, service)
            answers = self.healthy(service)
            out[service.value] = {"running": pid is not None, "pid": pid, "healthy": pid is not None and answers,
                                  "foreign": pid is None and answers, "log": str(self.log_path(service))}
            out[service.value].update(_supervised_view(services.get(service.value)))
        brokers = out["kafka"]["brokers"]
        for node, broker in zip(kafka.nodes, brokers, strict=True):
            broker.update(name=node.name, **_supervised_view(services.get(node.name)))
            adopted = broker["state"] == "external"
            broker["foreign"] = bool(broker["pid"] is None and broker["healthy"] and not adopted)
            broker["healthy"] = bool(broker["healthy"] and not broker["foreign"])
        out["kafka"].update(_brokers_view(brokers))
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


def _supervised_view(s: Any) -> dict[str, Any]:
    """A process's entry of the supervisor's state as ``status`` shows it."""
    if not isinstance(s, dict):
        return {"supervised": False, "state": None, "restarts": 0, "last_exit": None, "up_since": None,
                "uptime_s": None}
    last = s.get("last_exit")
    return {"supervised": bool(s.get("supervised")), "state": s.get("state"), "restarts": int(s.get("restarts", 0)),
            "up_since": _iso(s.get("up_since")), "uptime_s": _uptime(s.get("up_since")),
            "last_exit": None if last is None else {**last, "at": _iso(last.get("at"))}}


def _brokers_view(brokers: list[dict[str, Any]]) -> dict[str, Any]:
    """The brokers as one process: supervised and healthy if all are, foreign if one is (another home's broker
    answers on its port), the first state other than running, restarts added up, the latest exit, the earliest
    start."""
    states = [b["state"] for b in brokers]
    exits = [b["last_exit"] for b in brokers if b["last_exit"] is not None]
    starts = [b for b in brokers if b["up_since"] is not None]
    first = min(starts, key=lambda b: b["up_since"]) if starts else None
    return {"supervised": all(b["supervised"] for b in brokers),
            "healthy": all(b["healthy"] for b in brokers), "foreign": any(b["foreign"] for b in brokers),
            "state": next((st for st in states if st != "running"), states[0]),
            "restarts": sum(b["restarts"] for b in brokers),
            "last_exit": max(exits, key=lambda e: str(e.get("at"))) if exits else None,
            "up_since": first["up_since"] if first else None, "uptime_s": first["uptime_s"] if first else None}


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
