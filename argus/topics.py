"""Kafka topics of argus: names, keys, record types and idempotent creation.

=================  ==============================  ======================  ===============================
logical topic      key                             record                  why that key
=================  ==============================  ======================  ===============================
``kernels``        ``<job>/<rank>``                KernelBatch             one rank ordered in one partition
``steps``          ``<job>``                       Step                    all ranks of a job meet (L1/L2)
``phases``         ``<job>``                       PhaseBatch              same
``summaries``      ``<job>/<kernel>/<stream>``     KernelSummary           all ranks of a kernel meet (L3)
``topology``       ``<job>``                       JobTopology             compacted per job
``lifecycle``      ``<job>``                       JobLifecycle            start/end of a job
``findings``       ``<job>``                       Finding                 the diagnosis output
``stacks``         ``<job>/<rank>``                CpuStack                py-spy dumps for findings
``deadletter``     the rejected message's key      DeadLetter              nothing is lost silently
=================  ==============================  ======================  ===============================

Full names carry :attr:`Settings.topic_prefix` (default ``argus.``). Every topic is created up front with
the same partition count (Faust's changelogs require it) and :attr:`Settings.retention_ms`.
"""

from __future__ import annotations

import enum
import logging

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient, NewTopic

from argus.errors import ArgusError
from argus.settings import Settings
from schemas.records import (
    CpuStack,
    DeadLetter,
    Finding,
    JobLifecycle,
    JobTopology,
    KernelBatch,
    KernelSummary,
    PhaseBatch,
    Record,
    Step,
)

__all__ = ["RECORD_OF", "Topic", "ensure_topics", "job_key", "kernel_key", "rank_key"]

log = logging.getLogger(__name__)


class Topic(enum.Enum):
    KERNELS = "kernels"
    STEPS = "steps"
    PHASES = "phases"
    SUMMARIES = "summaries"
    TOPOLOGY = "topology"
    LIFECYCLE = "lifecycle"
    FINDINGS = "findings"
    DEAD_LETTER = "deadletter"
    STACKS = "stacks"

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
}


def rank_key(job_id: str, rank: int) -> bytes:
    return f"{job_id}/{rank}".encode()


def kernel_key(job_id: str, kernel: str, stream: int) -> bytes:
    return f"{job_id}/{kernel}/{stream}".encode()


def job_key(job_id: str) -> bytes:
    return job_id.encode()


def ensure_topics(settings: Settings, timeout_s: float = 30.0) -> list[str]:
    """Create every argus topic that does not exist yet; existing ones are left as they are.

    Returns the names created. Raises :class:`ArgusError` when the broker refuses.
    """
    admin = AdminClient({"bootstrap.servers": settings.bootstrap_servers})
    try:
        existing = set(admin.list_topics(timeout=timeout_s).topics)
    except KafkaException as exc:
        raise ArgusError(f"cannot list topics on {settings.bootstrap_servers}: {exc}") from exc
    config = {"retention.ms": str(settings.retention_ms)}
    wanted = [
        NewTopic(t.full(settings), num_partitions=settings.partitions,
                 replication_factor=settings.replication_factor,
                 config={**config, "cleanup.policy": "compact"} if t is Topic.TOPOLOGY else config)
        for t in Topic
        if t.full(settings) not in existing
    ]
    # Faust's leader-election topic: created here because the worker does not declare topics itself.
    leader = f"{settings.app_id}-__assignor-__leader"
    if leader not in existing:
        wanted.append(NewTopic(leader, num_partitions=1, replication_factor=settings.replication_factor))
    created: list[str] = []
    if not wanted:
        return created
    for name, fut in admin.create_topics(wanted, request_timeout=timeout_s).items():
        try:
            fut.result()
            created.append(name)
            log.info("created topic %s (%d partitions)", name, settings.partitions)
        except KafkaException as exc:
            if exc.args and getattr(exc.args[0], "code", lambda: None)() == 36:  # TOPIC_ALREADY_EXISTS
                continue
            raise ArgusError(f"cannot create topic {name}: {exc}") from exc
    return created
