"""Kafka topics of argus: names, keys, record types and idempotent creation.

:class:`Topic` names each logical topic (full names carry ``Settings.topic_prefix``, default ``argus.``); the key
functions put the records that must meet in one partition (a rank's kernels, a job's steps, a kernel's
summaries); :func:`ensure_topics` creates every topic up front.

The table of topics, keys and records, and why each key: docs/internals/application.md.
"""

from __future__ import annotations

import enum
import logging
from typing import Any, Protocol

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient, NewTopic

from argus.core.errors import ArgusError
from argus.core.kafka_security import AuthWatch, client_config
from argus.core.settings import Settings
from argus.schemas.control import ControlCommand
from argus.schemas.job_context import JobContext
from argus.schemas.records import (
    CpuStack,
    DeadLetter,
    Finding,
    Heartbeat,
    JobLifecycle,
    JobTopology,
    KernelBatch,
    KernelSummary,
    PhaseBatch,
    Record,
    Step,
)

__all__ = ["PARTITIONER", "RECORD_OF", "PublisherLike", "Topic", "control_partition", "ensure_topics", "job_key",
           "kernel_key", "key_partition", "publish_in_order", "rank_key"]

log = logging.getLogger(__name__)


class Topic(enum.Enum):
    KERNELS = "kernels"
    STEPS = "steps"
    PHASES = "phases"
    SUMMARIES = "summaries"
    TOPOLOGY = "topology"
    LIFECYCLE = "lifecycle"
    FINDINGS = "findings"
    #: Each finding again as one JSON object (the ``argus findings --json`` contract), UTF-8, no framing:
    #: readable by kcat, kafka-console-consumer or any client without argus's Avro schemas.
    FINDINGS_JSON = "findings.json"
    DEAD_LETTER = "deadletter"
    STACKS = "stacks"
    HEARTBEATS = "heartbeats"
    CONTEXT = "context"
    #: Commands to running ranks (``argus control``): compacted, every record of a job in the partition of
    #: ``job_key(job)`` (see :func:`control_partition`), which the job's ranks read from its start.
    CONTROL = "control"

    def full(self, settings: Settings) -> str:
        """The topic's name on the broker."""
        return settings.topic(self.value)


RECORD_OF: dict[Topic, type[Record]] = {
    Topic.KERNELS: KernelBatch,
    Topic.STEPS: Step,
    Topic.PHASES: PhaseBatch,
    Topic.SUMMARIES: KernelSummary,
    Topic.TOPOLOGY: JobTopology,
    Topic.LIFECYCLE: JobLifecycle,
    Topic.FINDINGS: Finding,
    Topic.DEAD_LETTER: DeadLetter,
    Topic.STACKS: CpuStack,
    Topic.HEARTBEATS: Heartbeat,
    Topic.CONTEXT: JobContext,
    Topic.CONTROL: ControlCommand,
}


def rank_key(job_id: str, rank: int) -> bytes:
    return f"{job_id}/{rank}".encode()


def kernel_key(job_id: str, kernel: str, stream: int) -> bytes:
    return f"{job_id}/{kernel}/{stream}".encode()


class PublisherLike(Protocol):
    """What argus publishes records through: the rank-side :class:`~argus.producers.publisher.Publisher`, the
    in-process collector of :mod:`argus.streams.offline`, or a test double.

    ``publish(topic, key, record)``: queue ``record`` (a record of ``RECORD_OF[topic]``) under ``key``; False when
    it was dropped (and counted), never an exception for a full queue. ``flush(timeout_s)``: wait up to
    ``timeout_s`` seconds (default 30) for queued messages; the number still queued.
    """

    def publish(self, topic: Topic, key: bytes, record: Any) -> bool: ...

    def flush(self, timeout_s: float = 30.0) -> int: ...


def publish_in_order(publisher: PublisherLike, topic: Topic, key: bytes, record: Any, timeout_s: float = 30.0) -> bool:
    """Publish ``record`` once every record queued before it is delivered (``flush`` first), as a job's END is.

    Kafka orders a producer's messages within one partition only. The END goes to the lifecycle topic, the job's
    kernel batches to the kernel partitions; after a broker outage the producer retries each partition on its
    own, and an END delivered before the last batches makes the worker close the job's windows without them:
    they become late pieces of windows already judged, and the findings differ from those of the same job
    published without the outage. A flush that leaves records undelivered after ``timeout_s`` seconds is logged
    and the record published all the same (an END is never held back for good). Returns what ``publish``
    returned.
    """
    left = publisher.flush(timeout_s)
    if left:
        log.warning("%d records still undelivered after %.1f s: publishing the %s record to %s after them anyway",
                    left, timeout_s, type(record).__name__, topic.value)
    return publisher.publish(topic, key, record)


def job_key(job_id: str) -> bytes:
    return job_id.encode()


#: librdkafka's name of the Java client's partitioner (murmur2 of the key; random without a key).
PARTITIONER = "murmur2_random"

_M32 = 0xFFFFFFFF


def _murmur2(data: bytes) -> int:
    """MurmurHash2 (32 bit, seed 0x9747b28c) as ``org.apache.kafka.common.utils.Utils.murmur2`` computes it."""
    m, n = 0x5BD1E995, len(data)
    h = (0x9747B28C ^ n) & _M32
    body = n - n % 4
    for i in range(0, body, 4):
        k = int.from_bytes(data[i:i + 4], "little") * m & _M32
        k = (k ^ (k >> 24)) * m & _M32
        h = (h * m & _M32) ^ k
    tail = data[body:]
    if tail:
        h ^= int.from_bytes(tail, "little")
        h = h * m & _M32
    h = (h ^ (h >> 13)) * m & _M32
    return h ^ (h >> 15)


def key_partition(key: bytes, partitions: int) -> int:
    """The partition (of ``partitions``) a record keyed ``key`` goes to from any argus producer."""
    if partitions < 1:
        raise ValueError(f"partitions must be >= 1, got {partitions}")
    return (_murmur2(key) & 0x7FFFFFFF) % partitions


#: Topics that keep the newest record per key (the job context is read in full by every worker at start).
_COMPACTED = frozenset({Topic.TOPOLOGY, Topic.CONTEXT, Topic.CONTROL})


def control_partition(job_id: str, partitions: int) -> int:
    """The partition of the control topic that holds every command to ``job_id``'s ranks (the one its
    ``job_key`` hashes to, whatever the command's own key)."""
    return key_partition(job_key(job_id), partitions)


def ensure_topics(settings: Settings, timeout_s: float = 30.0) -> list[str]:
    """Create every argus topic that does not exist yet; existing ones are left as they are.

    Returns the names created. Raises :class:`ArgusError` when the broker refuses.
    """
    watch = AuthWatch(settings.kafka)
    admin = AdminClient(client_config(settings.kafka, {"error_cb": watch}))
    try:
        existing = set(admin.list_topics(timeout=timeout_s).topics)
    except KafkaException as exc:
        admin.poll(0)  # serves the error callbacks: was it the credentials?
        raise ArgusError(watch.explain() or f"cannot list topics on {settings.bootstrap_servers}: {exc}") from exc
    # acks=all writes (every argus producer's) succeed while this many replicas are in sync (RF 3: 2).
    config = {"retention.ms": str(settings.retention_ms), "min.insync.replicas": str(settings.min_insync_replicas)}
    wanted = [
        NewTopic(t.full(settings), num_partitions=settings.partitions,
                 replication_factor=settings.replication_factor,
                 config={**config, "cleanup.policy": "compact"} if t in _COMPACTED else config)
        for t in Topic
        if t.full(settings) not in existing
    ]
    # Faust's leader-election topic: created here because the worker does not declare topics itself.
    leader = f"{settings.app_id}-__assignor-__leader"
    if leader not in existing:
        wanted.append(NewTopic(leader, num_partitions=1, replication_factor=settings.replication_factor,
                               config={"min.insync.replicas": str(settings.min_insync_replicas)}))
    created: list[str] = []
    if not wanted:
        return created
    for name, fut in admin.create_topics(wanted, request_timeout=timeout_s).items():
        try:
            fut.result()
            created.append(name)
            log.info("created topic %s (%d partitions, %d replicas)", name, settings.partitions,
                     settings.replication_factor)
        except KafkaException as exc:
            if exc.args and getattr(exc.args[0], "code", lambda: None)() == 36:  # TOPIC_ALREADY_EXISTS
                continue
            raise ArgusError(f"cannot create topic {name}: {exc}") from exc
    return created
