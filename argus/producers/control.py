"""Control without a restart: a rank reads ``argus control``'s commands off the training thread and applies them.

Every command to a job lies in one partition of the compacted control topic (:func:`argus.topics.control_partition`);
a :class:`ControlThread` reads that partition from its start, by assignment (no consumer group rebalances, no
offsets committed: a restarted rank reads the commands again and ends in the same state), keeps the job's
commands and hands each to :meth:`RankControl.apply` in offset order. The thread is bounded: librdkafka's
queue is capped (``queued.max.messages.kbytes``), at most ``max_per_poll`` messages are taken per poll, and
an unreadable message is counted and skipped. Training never waits on it; a broker that cannot be reached only
means commands arrive later.

:class:`RankControl` turns commands into effects through the :class:`ControlTarget` it is given (the tracer):
kernel records paused for :attr:`PauseReason.CONTROL` or :attr:`PauseReason.SAMPLING`, runtime settings
changed, and the command acknowledged (its id, and why it was refused) in the rank's next heartbeat.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Protocol

from argus.core.errors import SchemaError
from argus.core.kafka_security import client_config
from argus.core.settings import Settings
from argus.schemas.control import ControlAction, ControlCommand, runtime_value
from argus.schemas.records import PauseReason
from argus.topics import Topic, control_partition

__all__ = ["ControlTarget", "ControlThread", "RankControl", "sampled_ranks"]

log = logging.getLogger(__name__)


class ControlTarget(Protocol):
    """What a :class:`RankControl` acts on (the tracer implements it)."""

    def pause_kernels(self, reason: PauseReason) -> None: ...

    def resume_kernels(self, reason: PauseReason) -> None: ...

    def set_runtime(self, key: str, value: float | int) -> None: ...

    def acknowledge(self, command_id: str, error: str) -> None: ...


def sampled_ranks(count: int, world_size: int) -> frozenset[int]:
    """The ``count`` of ``world_size`` ranks (positions) that trace kernels under ``sample-ranks count``, spread
    evenly (the first always among them); every one when ``count`` is 0 or at least ``world_size``."""
    if count <= 0 or count >= world_size:
        return frozenset(range(world_size))
    return frozenset(i * world_size // count for i in range(count))


class RankControl:
    """Applies the commands of one job to one rank, in the order they were written.

    Args:
        rank, world_size: this rank and the job's size (for ``sample-ranks``).
        target: what the commands act on.
    """

    def __init__(self, rank: int, world_size: int, target: ControlTarget) -> None:
        self.rank, self.world_size, self.target = rank, world_size, target
        self.applied = self.refused = 0
        self._seen: set[str] = set()

    def apply(self, cmd: ControlCommand) -> bool:
        """Apply ``cmd`` if it names this rank (and was not applied before); False when it does not concern this
        rank. A command it cannot apply is refused: acknowledged with the reason, and counted."""
        if not cmd.applies_to(self.rank):
            return False
        if cmd.command_id in self._seen:
            return True
        self._seen.add(cmd.command_id)
        error = ""
        try:
            self._effect(cmd)
            self.applied += 1
            log.info("rank %d: control %s %s applied", self.rank, cmd.command_id, cmd.action.value)
        except (SchemaError, ValueError) as exc:
            error = str(exc)
            self.refused += 1
            log.warning("rank %d: control %s refused: %s", self.rank, cmd.command_id, error)
        self.target.acknowledge(cmd.command_id, error)
        return True

    def _effect(self, cmd: ControlCommand) -> None:
        t = self.target
        if cmd.action is ControlAction.PAUSE_KERNELS:
            t.pause_kernels(PauseReason.CONTROL)
        elif cmd.action is ControlAction.RESUME_KERNELS:
            t.resume_kernels(PauseReason.CONTROL)
        elif cmd.action is ControlAction.SAMPLE_RANKS:
            # With --ranks the sample is taken among those ranks; the others are left as they are.
            pool = sorted(set(cmd.ranks)) if cmd.ranks else list(range(self.world_size))
            if pool[:1] and self.rank in {pool[i] for i in sampled_ranks(cmd.count, len(pool))}:
                t.resume_kernels(PauseReason.SAMPLING)
            else:
                t.pause_kernels(PauseReason.SAMPLING)
        else:
            t.set_runtime(cmd.key, runtime_value(cmd.key, cmd.value))


class ControlThread:
    """Reads the job's commands from the control topic on a daemon thread and applies them (module docstring).

    Args:
        settings: Kafka settings, topic prefix, ``control_poll_s`` (seconds a poll waits).
        job_id: the job whose commands are read.
        control: where commands go.
        max_per_poll: most messages taken from librdkafka per poll.
    """

    def __init__(self, settings: Settings, job_id: str, control: RankControl, *, max_per_poll: int = 100) -> None:
        self.settings, self.job_id, self.control = settings, job_id, control
        self.max_per_poll = max_per_poll
        self.read = self.undecodable = self.errors = 0
        self._prefix = f"{job_id}/".encode()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"argus-control-{self.control.rank}",
                                            daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def handle(self, key: bytes | None, payload: bytes | None) -> None:
        """One message of the partition: applied when it is a command of this job (the thread's work; also
        usable from tests). A tombstone (no payload) or another job's command is skipped."""
        if not key or not key.startswith(self._prefix) or not payload:
            return
        self.read += 1
        try:
            cmd = ControlCommand.decode(payload)
        except SchemaError as exc:
            self.undecodable += 1
            if self.undecodable <= 10:
                log.warning("rank %d: unreadable control command skipped: %s", self.control.rank, exc)
            return
        if cmd.job_id == self.job_id:
            self.control.apply(cmd)

    def _consumer(self) -> Any:
        from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

        s = self.settings
        consumer = Consumer(client_config(s.kafka, {
            # A group id is required by librdkafka; nothing is committed and no group is joined (assign).
            "group.id": f"{s.app_id}-control-{self.job_id}-{self.control.rank}",
            "enable.auto.commit": False, "enable.auto.offset.store": False,
            "queued.max.messages.kbytes": 1024, "fetch.max.bytes": 1 << 20,
            # Long polls: the broker answers as soon as a command arrives, else after 5 s, so that ten thousand
            # idle ranks cost it 2,000 fetches a second, not the 20,000 of librdkafka's default 500 ms.
            "fetch.wait.max.ms": 5000,
        }))
        topic = Topic.CONTROL.full(s)
        partitions = s.partitions
        try:
            meta = consumer.list_topics(topic, timeout=max(1.0, s.control_poll_s))
            found = meta.topics.get(topic)
            if found is not None and found.error is None and found.partitions:
                partitions = len(found.partitions)
        except Exception as exc:  # the broker is away: the topic was created with settings.partitions
            log.debug("control topic metadata unavailable: %s", exc)
        consumer.assign([TopicPartition(topic, control_partition(self.job_id, partitions), OFFSET_BEGINNING)])
        return consumer

    def _run(self) -> None:
        try:
            consumer = self._consumer()
        except Exception as exc:
            self.errors += 1
            log.warning("rank %d: control topic not read (%s: %s): argus control will not reach this rank",
                        self.control.rank, type(exc).__name__, exc)
            return
        try:
            while not self._stop.is_set():
                try:
                    msgs = consumer.consume(self.max_per_poll, self.settings.control_poll_s)
                except Exception as exc:
                    self.errors += 1
                    log.warning("rank %d: control poll failed: %s", self.control.rank, exc)
                    self._stop.wait(self.settings.control_poll_s)
                    continue
                for msg in msgs:
                    if msg.error():
                        if self.errors < 10:
                            log.info("rank %d: control topic: %s", self.control.rank, msg.error())
                        self.errors += 1
                        continue
                    try:
                        self.handle(msg.key(), msg.value())
                    except Exception as exc:  # never let the thread die on one command
                        self.errors += 1
                        log.warning("rank %d: control command failed: %s", self.control.rank, exc)
        finally:
            try:
                consumer.close()
            except Exception as exc:
                log.debug("control consumer close: %s", exc)
