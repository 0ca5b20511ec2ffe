"""The exception hierarchy: one root, one subclass per pipeline stage.

Third-party errors are wrapped at the boundary with ``raise ... from`` so callers can catch
:class:`ArgusError` (or a stage's subclass) without importing Kafka or ClickHouse modules.
"""

from __future__ import annotations

__all__ = [
    "ArgusError",
    "ConfigError",
    "DeadLetterError",
    "DetectorError",
    "KafkaLocalError",
    "ProducerError",
    "RejectedRecordError",
    "SchemaError",
    "SinkError",
    "StreamError",
    "TraceExportError",
    "failure_reason",
]


class ArgusError(Exception):
    """Root of every error argus raises on purpose."""


class ConfigError(ArgusError):
    """A setting is missing or invalid (raised at start-up, never mid-run)."""


class SchemaError(ArgusError):
    """A record does not match its Avro schema, or a payload cannot be decoded."""


class ProducerError(ArgusError):
    """The rank-side publisher could not be created or configured."""


class StreamError(ArgusError):
    """A stream-processing agent failed outside of a single bad record."""


class RejectedRecordError(StreamError):
    """One record decoded but cannot be processed by a stream stage (e.g. a rank outside its job's topology);
    the agent dead-letters it and goes on."""


class DeadLetterError(StreamError):
    """A dead letter could not be delivered: the agent stops without acking the message, so the commit never
    passes it and it is read again after a restart."""


class SinkError(ArgusError):
    """ClickHouse (embedded chDB or a server) refused a connection, query or insert."""


class DetectorError(ArgusError):
    """A detector was given inputs it cannot work with (shape, units, empty groups)."""


class KafkaLocalError(ArgusError):
    """The project-managed local Apache Kafka could not be fetched, formatted or started."""


class TraceExportError(ArgusError):
    """``argus export-trace`` was asked for data the store does not hold (no such job, ranks or steps, an empty
    step range) or could not write its output."""


def failure_reason(exc: BaseException) -> str:
    """A dead letter's reason for ``exc``: schema errors as they read, anything else after its class name."""
    return str(exc) if isinstance(exc, SchemaError) else f"{type(exc).__name__}: {exc}"
