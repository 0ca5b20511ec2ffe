"""The local Kafka as a whole: the single broker of ``argus up`` (``brokers`` = 1, the default), or a KRaft
cluster of ``brokers`` combined broker+controller nodes on loopback (``argus up --brokers 3``).

Each node is a :class:`~argus.local_kafka.LocalKafka` with its own ``node.id``, ports, log dirs and JVM (512 MB
heap), all formatted with one cluster id and listing every node in ``controller.quorum.voters``. Topics (the
internal ones too: consumer offsets, transaction state) are replicated ``replication_factor`` times with
``min.insync.replicas`` = :attr:`~argus.core.settings.Settings.min_insync_replicas` (3 brokers: RF 3, 2 in
sync), so one node may fail (``kill -9``, a rolling restart) without losing an acknowledged record: every argus
producer writes with ``acks=all`` and idempotence (:data:`argus.core.kafka_security.DURABLE_PRODUCER`).

The supervisor (:mod:`argus.supervisor`) keeps each node running as it keeps the single broker; this module
starts, stops and inspects them all, and tells which node leads a partition and which controller is active.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

from argus.core.errors import KafkaLocalError
from argus.core.settings import Settings
from argus.local_kafka import LocalKafka, broker_nodes, is_kafka_process, pid_alive

__all__ = ["KafkaCluster", "stop_local_brokers"]

log = logging.getLogger(__name__)


class KafkaCluster:
    """The local brokers of ``settings`` (``settings.brokers`` nodes)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        voters = broker_nodes(settings)
        self.nodes: tuple[LocalKafka, ...] = tuple(LocalKafka(settings, node, voters) for node in voters)

    @property
    def bootstrap(self) -> str:
        """Every node's ``host:port``, comma-separated (what clients bootstrap from)."""
        return ",".join(n.bootstrap for n in self.nodes)

    def node(self, node_id: int) -> LocalKafka:
        """The node of KRaft id ``node_id``. Raises KeyError for an unknown id."""
        for n in self.nodes:
            if n.node.node_id == node_id:
                return n
        raise KeyError(node_id)

    def is_healthy(self) -> bool:
        """Every node answers and is registered (unfenced) in the cluster."""
        return all(n.is_healthy() for n in self.nodes)

    def start(self, timeout_s: float = 120) -> str:
        """Start every node that is not running and wait until the cluster is healthy and accepts a topic
        replicated ``replication_factor`` times; returns the bootstrap servers.

        Raises:
            KafkaLocalError: as :meth:`LocalKafka.start`; a node that exits during start-up is named with the
                end of its log; on any failure every node of the cluster is stopped again (a cluster short of a
                node is no start).
        """
        if len(self.nodes) == 1:
            return self.nodes[0].start(timeout_s=timeout_s)
        if self.is_healthy():
            log.info("reusing the Kafka cluster already healthy on %s", self.bootstrap)
            return self.bootstrap
        deadline = time.monotonic() + timeout_s
        # A node alone has no quorum: all are launched before any can become healthy.
        launched = {n.node.node_id: n.launch() for n in self.nodes}
        first = self.nodes[0]
        while time.monotonic() < deadline:
            for n in self.nodes:
                if not n._alive(launched[n.node.node_id]):
                    self.stop()
                    raise KafkaLocalError(f"Kafka node {n.node.node_id} (pid {launched[n.node.node_id]}) exited "
                                          f"during start-up:\n{n._console_tail()}")
            if self.is_healthy() and first._probe_topic(replication=self.settings.replication_factor):
                log.info("Kafka cluster of %d nodes healthy on %s", len(self.nodes), self.bootstrap)
                return self.bootstrap
            time.sleep(0.5)
        tails = "\n".join(f"node {n.node.node_id}:\n{n._console_tail()}" for n in self.nodes)
        self.stop()
        raise KafkaLocalError(f"the Kafka cluster did not become healthy within {timeout_s:.0f}s:\n{tails}")

    def stop(self, timeout_s: float = 30) -> None:
        """Stop every node: SIGTERM to all at once (each shuts down while the others still form a quorum for as
        long as they can), then each waited for, SIGKILL after ``timeout_s``."""
        for n in self.nodes:
            pid = n.pid()
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
        for n in self.nodes:
            n.stop(timeout_s=timeout_s)

    def status(self) -> dict[str, Any]:
        """The cluster as one process (``running``/``healthy``: every node; ``pid``: the first node's, ``log``,
        ``home``, ``bootstrap``), with ``brokers``: each node's :meth:`LocalKafka.status`, and, for a cluster,
        ``controller``: the active KRaft controller's node id (``None`` if unknown)."""
        brokers = [n.status() for n in self.nodes]
        first = brokers[0]
        out: dict[str, Any] = {**first, "running": all(b["running"] for b in brokers),
                               "healthy": all(b["healthy"] for b in brokers), "bootstrap": self.bootstrap,
                               "brokers": brokers}
        out.pop("node_id", None)
        if len(self.nodes) > 1:
            out["home"] = str(self.nodes[0].dir.parent)
            out["controller"] = self.active_controller()
        return out

    # -- for fault injection and inspection -------------------------------------------------------
    def active_controller(self) -> int | None:
        """The node id of the active KRaft controller (the metadata quorum's leader), read from the quorum
        state each node persists (``__cluster_metadata-0/quorum-state``): the leader of the newest epoch.
        ``None`` while no node knows one."""
        best: tuple[int, int] | None = None
        for n in self.nodes:
            try:
                doc = json.loads((n.data_dir / "__cluster_metadata-0" / "quorum-state").read_text())
                leader, epoch = int(doc.get("leaderId", -1)), int(doc.get("leaderEpoch", -1))
            except (OSError, ValueError, TypeError, AttributeError):
                continue
            if leader >= 0 and (best is None or epoch > best[1]):
                best = (leader, epoch)
        return None if best is None else best[0]

    def partition_leaders(self, topic: str, timeout_s: float = 10.0) -> dict[int, int]:
        """Partition -> node id of its leader, for ``topic`` (-1 where it has none now).

        Raises:
            KafkaLocalError: no node answered, or the topic is unknown.
        """
        parts = self._partitions(timeout_s).get(topic)
        if not parts:
            raise KafkaLocalError(f"topic {topic} is not on the local Kafka")
        return {p: leader for p, (leader, _replicas, _isrs) in parts.items()}

    def under_replicated(self, timeout_s: float = 10.0) -> int:
        """Partitions (of every topic) whose in-sync replicas are fewer than their replicas, or without leader.

        Raises:
            KafkaLocalError: no node answered.
        """
        return sum(1 for parts in self._partitions(timeout_s).values()
                   for leader, replicas, isrs in parts.values() if leader < 0 or len(isrs) < len(replicas))

    def _partitions(self, timeout_s: float) -> dict[str, dict[int, tuple[int, list[int], list[int]]]]:
        last: Exception | None = None
        for n in self.nodes:
            if not n._port_open(n.port):
                continue
            try:
                md = n._admin().list_topics(timeout=timeout_s)
            except Exception as exc:  # KafkaException or a timeout: ask the next node
                last = exc
                continue
            return {name: {p: (pm.leader, list(pm.replicas), list(pm.isrs)) for p, pm in t.partitions.items()}
                    for name, t in md.topics.items()}
        raise KafkaLocalError(f"no Kafka node of {self.bootstrap} answered metadata: {last}")


def stop_local_brokers(home: Path, timeout_s: float = 30) -> list[int]:
    """Stop every broker started from ``home`` (the single one and the nodes of any cluster size, whatever the
    settings now say), so ``argus down`` leaves none; returns their pids. SIGTERM to all, SIGKILL after
    ``timeout_s``."""
    pids = []
    for pid_path in sorted((home / "kafka").resolve().glob("**/kafka.pid")):
        try:
            pid = int(pid_path.read_text().strip())
        except (OSError, ValueError):
            continue
        if pid_alive(pid) and is_kafka_process(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            pids.append(pid)
        else:
            pid_path.unlink(missing_ok=True)
    deadline = time.monotonic() + timeout_s
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in pids:
        if pid_alive(pid):
            log.warning("Kafka broker (pid %d) ignored SIGTERM for %.0f s; killing it", pid, timeout_s)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    for pid_path in (home / "kafka").resolve().glob("**/kafka.pid"):
        with contextlib.suppress(OSError, ValueError):
            if not pid_alive(int(pid_path.read_text().strip())):
                pid_path.unlink(missing_ok=True)
    return pids

