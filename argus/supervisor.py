"""The supervisor of the local stack: one background process per ``ARGUS_HOME`` that keeps the stream worker,
the ClickHouse sink and the local Kafka broker (or each node of the local cluster) running.

``argus up`` starts it (``python -m argus.supervisor``, log ``<home>/run/supervisor.log``). It restarts a child
that exits or stops answering ``/health`` after a backoff that doubles per crash in a row, writes what it did to
``<home>/run/supervisor.json`` (shown by ``argus status``) and leaves no orphans; ``argus down`` stops it.

Details and reasoning: docs/internals/application.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
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
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from argus.core.errors import ArgusError
from argus.core.settings import Settings
from argus.kafka_cluster import KafkaCluster
from argus.kafka_users import Role, role_env
from argus.local_kafka import LocalKafka, pid_alive

__all__ = [
    "ROLE_OF",
    "STATE_FILE",
    "SUPERVISOR_MODULE",
    "Service",
    "ServiceState",
    "Supervisor",
    "health_url_of_query_service",
    "is_service_process",
    "process_start",
    "read_state",
    "service_pid",
    "supervisor_pid",
]

log = logging.getLogger(__name__)

#: ``python -m`` name of the supervisor; also how its process is recognised in ``/proc/<pid>/cmdline``.
SUPERVISOR_MODULE = "argus.supervisor"
#: The supervisor's record of its processes, under ``<home>/run``.
STATE_FILE = "supervisor.json"
_LOCK_FILE = "supervisor.lock"
_PID_FILE = "supervisor.pid"
_POLL_S = 0.25
_STOP_TIMEOUT_S = 30.0
_PR_SET_PDEATHSIG = 1
#: Seconds between two health checks of a running worker or sink.
_PROBE_S = 5.0


def probe_health(url: str, timeout_s: float = 2.0) -> bool:
    """Whether ``url`` answers 200 within ``timeout_s``."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return bool(r.status == 200)
    except (OSError, ValueError):
        return False


class Service(enum.Enum):
    """The processes of the stack that run argus code (the broker is managed by :class:`LocalKafka`)."""

    WORKER = "worker"
    SINK = "sink"
    #: Serves SQL (ClickHouse's HTTP interface) apart from the sink, so no query slows ingestion.
    QUERY_SERVICE = "query-service"


#: The Kafka user each service runs as on a secure stack (``argus up --secure``); the query service touches no
#: topic and gets the reader's, the least there is.
ROLE_OF = {Service.WORKER: Role.WORKER, Service.SINK: Role.SINK, Service.QUERY_SERVICE: Role.READER}


@dataclass
class ServiceState:
    """What the supervisor knows of one process; times are Unix seconds."""

    supervised: bool = True
    state: str = "stopped"  # starting | running | backoff | stopped | external (a broker someone else runs)
    pid: int | None = None
    restarts: int = 0
    up_since: float | None = None
    last_exit: dict[str, Any] | None = None  # code (None: unknown), signal, at, ran_s
    next_start: float | None = None
    backoff_s: float = 0.0
    hang_kills: int = 0


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _cmdline(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None


def is_service_process(pid: int, service: Service) -> bool:
    """True if ``pid`` runs the argus ``service`` (checked on ``/proc``, so a reused pid is not taken for it;
    without ``/proc`` the pid file is trusted)."""
    args = _cmdline(pid)
    if args is None:
        return pid_alive(pid)
    return service.value in args and any("argus" in a for a in args)


def supervisor_pid(run_dir: Path) -> int | None:
    """The pid of the running supervisor of the stack whose run directory is ``run_dir``, if any."""
    pid = _read_pid(run_dir / _PID_FILE)
    if pid is None or not pid_alive(pid):
        return None
    args = _cmdline(pid)
    return pid if args is None or SUPERVISOR_MODULE in args else None


def service_pid(run_dir: Path, service: Service) -> int | None:
    """The pid in ``<run_dir>/<service>.pid`` if that process is alive and runs ``service``."""
    pid = _read_pid(run_dir / f"{service.value}.pid")
    return pid if pid is not None and pid_alive(pid) and is_service_process(pid, service) else None


def read_state(run_dir: Path) -> dict[str, Any] | None:
    """The supervisor's last written state (``None`` if it never wrote one or it cannot be read)."""
    try:
        doc = json.loads((run_dir / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def process_start(pid: int) -> float | None:
    """When process ``pid`` started, in Unix seconds (from ``/proc``; ``None`` where it cannot be read)."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        btime = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                     if line.startswith("btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return btime + ticks / os.sysconf("SC_CLK_TCK")


def _describe_exit(code: int | None, ran_s: float | None) -> dict[str, Any]:
    out: dict[str, Any] = {"code": code, "signal": None, "at": time.time(),
                           "ran_s": None if ran_s is None else round(ran_s, 1)}
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            out["signal"] = signal.Signals(-code).name
    return out


class Supervisor:
    """The supervisor's loop (runs inside ``python -m argus.supervisor``)."""

    def __init__(self, settings: Settings, probe: Callable[[str], bool] = probe_health) -> None:
        self.settings = settings
        self.probe = probe
        # Per service: when its health check last passed (None: not since its start), when it was last probed.
        self._healthy_at: dict[Service, float | None] = {}
        self._probed_at: dict[Service, float] = {}
        self.run_dir = (settings.home / "run").resolve()
        self.kafka = KafkaCluster(settings)
        self.procs: dict[Service, subprocess.Popen[bytes]] = {}
        self.states: dict[str, ServiceState] = {s.value: ServiceState() for s in Service}
        for node in self.kafka.nodes:  # "kafka", or "kafka-1" .. "kafka-N" for the nodes of a cluster
            self.states[node.name] = ServiceState()
        self.since = time.time()
        self._stopping = False

    # -- the process ---------------------------------------------------------------------------------
    def run(self) -> int:
        """Supervise until SIGTERM/SIGINT; returns the exit status (0, also when another supervisor runs)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.run_dir / _LOCK_FILE, "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.info("another supervisor holds %s; exiting", self.run_dir / _LOCK_FILE)
                return 0
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, self._on_signal)
            (self.run_dir / _PID_FILE).write_text(f"{os.getpid()}\n")
            log.info("supervisor %d for %s", os.getpid(), self.run_dir)
            try:
                self._stop_strays()
                self._adopt_kafka()
                while not self._stopping:
                    self.tick()
                    time.sleep(_POLL_S)
            finally:
                self._stop_children()
                (self.run_dir / _PID_FILE).unlink(missing_ok=True)
                log.info("supervisor %d stopped", os.getpid())
        return 0

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        log.info("supervisor: %s, stopping", signal.Signals(signum).name)
        self._stopping = True

    def _stop_strays(self) -> None:
        """Stop a worker or sink that no supervisor owns (one started by an older ``argus up``, or one still
        shutting down after its supervisor was killed), so there is one of each and it is our child."""
        for service in Service:
            pid = service_pid(self.run_dir, service)
            if pid is not None:
                log.warning("stopping the %s (pid %d) that this supervisor did not start", service.value, pid)
                terminate(pid, _STOP_TIMEOUT_S)

    def _adopt_kafka(self) -> None:
        for node in self.kafka.nodes:
            state = self.states[node.name]
            pid = node.pid()
            if pid is None and node.is_healthy():
                # Someone else's broker answers on the port: not ours to restart.
                state.supervised, state.state = False, "external"
            elif pid is not None:
                state.pid, state.state, state.up_since = pid, "running", process_start(pid) or time.time()
        self._write_state()

    # -- one round -----------------------------------------------------------------------------------
    def tick(self) -> None:
        """Check every process once: note exits, (re)start what is due."""
        changed = self._tick_kafka()
        for service in Service:
            changed |= self._tick_service(service)
        if changed:
            self._write_state()

    def _tick_service(self, service: Service) -> bool:
        state = self.states[service.value]
        proc = self.procs.get(service)
        if proc is not None:
            code = proc.poll()
            if code is None:
                self._check_hung(service, proc)
                return False
            del self.procs[service]
            self._exited(service.value, code)
            (self.run_dir / f"{service.value}.pid").unlink(missing_ok=True)
            return True
        if state.next_start is not None and time.time() < state.next_start:
            return False
        self.procs[service] = self._spawn(service)
        self._healthy_at[service] = None
        self._started(service.value, self.procs[service].pid)
        return True

    def health_url(self, service: Service) -> str:
        if service is Service.QUERY_SERVICE:
            return health_url_of_query_service(self.settings)
        port = self.settings.worker_web_port if service is Service.WORKER else self.settings.query_port
        return f"http://127.0.0.1:{port}/health"

    def _check_hung(self, service: Service, proc: subprocess.Popen[bytes], now: float | None = None) -> None:
        """Probe a running process now and then; kill it once it failed for ``supervisor_hang_s`` after having
        passed (the next tick sees the exit and restarts it)."""
        now = time.monotonic() if now is None else now
        if now - self._probed_at.get(service, -_PROBE_S) < _PROBE_S:
            return
        self._probed_at[service] = now
        if self.probe(self.health_url(service)):
            self._healthy_at[service] = now
            return
        last = self._healthy_at.get(service)
        if last is None or now - last < self.settings.supervisor_hang_s:
            return  # still starting, or not failing for long
        log.error("%s (pid %d): no answer on its health check for %.0f s; killing it as hung", service.value,
                  proc.pid, now - last)
        self.states[service.value].hang_kills += 1
        self._healthy_at[service] = None
        proc.kill()

    def _tick_kafka(self) -> bool:
        changed = False
        for node in self.kafka.nodes:
            changed |= self._tick_broker(node)
        return changed

    def _tick_broker(self, node: LocalKafka) -> bool:
        """One broker (the single one or a node of the cluster), kept running as a worker or sink is."""
        state = self.states[node.name]
        if not state.supervised:
            return False
        if state.pid is not None:
            if node.pid() == state.pid:
                return False
            self._exited(node.name, self._kafka_exit_code(node, state.pid))
            return True
        if state.next_start is not None and time.time() < state.next_start:
            return False
        try:
            pid = node.launch()
        except ArgusError as exc:
            log.error("%s: launch failed: %s", node.name, exc)
            self._exited(node.name, None)
            return True
        self._started(node.name, pid)
        return True

    def _kafka_exit_code(self, node: LocalKafka, pid: int, wait_s: float = 5.0) -> int | None:
        """The exit status of the broker ``pid`` if it was our child (``None`` if not, or not known in time).

        A process that is being killed stops looking like a broker (its ``/proc`` command line empties) before
        it can be reaped, so wait for it to finish exiting rather than record an unknown status."""
        deadline = time.monotonic() + wait_s
        code = node.exit_code()
        while code is None and time.monotonic() < deadline and _exists(pid):
            time.sleep(0.05)
            code = node.exit_code()
        return code

    def _started(self, name: str, pid: int) -> None:
        state = self.states[name]
        if state.last_exit is not None:
            state.restarts += 1
        state.pid, state.state, state.up_since, state.next_start = pid, "running", time.time(), None
        log.info("%s: started (pid %d, restart %d)", name, pid, state.restarts)

    def _exited(self, name: str, code: int | None) -> None:
        state = self.states[name]
        ran_s = None if state.up_since is None else time.time() - state.up_since
        state.last_exit = _describe_exit(code, ran_s)
        # A process that ran for a good while crashed once; one that keeps dying right after its start
        # backs off further each time, so a broken configuration does not spin.
        stable = ran_s is not None and ran_s >= 4 * self.settings.supervisor_backoff_max_s
        state.backoff_s = (self.settings.supervisor_backoff_s if stable or state.backoff_s == 0
                           else min(2 * state.backoff_s, self.settings.supervisor_backoff_max_s))
        state.pid, state.state, state.up_since = None, "backoff", None
        state.next_start = time.time() + state.backoff_s
        log.warning("%s: exited (%s); restarting in %.1f s", name, state.last_exit, state.backoff_s)

    def child_env(self, service: Service) -> dict[str, str]:
        """The environment of ``service``: the settings (credentials as files), and on a secure stack its role's
        Kafka user and password file (:data:`ROLE_OF`)."""
        return {**self.settings.child_env(), **role_env(self.settings, ROLE_OF[service])}

    def _spawn(self, service: Service) -> subprocess.Popen[bytes]:
        env = self.child_env(service)
        with open(self.run_dir / f"{service.value}.log", "ab") as logf:
            cmd = [sys.executable, "-m", SUPERVISOR_MODULE, "--child", service.value, "--parent", str(os.getpid())]
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                    cwd=os.getcwd())
        (self.run_dir / f"{service.value}.pid").write_text(f"{proc.pid}\n")
        return proc

    def _stop_children(self) -> None:
        # The query service first (it only forwards to the sink), then the sink: it commits what the worker produced.
        for service in (Service.QUERY_SERVICE, Service.SINK, Service.WORKER):
            proc = self.procs.pop(service, None)
            if proc is None:
                continue
            log.info("stopping %s (pid %d)", service.value, proc.pid)
            proc.terminate()
            try:
                proc.wait(_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                log.warning("%s (pid %d) ignored SIGTERM for %.0f s; killing", service.value, proc.pid,
                            _STOP_TIMEOUT_S)
                proc.kill()
                proc.wait()
            (self.run_dir / f"{service.value}.pid").unlink(missing_ok=True)
            state = self.states[service.value]
            state.pid, state.state, state.up_since, state.next_start = None, "stopped", None, None
        self._write_state()

    def _write_state(self) -> None:
        doc = {"pid": os.getpid(), "since": self.since, "stopping": self._stopping,
               "services": {name: asdict(s) for name, s in self.states.items()}}
        tmp = self.run_dir / f".{STATE_FILE}.{os.getpid()}"
        tmp.write_text(json.dumps(doc, indent=1))
        os.replace(tmp, self.run_dir / STATE_FILE)  # readers never see half a file


def health_url_of_query_service(settings: Settings) -> str:
    """The query service's ``/health`` as this host reaches it (a wildcard bind address on loopback)."""
    host = settings.query_service_host
    host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    return f"http://{f'[{host}]' if ':' in host else host}:{settings.query_service_port}/health"


def terminate(pid: int, timeout_s: float) -> None:
    """SIGTERM ``pid``, wait up to ``timeout_s`` for it to exit, then SIGKILL it."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if pid_alive(pid):
        log.warning("pid %d ignored SIGTERM for %.0f s; killing", pid, timeout_s)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _exists(pid: int) -> bool:
    """Whether ``pid`` exists at all, zombies included (unlike :func:`pid_alive`, this never reaps a child, so
    its exit status stays readable). Without ``/proc`` it says no: the caller then stops waiting."""
    return Path(f"/proc/{pid}").exists()


def _die_with_parent(parent: int) -> None:
    """Ask the kernel to SIGTERM this process when the supervisor ``parent`` dies (Linux); exit if it already
    has (it may have died before the request, and then nobody would stop this process)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:
        raise SystemExit(0)


def main(argv: list[str] | None = None) -> int:
    """``python -m argus.supervisor``: supervise the stack of the ``ARGUS_*`` settings; ``--child worker|sink``
    runs one service under the running supervisor (what the supervisor itself spawns)."""
    import argparse

    parser = argparse.ArgumentParser(prog=f"python -m {SUPERVISOR_MODULE}", description=__doc__)
    parser.add_argument("--child", choices=[s.value for s in Service], default=None)
    parser.add_argument("--parent", type=int, default=None, help="with --child: the supervisor's pid")
    args = parser.parse_args(argv)
    if args.child is not None:
        _die_with_parent(args.parent if args.parent is not None else os.getppid())
        from argus.cli import main as cli_main

        return cli_main([args.child])
    settings = Settings.load()
    logging.basicConfig(level=settings.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return Supervisor(settings).run()


if __name__ == "__main__":
    raise SystemExit(main())
