"""``argus control``: write a command for the ranks of a running job to the control topic.

The command goes to the partition every rank of the job reads (:func:`argus.topics.control_partition`), keyed
``<job>/<slot>/<ranks>`` so that compaction keeps what decides each slot (see docs/rank-control.md). The ranks
apply it within about ``Settings.control_poll_s`` and acknowledge its id in their heartbeats.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence

from argus.core.errors import ArgusError, SchemaError
from argus.core.kafka_security import client_config
from argus.core.settings import Settings
from argus.schemas.control import ControlAction, ControlCommand, runtime_value
from argus.topics import Topic, control_partition

__all__ = ["make_command", "send_command"]

log = logging.getLogger(__name__)


def make_command(job_id: str, action: ControlAction, *, ranks: Sequence[int] = (), count: int = 0,
                 setting: str = "") -> ControlCommand:
    """A checked command with a fresh id. ``setting``: ``KEY=VALUE`` for SET.

    Raises:
        SchemaError: a bad job id, rank, count or setting (unknown key, value out of range).
    """
    key = value = ""
    if action is ControlAction.SET:
        key, sep, value = setting.partition("=")
        if not sep:
            raise SchemaError(f"set needs KEY=VALUE, got {setting!r}")
        runtime_value(key, value)
    cmd = ControlCommand(job_id, uuid.uuid4().hex[:16], time.time_ns(), action, tuple(sorted(set(ranks))), count,
                         key, value)
    cmd.check()
    return cmd


def send_command(settings: Settings, cmd: ControlCommand, timeout_s: float = 30.0) -> int:
    """Write ``cmd`` to the control topic and wait for the broker's acknowledgement; the partition written.

    Raises:
        ArgusError: no control topic (run ``argus topics``), or the broker refused or did not answer.
    """
    from confluent_kafka import KafkaException, Producer

    topic = Topic.CONTROL.full(settings)
    producer = Producer(client_config(settings.kafka, {"acks": "all", "enable.idempotence": True}))
    try:
        meta = producer.list_topics(topic, timeout=timeout_s)
    except KafkaException as exc:
        raise ArgusError(f"cannot read the metadata of {topic}: {exc}") from exc
    found = meta.topics.get(topic)
    if found is None or found.error is not None or not found.partitions:
        why = found.error if found is not None and found.error is not None else "no such topic"
        raise ArgusError(f"control topic {topic} unusable ({why}): create it with argus topics")
    partition = control_partition(cmd.job_id, len(found.partitions))
    errors: list[str] = []

    def delivered(err: object, _msg: object) -> None:
        if err is not None:
            errors.append(str(err))

    producer.produce(topic, cmd.encode(), cmd.kafka_key(), partition=partition, on_delivery=delivered)
    left = producer.flush(timeout_s)
    if left or errors:
        raise ArgusError(f"control command not written to {topic}: "
                         f"{'; '.join(errors) or f'no acknowledgement within {timeout_s:.0f} s'}")
    log.info("control %s %s written to %s[%d]", cmd.command_id, cmd.action.value, topic, partition)
    return partition
