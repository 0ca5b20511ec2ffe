"""The diagnosis agents' dead letters: a rejected record, with why, on the dead-letter topic (delivery awaited).

A dead letter that cannot be delivered raises :class:`~argus.core.errors.DeadLetterError`: the caller must not
ack the record, so the committed offset never passes it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from faust.types import EventT

from argus.core.errors import DeadLetterError, failure_reason
from argus.schemas.records import DeadLetter

__all__ = ["DeadLetters"]

log = logging.getLogger(__name__)

#: Largest payload kept in a dead letter (bytes): with the record around it, it must stay under the
#: producer's 8 MB request size. A longer one is cut; the original stays on its topic for the retention.
_MAX_DEAD_PAYLOAD = 7_000_000


class DeadLetters:
    """Writes the agents' dead letters to the dead-letter topic and waits for each delivery.

    Args:
        topic: the Faust dead-letter topic.
        retries: delivery attempts (0.5 s, 1 s, ... apart) before :class:`DeadLetterError` is raised.
    """

    def __init__(self, topic: Any, retries: int = 3) -> None:
        self.topic, self.retries = topic, retries
        self.sent = 0

    async def send(self, event: EventT, stage: str, reason: str, payload: bytes | None = None, job: str = "",
                   rank: int | None = None) -> None:
        """Dead-letter ``event`` (or ``payload``, e.g. the part of it that was rejected) with ``reason``.

        Raises:
            DeadLetterError: the broker did not take it; the caller must not ack ``event``.
        """
        msg = event.message
        log.warning("dead-letter stage=%s job=%s rank=%s %s[%d]@%d: %s", stage, job or "?",
                    "?" if rank is None else rank, msg.topic, msg.partition, msg.offset, reason)
        body = bytes(event.value) if payload is None else payload
        if len(body) > _MAX_DEAD_PAYLOAD:
            reason += (f" (payload cut from {len(body)} to {_MAX_DEAD_PAYLOAD} bytes; the message stays on "
                       f"{msg.topic} for its retention)")
            body = body[:_MAX_DEAD_PAYLOAD]
        value = DeadLetter(topic=msg.topic, partition=msg.partition, offset=msg.offset, payload=body,
                           reason=reason, stage=stage, time_ns=time.time_ns(), key=msg.key).encode()
        for attempt in range(self.retries + 1):
            try:
                fut = await self.topic.send(key=msg.key, value=value, force=True)
                await fut
            except Exception as exc:
                if attempt == self.retries:
                    raise DeadLetterError(f"dead letter of {msg.topic}[{msg.partition}]@{msg.offset} not "
                                          f"delivered: {failure_reason(exc)}") from exc
                await asyncio.sleep(0.5 * 2**attempt)
            else:
                self.sent += 1
                return
