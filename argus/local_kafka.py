"""The local broker: a project-managed Apache Kafka (KRaft) node without Docker, the single broker of ``argus up``
or one node of the local cluster (:mod:`argus.kafka_cluster`, ``brokers`` > 1).

The jars come from Maven Central (:mod:`argus.kafka_jars`, re-exported here). The single broker's state lives
under ``Settings.home/"kafka"`` (a cluster node's under ``Settings.home/"kafka"/"cluster<N>"/"node<id>"``):
``data/`` (log dirs, formatted once with a stable cluster id kept in ``cluster.id``), ``server.properties``,
``log4j2.properties``, ``kafka.pid``, ``logs/server.log`` (broker log) and ``kafka.out`` (JVM console).
The single broker listens on the host and port of the first ``Settings.bootstrap_servers`` entry, node ``i`` of
a cluster on the ``i``-th; each node's KRaft controller listens on the next port.

Details and reasoning: docs/internals/application.md.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from argus.core.errors import KafkaLocalError
from argus.core.kafka_security import AuthWatch, client_config
from argus.core.private_files import write_private
from argus.core.settings import Settings
from argus.kafka_jars import fetch_jars, pom_path, tail_text
from argus.kafka_users import Role, admin_settings

__all__ = ["BrokerNode", "LocalKafka", "broker_nodes", "fetch_jars", "is_kafka_process", "pid_alive", "pom_path"]

logger = logging.getLogger(__name__)

#: SCRAM user names the local broker takes: they go unquoted into ``--add-scram`` and JAAS option names.
_LOCAL_USER = re.compile(r"^[A-Za-z0-9._@-]{1,128}$")
_SCRAM_ITERATIONS = 8192
_SCRAM_HASH = {"SCRAM-SHA-256": "sha256", "SCRAM-SHA-512": "sha512"}


def _jaas_quote(value: str) -> str:
    """``value`` as a JAAS option value (Kafka's JAAS parser reads backslash escapes inside quotes)."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _properties_escape(value: str) -> str:
    """``value`` escaped for a Java ``.properties`` file read as ISO-8859-1 (Kafka's ``loadProps``)."""
    out = []
    for i, ch in enumerate(value):
        if ch == "\\":
            out.append("\\\\")
        elif ch == " " and i == 0:
            out.append("\\ ")  # a leading blank would be taken for the separator
        elif " " <= ch <= "~":
            out.append(ch)
        else:  # control and non-ASCII characters as UTF-16 code units
            units = ch.encode("utf-16-be")
            out.extend(f"\\u{units[j]:02x}{units[j + 1]:02x}" for j in range(0, len(units), 2))
    return "".join(out)


def _argfile_quote(arg: str) -> str:
    """``arg`` quoted for a Java launcher argument file (``java @file``)."""
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _random_cluster_id() -> str:
    """A Kafka cluster id: a random UUID in URL-safe base64 without padding (as ``random-uuid``)."""
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not cid.startswith("-"):  # Kafka avoids ids that look like command-line options
            return cid


@dataclass(frozen=True)
class BrokerNode:
    """One combined broker+controller node of the local Kafka: its KRaft ``node.id`` (from 1), the loopback
    host, its client port and its controller port."""

    node_id: int
    host: str
    port: int
    controller_port: int

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"


def broker_nodes(settings: Settings) -> tuple[BrokerNode, ...]:
    """The local Kafka's nodes: node ``i`` on the ``i``-th ``bootstrap_servers`` entry, its controller on the next
    port; ``settings.brokers`` of them (one: the first entry, whatever else is listed).

    Raises:
        KafkaLocalError: two nodes would share a port (entries must be 2 ports apart at least).
    """
    nodes = []
    for i, entry in enumerate(settings.bootstrap_servers.split(",")[:settings.brokers], 1):
        host, _, port = entry.strip().rpartition(":")
        nodes.append(BrokerNode(i, host.strip("[]") or "127.0.0.1", int(port), int(port) + 1))
    ports = [(n.host, p) for n in nodes for p in (n.port, n.controller_port)]
    if len(set(ports)) != len(ports):
        raise KafkaLocalError(f"the local brokers' ports overlap in {settings.bootstrap_servers!r}: each broker "
                              "takes its port and the next (its controller), so entries must be 2 apart")
    return tuple(nodes)


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


def is_kafka_process(pid: int) -> bool:
    """Whether ``pid`` runs a Kafka broker (``kafka.Kafka`` on its ``/proc`` command line; without ``/proc`` the
    pid file is trusted), so a reused pid is never taken for a broker."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True  # no /proc (not Linux): trust the pid file
    return b"kafka.Kafka" in cmdline


class LocalKafka:
    """One combined broker+controller Kafka node managed by argus: the single local broker, or one node of the
    local cluster (:class:`argus.kafka_cluster.KafkaCluster`) when ``voters`` holds several.

    Args:
        settings: home, ports (``bootstrap_servers``), security, replication.
        node: which node (default: the first of :func:`broker_nodes`).
        voters: the KRaft quorum, every node of the cluster (default: :func:`broker_nodes`). A node of a
            cluster keeps its state in ``<home>/kafka/cluster<N>/node<id>``, the cluster id shared in
            ``<home>/kafka/cluster<N>/cluster.id``; the single broker in ``<home>/kafka``.
    """

    def __init__(self, settings: Settings, node: BrokerNode | None = None,
                 voters: Sequence[BrokerNode] | None = None) -> None:
        # A secure broker (kafka_secure) is its home's admin: formatted with its SCRAM user, probed as it.
        self.settings = admin_settings(settings) if settings.kafka_secure else settings
        self.voters = tuple(voters) if voters is not None else broker_nodes(settings)
        self.node = node or self.voters[0]
        self.host, self.port, self.controller_port = self.node.host, self.node.port, self.node.controller_port
        root = (settings.home / "kafka").resolve()
        if self.clustered:
            root = root / f"cluster{len(self.voters)}"
            self.dir = root / f"node{self.node.node_id}"
        else:
            self.dir = root
        self.data_dir = self.dir / "data"
        self.properties_path = self.dir / "server.properties"
        self.log4j_path = self.dir / "log4j2.properties"
        self.cluster_id_path = root / "cluster.id"
        self.pid_path = self.dir / "kafka.pid"
        self.console_path = self.dir / "kafka.out"
        self.log_path = self.dir / "logs" / "server.log"
        self._proc: subprocess.Popen[bytes] | None = None  # the broker, when this object launched it
        self._log_offset = 0  # size of the broker log when this object launched the broker
        self._watch = AuthWatch(settings.kafka)  # whether the broker refused our credentials (last probe)

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def clustered(self) -> bool:
        """Whether this node is one of a cluster of several."""
        return len(self.voters) > 1

    @property
    def name(self) -> str:
        """The node's name in the supervisor's state and ``argus status``: ``kafka``, or ``kafka-<id>``."""
        return f"kafka-{self.node.node_id}" if self.clustered else "kafka"

    # -- state ------------------------------------------------------------------------------------
    def pid(self) -> int | None:
        """The pid of the broker this home started, if it is still running."""
        try:
            pid = int(self.pid_path.read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if self._alive(pid) and is_kafka_process(pid) else None

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

        conf = client_config(self.settings.kafka, {
            "bootstrap.servers": self.bootstrap,
            "log_level": 0,  # connection-refused noise while the broker boots
            "error_cb": self._watch,
        })
        return AdminClient(conf)

    def _refused(self) -> KafkaLocalError:
        return KafkaLocalError(self._watch.explain())

    def is_healthy(self, timeout_s: float = 3.0) -> bool:
        """True if a broker answers metadata on the configured port and knows its controller."""
        if not self._port_open(self.port):
            return False
        self._watch.refused = None
        admin = self._admin()
        try:
            md = admin.list_topics(timeout=timeout_s)
        except Exception as exc:  # KafkaException or a timeout: not healthy (yet)
            admin.poll(0)  # serves the error callbacks: was it the credentials?
            logger.debug("metadata probe failed: %s", exc)
            return False
        # A node of a cluster is healthy once it is registered and unfenced (its metadata lists itself).
        return bool(md.brokers) and md.controller_id >= 0 and (not self.clustered
                                                                or self.node.node_id in md.brokers)

    def _probe_topic(self, timeout_s: float = 10.0, replication: int = 1) -> bool:
        """Create and delete a throw-away topic: proves the controller accepts metadata changes."""
        from confluent_kafka.admin import NewTopic

        admin = self._admin()
        name = f"_argus_probe_{uuid.uuid4().hex[:12]}"
        try:
            admin.create_topics([NewTopic(name, 1, replication)],
                                operation_timeout=timeout_s)[name].result(timeout_s)
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
            "node_id": self.node.node_id,
            "running": pid is not None,
            "pid": pid,
            "healthy": self.is_healthy(),
            "bootstrap": self.bootstrap,
            "log": str(self.log_path),
            "home": str(self.dir),
        }

    # -- security ---------------------------------------------------------------------------------
    def _sasl(self) -> bool:
        """Whether the broker's client listener takes SASL (checks what the local broker can serve).

        Raises:
            KafkaLocalError: TLS was asked for, or a user name the local broker cannot declare.
        """
        protocol = self.settings.kafka_security_protocol
        if protocol not in ("PLAINTEXT", "SASL_PLAINTEXT"):
            raise KafkaLocalError(f"the local broker serves PLAINTEXT or SASL_PLAINTEXT, not {protocol}; point "
                                  "bootstrap_servers at a TLS-enabled cluster instead")
        if protocol == "PLAINTEXT":
            return False
        if self.clustered:
            # Each node's controller listener takes a secret of its own launch: nodes could not reach each other.
            raise KafkaLocalError("the local cluster (brokers > 1) serves PLAINTEXT only; SASL is offered by the "
                                  "single local broker (brokers = 1)")
        if not _LOCAL_USER.match(self.settings.kafka_sasl_username):
            raise KafkaLocalError("the local broker takes SASL user names of letters, digits and ._@- only, "
                                  f"got {self.settings.kafka_sasl_username!r}")
        return True

    def _security_props(self) -> dict[str, str]:
        """Listener properties: all PLAINTEXT, or SASL on both the client and the controller listener."""
        client = f"{self.host}:{self.port}"
        controller = f"CONTROLLER://{self.host}:{self.controller_port}"
        if not self._sasl():
            return {"listeners": f"PLAINTEXT://{client},{controller}",
                    "advertised.listeners": f"PLAINTEXT://{client}",
                    "inter.broker.listener.name": "PLAINTEXT",
                    "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT"}
        mechanism = self.settings.kafka_sasl_mechanism
        user, password = self.settings.kafka_sasl_username, self.settings.kafka_sasl_password.reveal()
        if mechanism == "PLAIN":
            module = "org.apache.kafka.common.security.plain.PlainLoginModule"
            users = f" user_{user}={_jaas_quote(password)}"
        else:  # SCRAM: the users are in the metadata (see _format)
            module = "org.apache.kafka.common.security.scram.ScramLoginModule"
            users = ""
        # The broker authenticates to itself as the configured user.
        jaas = f"{module} required username={_jaas_quote(user)} password={_jaas_quote(password)}{users};"
        # KRaft controllers cannot take SCRAM (its credentials live in the metadata they serve): PLAIN with a
        # secret of this launch, so the controller port is not an open door either.
        secret = secrets.token_urlsafe(24)
        controller_jaas = ("org.apache.kafka.common.security.plain.PlainLoginModule required "
                           f'username="controller" password="{secret}" user_controller="{secret}";')
        return {**self._authorizer_props(),
                "listeners": f"SASL_PLAINTEXT://{client},{controller}",
                "advertised.listeners": f"SASL_PLAINTEXT://{client}",
                "inter.broker.listener.name": "SASL_PLAINTEXT",
                "listener.security.protocol.map": "CONTROLLER:SASL_PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT",
                "sasl.enabled.mechanisms": mechanism,
                "sasl.mechanism.inter.broker.protocol": mechanism,
                f"listener.name.sasl_plaintext.{mechanism.lower()}.sasl.jaas.config": jaas,
                "sasl.mechanism.controller.protocol": "PLAIN",
                "listener.name.controller.sasl.enabled.mechanisms": "PLAIN",
                "listener.name.controller.plain.sasl.jaas.config": controller_jaas}

    def _authorizer_props(self) -> dict[str, str]:
        """With ``kafka_secure``: the KRaft authorizer, denying whatever no ACL allows (:mod:`argus.kafka_acls`);
        the admin (the broker's own principal) and the controller listener's user are super users."""
        if not self.settings.kafka_secure:
            return {}
        return {"authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
                "super.users": f"User:{Role.ADMIN.value};User:controller",
                "allow.everyone.if.no.acl.found": "false"}

    def _scram_marker(self, salt: bytes, salted: bytes) -> dict[str, Any]:
        return {"mechanism": self.settings.kafka_sasl_mechanism, "user": self.settings.kafka_sasl_username,
                "salt": base64.b64encode(salt).decode(), "iterations": _SCRAM_ITERATIONS,
                "salted_password_sha256": hashlib.sha256(salted).hexdigest()}

    def _salted_password(self, salt: bytes) -> bytes:
        """SCRAM's SaltedPassword (RFC 5802 ``Hi``, i.e. PBKDF2-HMAC), as Kafka's ScramFormatter makes it."""
        return hashlib.pbkdf2_hmac(_SCRAM_HASH[self.settings.kafka_sasl_mechanism],
                                   self.settings.kafka_sasl_password.reveal().encode(), salt, _SCRAM_ITERATIONS)

    def _check_scram_user(self) -> None:
        """A storage formatted before must hold the configured SCRAM user and password."""
        marker = self.dir / "scram.json"
        try:
            known = json.loads(marker.read_text())
            salted = self._salted_password(base64.b64decode(known["salt"]))
            expected = self._scram_marker(base64.b64decode(known["salt"]), salted)
        except (OSError, ValueError, KeyError, TypeError):
            known, expected = None, {}
        if known != expected:
            raise KafkaLocalError(
                f"the local broker's storage in {self.data_dir} was formatted without SCRAM user "
                f"{self.settings.kafka_sasl_username!r} (or with another password or mechanism); SCRAM users "
                f"are added only when the storage is formatted: remove {self.data_dir} (its topics are lost) or "
                "use the credentials it was formatted with")

    # -- files ------------------------------------------------------------------------------------
    def _write_configs(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # A cluster replicates as the settings say (internal topics too); the single broker has one copy.
        rf, isr = ((self.settings.replication_factor, self.settings.min_insync_replicas) if self.clustered
                   else (1, 1))
        props = {
            "process.roles": "broker,controller",
            "node.id": str(self.node.node_id),
            "controller.quorum.voters": ",".join(f"{v.node_id}@{v.host}:{v.controller_port}" for v in self.voters),
            **self._security_props(),
            "controller.listener.names": "CONTROLLER",
            "log.dirs": str(self.data_dir),
            "num.partitions": str(self.settings.partitions),
            "default.replication.factor": str(rf),
            "min.insync.replicas": str(isr),
            "offsets.topic.replication.factor": str(rf),
            "transaction.state.log.replication.factor": str(rf),
            "transaction.state.log.min.isr": str(isr),
            "share.coordinator.state.topic.replication.factor": str(rf),
            "share.coordinator.state.topic.min.isr": str(isr),
            # A follower that stopped fetching leaves the ISR after this (a killed one sooner: fenced when its
            # broker session expires), so acks=all writes wait for it at most this long.
            "replica.lag.time.max.ms": "10000",
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
        # 0600: with SASL it holds the user's password.
        write_private(self.properties_path,
                       text + "".join(f"{k}={_properties_escape(v)}\n" for k, v in props.items()))
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
        scram = self._sasl() and self.settings.kafka_sasl_mechanism in _SCRAM_HASH
        if (self.data_dir / "meta.properties").exists():
            if scram:
                self._check_scram_user()
            return
        if self.cluster_id_path.exists():
            cluster_id = self.cluster_id_path.read_text().strip()
        else:
            cluster_id = _random_cluster_id()
            self.cluster_id_path.write_text(cluster_id + "\n")
        args = ["format", "--ignore-formatted", "-t", cluster_id, "-c", str(self.properties_path)]
        marker: dict[str, Any] | None = None
        if scram:
            # A salted password (base64, no commas) instead of the password: --add-scram splits on commas.
            salt = secrets.token_bytes(32)
            salted = self._salted_password(salt)
            marker = self._scram_marker(salt, salted)
            args += ["--add-scram", f"{self.settings.kafka_sasl_mechanism}=[name={self.settings.kafka_sasl_username},"
                                    f"salt={marker['salt']},saltedpassword={base64.b64encode(salted).decode()},"
                                    f"iterations={_SCRAM_ITERATIONS}]"]
        cmd = self._java(libs, "kafka.tools.StorageTool", *args)
        # The arguments go through a 0600 argument file: a command line is readable by every local user.
        argfile = self.dir / "format.args"
        write_private(argfile, "\n".join(_argfile_quote(a) for a in cmd[1:]) + "\n")
        logger.info("formatting KRaft storage in %s (cluster id %s%s)", self.data_dir, cluster_id,
                    f", SCRAM user {self.settings.kafka_sasl_username}" if scram else "")
        try:
            proc = subprocess.run([cmd[0], f"@{argfile}"], capture_output=True, text=True, check=False, timeout=120)
        finally:
            argfile.unlink(missing_ok=True)
        if proc.returncode != 0:
            raise KafkaLocalError(f"kafka-storage format failed (exit {proc.returncode}):\n"
                                  + tail_text(proc.stdout + "\n" + proc.stderr))
        if marker is not None:
            write_private(self.dir / "scram.json", json.dumps(marker) + "\n")

    def _console_tail(self) -> str:
        """The JVM console, the broker's ERROR lines of this launch and the end of its log."""
        parts = []
        with contextlib.suppress(OSError):
            console = self.console_path.read_text(errors="replace")
            if console.strip():
                parts.append(f"--- {self.console_path} ---\n" + tail_text(console, 1500))
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
            parts.append(f"--- {self.log_path} ---\n" + tail_text("\n".join(lines), 1500))
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
                    if self._watch.refused is not None:
                        raise self._refused()
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

    def launch(self) -> int:
        """Launch the broker without waiting for it (or find this home's running one); returns its pid.

        For a caller that polls :meth:`pid` and :meth:`is_healthy` itself (the stack's supervisor).

        Raises:
            KafkaLocalError: as :meth:`start`, except that health is not awaited.
        """
        return self._launch()

    def exit_code(self) -> int | None:
        """The exit status of the broker this object launched, once it has exited (negative: the signal that
        ended it); ``None`` while it runs or when another process launched it."""
        return None if self._proc is None else self._proc.poll()

    def start(self, timeout_s: float = 90) -> str:
        """Start the broker (or reuse a healthy one on the port) and return the bootstrap servers.

        Raises:
            KafkaLocalError: jars could not be fetched, storage not formatted, the port is taken by
                something that is not a healthy broker, the broker refused the configured SASL credentials,
                or it did not become healthy in time.
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
            if self._watch.refused is not None:
                refused = self._refused()
                if self._proc is not None:  # launched by this call: not left running with credentials it refuses
                    self.stop()
                raise refused
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
