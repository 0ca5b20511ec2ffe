"""librdkafka's log through :mod:`logging`, and one clear answer when the brokers cannot be reached.

librdkafka writes its own log lines to stderr unless a client is given a Python ``logger``: with the broker
down that is a ``Connect ... failed`` line every 50 ms to 1 s per client, hundreds before a command gives up.
:func:`librdkafka_logger` is the logger every confluent-kafka client of argus gets (through
:func:`argus.core.kafka_security.client_config`): the lines become records of the ``argus.librdkafka`` logger,
and a line that repeats is let through once a minute (:class:`RepeatFilter`), with how often it was held back.

:func:`require_kafka` is what a command that needs the brokers calls first: it asks them for metadata for at
most ``timeout_s`` (default 10 s), says once that they do not answer, and raises :class:`KafkaUnreachableError`
naming them and librdkafka's reason, instead of retrying in silence (or in hundreds of lines).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from typing import Any

from argus.core.errors import ArgusError
from argus.core.settings import KafkaSettings

__all__ = ["LIBRDKAFKA_LOGGER", "KafkaUnreachableError", "RepeatFilter", "librdkafka_logger", "require_kafka"]

#: Name of the logger librdkafka's lines go to.
LIBRDKAFKA_LOGGER = "argus.librdkafka"
#: Seconds a repeated librdkafka line is held back before it is let through again (with its count).
REPEAT_INTERVAL_S = 60.0
#: What varies between two otherwise equal lines: librdkafka's timings, e.g. "(after 0ms in state CONNECT)".
_VOLATILE = re.compile(r"\d+(\.\d+)?\s*ms\b|\d+ identical error\(s\) suppressed")


class KafkaUnreachableError(ArgusError):
    """No broker of ``bootstrap_servers`` answered within the time a command allows."""


class RepeatFilter(logging.Filter):
    """Lets a log line through once per ``interval_s``; the next one that passes says how many were held.

    Lines are compared without their timings (librdkafka puts ``after 0ms`` into its connect failures).
    Thread-safe: librdkafka's lines are served from whichever thread polls a client.
    """

    def __init__(self, interval_s: float = REPEAT_INTERVAL_S, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.interval_s = interval_s
        self._clock = clock
        self._seen: dict[str, tuple[float, int]] = {}
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        key = _VOLATILE.sub("#", record.getMessage())
        now = self._clock()
        with self._lock:
            last, held = self._seen.get(key, (None, 0))
            if last is not None and now - last < self.interval_s:
                self._seen[key] = (last, held + 1)
                return False
            if len(self._seen) > 1024:  # bounded: old keys go, a new one is shown
                self._seen.clear()
            self._seen[key] = (now, 0)
        if held:
            record.msg = f"{record.getMessage()} ({held} more like it in the last {self.interval_s:.0f} s)"
            record.args = None
        return True


_FILTER_LOCK = threading.Lock()


def librdkafka_logger() -> logging.Logger:
    """The ``argus.librdkafka`` logger, with one :class:`RepeatFilter` attached (on the first call)."""
    logger = logging.getLogger(LIBRDKAFKA_LOGGER)
    with _FILTER_LOCK:
        if not any(isinstance(f, RepeatFilter) for f in logger.filters):
            logger.addFilter(RepeatFilter())
    return logger


def require_kafka(kafka: KafkaSettings, timeout_s: float = 10.0,
                  notice: Callable[[str], None] | None = None) -> int:
    """Check that the brokers answer: metadata within ``timeout_s``; returns how many brokers the cluster has.

    ``notice`` is told once, as soon as librdkafka reports a broker down (connection refused, name not
    resolved, TLS or SASL refused), so a user waits knowing why.

    Raises:
        KafkaUnreachableError: no metadata within ``timeout_s``, with the brokers and librdkafka's last reason.
        ConfigError: from the client configuration.
    """
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    from argus.core.kafka_security import client_config

    reasons: list[str] = []

    def on_error(err: Any) -> None:
        reason = str(err.str())
        if not reasons and notice is not None:
            notice(f"Kafka at {kafka.bootstrap_servers} does not answer ({reason}); giving up after "
                   f"{timeout_s:.0f} s")
        reasons.append(reason)

    admin = AdminClient(client_config(kafka, {"error_cb": on_error, "socket.connection.setup.timeout.ms":
                                              max(1000, int(timeout_s * 1000))}))
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            left = deadline - time.monotonic()
            try:
                meta = admin.list_topics(timeout=max(0.1, min(1.0, left)))
                return len(meta.brokers)
            except KafkaException as exc:
                last = str(exc.args[0].str() if exc.args else exc)
            admin.poll(0)  # serves error_cb: why the brokers did not answer
            if time.monotonic() >= deadline:
                why = reasons[-1] if reasons else last
                raise KafkaUnreachableError(
                    f"cannot reach Kafka at {kafka.bootstrap_servers} within {timeout_s:.0f} s: {why} (check "
                    "ARGUS_BOOTSTRAP_SERVERS and that the brokers run; `argus up` starts a local one)")
    finally:
        del admin
