"""The local broker: a project-managed, single-node Apache Kafka (KRaft) without Docker.

The jars come from Maven Central through the ``kafka/pom.xml`` shipped in this package and are cached
under ``Settings.kafka_cache/<version>/libs``. The broker's state lives under ``Settings.home/"kafka"``:
``data/`` (log dirs, formatted once with a stable cluster id kept in ``cluster.id``), ``server.properties``,
``log4j2.properties``, ``kafka.pid``, ``logs/server.log`` (broker log) and ``kafka.out`` (JVM console).
The broker listens on the host and port of the first ``Settings.bootstrap_servers`` entry; its KRaft
controller listens on the next port.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from argus.errors import KafkaLocalError
from argus.settings import Settings

__all__ = ["LocalKafka", "fetch_jars", "pid_alive", "pom_path"]

logger = logging.getLogger(__name__)

_COMPLETE_MARKER = ".complete"
_TAIL_CHARS = 4000


def pom_path() -> Path:
    """The pom that lists the broker's jars (shipped inside the package)."""
    return Path(__file__).parent / "kafka" / "pom.xml"


def _tail(text: str, limit: int = _TAIL_CHARS) -> str:
    text = text.strip()
    return text if len(text) <= limit else "..." + text[-limit:]


def fetch_jars(settings: Settings, progress: Callable[[str], None] | None = None) -> Path:
    """Download Apache Kafka ``settings.kafka_version`` and its runtime dependencies with Maven.

    Idempotent: a completed download (marker file present) is reused. Concurrent callers are
    serialised with a lock file. Returns the ``libs`` directory holding the jars.

    Raises:
        KafkaLocalError: ``mvn`` is missing or failed (the message carries the tail of its output).
    """
    version_dir = (settings.kafka_cache / settings.kafka_version).resolve()
    libs = version_dir / "libs"
    marker = version_dir / _COMPLETE_MARKER
    if marker.exists() and any(libs.glob("kafka_*.jar")):
        return libs
    mvn = shutil.which("mvn")
    if mvn is None:
        raise KafkaLocalError("Maven (mvn) is not on PATH; it is needed to fetch the Kafka jars")
    version_dir.mkdir(parents=True, exist_ok=True)
    with open(version_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.exists() and any(libs.glob("kafka_*.jar")):  # another process finished meanwhile
            return libs
        staging = version_dir / f"libs.partial-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        cmd = [
            mvn, "-q", "-B", "-f", str(pom_path()), f"-Dkafka.version={settings.kafka_version}",
            "dependency:copy-dependencies", "-DincludeScope=runtime", f"-DoutputDirectory={staging}",
        ]
        msg = f"fetching Apache Kafka {settings.kafka_version} jars from Maven Central into {libs}"
        logger.info(msg)
        if progress is not None:
            progress(msg)
        started = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0 or not any(staging.glob("kafka_*.jar")):
            shutil.rmtree(staging, ignore_errors=True)
            raise KafkaLocalError(
                f"mvn failed (exit {proc.returncode}) fetching Kafka {settings.kafka_version}:\n"
                + _tail(proc.stderr + "\n" + proc.stdout)
            )
        shutil.rmtree(libs, ignore_errors=True)
        staging.rename(libs)
        count = sum(1 for _ in libs.glob("*.jar"))
        marker.write_text(f"{settings.kafka_version} {count} jars\n")
        msg = f"fetched {count} jars in {time.monotonic() - started:.1f}s"
        logger.info(msg)
        if progress is not None:
            progress(msg)
    return libs


def _random_cluster_id() -> str:
    """A Kafka cluster id: a random UUID in URL-safe base64 without padding (as ``random-uuid``)."""
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not cid.startswith("-"):  # Kafka avoids ids that look like command-line options
            return cid


def pid_alive(pid: int) -> bool:
    """True while process ``pid`` runs (an exited child of ours is reaped, a zombie counts as gone)."""
    try:  # reap it if it is our own exited child, so it does not linger as a zombie
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _is_kafka_process(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True  # no /proc (not Linux): trust the pid file
    return b"kafka.Kafka" in cmdline


class LocalKafka:
    """A single combined broker+controller Kafka node managed by argus."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        first = settings.bootstrap_servers.split(",")[0].strip()
        host, _, port = first.rpartition(":")
        self.host = host.strip("[]") or "127.0.0.1"
        self.port = int(port)
        self.controller_port = self.port + 1
        self.dir = (settings.home / "kafka").resolve()
        self.data_dir = self.dir / "data"
        self.properties_path = self.dir / "server.properties"
        self.log4j_path = self.dir / "log4j2.properties"
        self.cluster_id_path = self.dir / "cluster.id"
        self.pid_path = self.dir / "kafka.pid"
        self.console_path = self.dir / "kafka.out"
        self.log_path = self.dir / "logs" / "server.log"
        self._proc: subprocess.Popen[bytes] | None = None  # the broker, when this object launched it
        self._log_offset = 0  # size of the broker log when this object launched the broker

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    # -- state ------------------------------------------------------------------------------------
    def pid(self) -> int | None:
        """The pid of the broker this home started, if it is still running."""
        try:
            pid = int(self.pid_path.read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if self._alive(pid) and _is_kafka_process(pid) else None

    def _alive(self, pid: int) -> bool:
        if self._proc is not None and self._proc.pid == pid:
            return self._proc.poll() is None  # our child: poll() reaps it once it has exited
        return pid_alive(pid)

    def _port_open(self, port: int, timeout_s: float = 0.5) -> bool:
        try:
            with socket.create_connection((self.host, port), timeout=timeout_s):
                return True
        except OSError:
            return False

    def _admin(self) -> Any:
        from confluent_kafka.admin import AdminClient

        conf: dict[str, Any] = {
            "bootstrap.servers": self.bootstrap,
            "log_level": 0,  # connection-refused noise while the broker boots
            "error_cb": lambda _err: None,
        }
        return AdminClient(conf)

    def is_healthy(self, timeout_s: float = 3.0) -> bool:
        """True if a broker answers metadata on the configured port and knows its controller."""
        if not self._port_open(self.port):
            return False
        try:
            md = self._admin().list_topics(timeout=timeout_s)
        except Exception as exc:  # KafkaException or a timeout: not healthy (yet)
            logger.debug("metadata probe failed: %s", exc)
            return False
        return bool(md.brokers) and md.controller_id >= 0

    def _probe_topic(self, timeout_s: float = 10.0) -> bool:
        """Create and delete a throw-away topic: proves the controller accepts metadata changes."""
        from confluent_kafka.admin import NewTopic

        admin = self._admin()
        name = f"_argus_probe_{uuid.uuid4().hex[:12]}"
        try:
            admin.create_topics([NewTopic(name, 1, 1)], operation_timeout=timeout_s)[name].result(timeout_s)
            admin.delete_topics([name], operation_timeout=timeout_s)[name].result(timeout_s)
        except Exception as exc:
            logger.debug("probe topic failed: %s", exc)
            return False
        return True

    def status(self) -> dict[str, Any]:
        """``running`` (a broker of this home), ``pid``, ``healthy`` (a broker answers on the configured port,
        whoever started it), ``bootstrap``, ``log`` (broker log) and ``home``."""
        pid = self.pid()
        return {
            "running": pid is not None,
            "pid": pid,
            "healthy": self.is_healthy(),
            "bootstrap": self.bootstrap,
            "log": str(self.log_path),
            "home": str(self.dir),
        }

    # -- files ------------------------------------------------------------------------------------
    def _write_configs(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        props = {
            "process.roles": "broker,controller",
            "node.id": "1",
            "controller.quorum.voters": f"1@{self.host}:{self.controller_port}",
            "listeners": f"PLAINTEXT://{self.host}:{self.port},CONTROLLER://{self.host}:{self.controller_port}",
            "advertised.listeners": f"PLAINTEXT://{self.host}:{self.port}",
            "inter.broker.listener.name": "PLAINTEXT",
            "controller.listener.names": "CONTROLLER",
            "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
            "log.dirs": str(self.data_dir),
            "num.partitions": str(self.settings.partitions),
            "default.replication.factor": "1",
            "min.insync.replicas": "1",
            "offsets.topic.replication.factor": "1",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            "group.initial.rebalance.delay.ms": "0",
            # After a kill -9 the new incarnation waits for the old registration to expire: keep it short.
            "broker.session.timeout.ms": "4000",
            "broker.heartbeat.interval.ms": "1000",
            "auto.create.topics.enable": "false",
            "delete.topic.enable": "true",
            "log.retention.hours": "168",
            "message.max.bytes": str(16 * 1024 * 1024),
        }
        text = "# Written by argus.local_kafka on every start; edits are overwritten.\n"
        self.properties_path.write_text(text + "".join(f"{k}={v}\n" for k, v in props.items()))
        self.log4j_path.write_text(
            "status = warn\n"
            "shutdownHook = disable\n"  # let the broker log its own shutdown to the end
            "appender.file.type = RollingFile\n"
            "appender.file.name = FILE\n"
            f"appender.file.fileName = {self.log_path}\n"
            f"appender.file.filePattern = {self.log_path}.%i\n"
            "appender.file.layout.type = PatternLayout\n"
            "appender.file.layout.pattern = [%d] %p %m (%c)%n\n"
            "appender.file.policies.type = Policies\n"
            "appender.file.policies.size.type = SizeBasedTriggeringPolicy\n"
            "appender.file.policies.size.size = 20MB\n"
            "appender.file.strategy.type = DefaultRolloverStrategy\n"
            "appender.file.strategy.max = 3\n"
            "rootLogger.level = INFO\n"
            "rootLogger.appenderRef.file.ref = FILE\n"
            "logger.statechange.name = state.change.logger\n"
            "logger.statechange.level = WARN\n"
            "logger.request.name = kafka.request.logger\n"
            "logger.request.level = WARN\n"
        )

    def _java(self, libs: Path, main: str, *args: str) -> list[str]:
        java_home = os.environ.get("JAVA_HOME")
        java = str(Path(java_home) / "bin" / "java") if java_home else shutil.which("java")
        if not java:
            raise KafkaLocalError("java is not on PATH (Java 17+ is needed for the local Kafka broker)")
        return [
            java, "-Xmx512m", "-Xms256m", "-XX:+UseG1GC", "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={self.log4j_path}", f"-Dkafka.logs.dir={self.log_path.parent}",
            "-cp", f"{libs}/*", main, *args,
        ]

    def _format(self, libs: Path) -> None:
        if (self.data_dir / "meta.properties").exists():
            return
        if self.cluster_id_path.exists():
            cluster_id = self.cluster_id_path.read_text().strip()
        else:
            cluster_id = _random_cluster_id()
            self.cluster_id_path.write_text(cluster_id + "\n")
        cmd = self._java(libs, "kafka.tools.StorageTool", "format", "--ignore-formatted",
                         "-t", cluster_id, "-c", str(self.properties_path))
        logger.info("formatting KRaft storage in %s (cluster id %s)", self.data_dir, cluster_id)
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=120)
        if proc.returncode != 0:
            raise KafkaLocalError(f"kafka-storage format failed (exit {proc.returncode}):\n"
                                  + _tail(proc.stdout + "\n" + proc.stderr))

    def _console_tail(self) -> str:
        """The JVM console, the broker's ERROR lines of this launch and the end of its log."""
        parts = []
        with contextlib.suppress(OSError):
            console = self.console_path.read_text(errors="replace")
            if console.strip():
                parts.append(f"--- {self.console_path} ---\n" + _tail(console, 1500))
        with contextlib.suppress(OSError):
            with open(self.log_path, errors="replace") as fh:
                fh.seek(self._log_offset if self._log_offset <= self.log_path.stat().st_size else 0)
                lines = fh.read().splitlines()
            errors = [
                "\n".join(x[:500] for x in lines[i:i + 2])  # the ERROR line and the exception below it
                for i, line in enumerate(lines) if "] ERROR " in line or "] FATAL " in line
            ]
            if errors:
                parts.append("--- errors ---\n" + "\n".join(errors[-3:]))
            parts.append(f"--- {self.log_path} ---\n" + _tail("\n".join(lines), 1500))
        return "\n".join(parts)

    def _launch(self) -> int:
        """Launch the broker unless this home's broker is already running; returns its pid.

        Serialised with a lock file so two concurrent ``start`` calls cannot launch two brokers.
        """
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / ".start.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            pid = self.pid()
            if pid is not None:
                logger.info("Kafka pid %d from %s is already running; waiting for it", pid, self.pid_path)
                return pid
            for port in (self.port, self.controller_port):
                if self._port_open(port):
                    raise KafkaLocalError(f"port {self.host}:{port} is in use by something that is not "
                                          "a healthy Kafka broker started from this home")
            libs = fetch_jars(self.settings)
            self._write_configs()
            self._format(libs)
            cmd = self._java(libs, "kafka.Kafka", str(self.properties_path))
            self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
            with open(self.console_path, "ab") as out:
                proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                        start_new_session=True, cwd=self.dir)
            self._proc = proc
            self.pid_path.write_text(f"{proc.pid}\n")
            logger.info("started Kafka %s (pid %d) on %s; log %s",
                        self.settings.kafka_version, proc.pid, self.bootstrap, self.log_path)
            return proc.pid

    def start(self, timeout_s: float = 90) -> str:
        """Start the broker (or reuse a healthy one on the port) and return the bootstrap servers.

        Raises:
            KafkaLocalError: jars could not be fetched, storage not formatted, the port is taken by
                something that is not a healthy broker, or the broker did not become healthy in time.
        """
        if self.is_healthy():
            logger.info("reusing the Kafka broker already healthy on %s", self.bootstrap)
            return self.bootstrap
        deadline = time.monotonic() + timeout_s
        pid = self._launch()
        while time.monotonic() < deadline:
            if not self._alive(pid):
                self.pid_path.unlink(missing_ok=True)
                raise KafkaLocalError(f"Kafka broker (pid {pid}) exited during start-up:\n"
                                      + self._console_tail())
            if self.is_healthy() and self._probe_topic():
                logger.info("Kafka broker healthy on %s", self.bootstrap)
                return self.bootstrap
            time.sleep(0.5)
        self.stop()
        raise KafkaLocalError(f"Kafka broker did not become healthy within {timeout_s:.0f}s:\n"
                              + self._console_tail())

    def stop(self, timeout_s: float = 30) -> None:
        """Stop the broker started from this home: SIGTERM, then SIGKILL after ``timeout_s``."""
        pid = self.pid()
        if pid is None:
            self.pid_path.unlink(missing_ok=True)
            return
        logger.info("stopping Kafka broker (pid %d)", pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self._alive(pid):
            time.sleep(0.2)
        if self._alive(pid):
            logger.warning("Kafka broker (pid %d) ignored SIGTERM for %.0fs; killing it", pid, timeout_s)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            kill_deadline = time.monotonic() + 10
            while time.monotonic() < kill_deadline and self._alive(pid):
                time.sleep(0.1)
        self.pid_path.unlink(missing_ok=True)


def _main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    import sys

    parser = argparse.ArgumentParser(prog="python -m argus.local_kafka", description="The local broker.")
    parser.add_argument("command", choices=("start", "stop", "status", "fetch"))
    parser.add_argument("--timeout", type=float, default=None, help="seconds (start: 90, stop: 30)")
    args = parser.parse_args(argv)
    settings = Settings.load()
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    kafka = LocalKafka(settings)
    try:
        if args.command == "start":
            sys.stdout.write(kafka.start(timeout_s=args.timeout or 90) + "\n")
        elif args.command == "stop":
            kafka.stop(timeout_s=args.timeout or 30)
        elif args.command == "fetch":
            sys.stdout.write(f"{fetch_jars(settings)}\n")  # progress goes to the log
        else:
            state = kafka.status()
            sys.stdout.write(json.dumps(state, indent=2) + "\n")
            return 0 if state["running"] else 3
    except KafkaLocalError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
