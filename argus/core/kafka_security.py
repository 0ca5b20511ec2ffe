"""Kafka client configuration from :class:`~argus.core.settings.KafkaSettings` (``settings.kafka``): brokers,
TLS and SASL, in one place.

Every Kafka client of argus is built from here, so a cluster that needs TLS or SASL is reached by all of
them alike: :func:`client_config` for confluent-kafka (the rank-side publisher, the sink's consumer and
dead-letter producer, the stack collector, topic creation, the local broker's health probe) and
:func:`faust_credentials` for the Faust/aiokafka stream worker.

Settings (``ARGUS_KAFKA_*``): ``kafka_security_protocol`` (``PLAINTEXT``, ``SSL``, ``SASL_PLAINTEXT``,
``SASL_SSL``), ``kafka_sasl_mechanism`` (``PLAIN``, ``SCRAM-SHA-256``, ``SCRAM-SHA-512``),
``kafka_sasl_username``, ``kafka_sasl_password`` (a :class:`~argus.core.settings.Secret`, also from
``ARGUS_KAFKA_SASL_PASSWORD_FILE``), ``kafka_ssl_ca_file`` and, for mutual TLS, ``kafka_ssl_cert_file`` and
``kafka_ssl_key_file``. They are validated by :meth:`Settings.validate`.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from argus.core.errors import ConfigError
from argus.core.kafka_logs import librdkafka_logger
from argus.core.settings import KafkaSettings

__all__ = ["DURABLE_PRODUCER", "AuthWatch", "aiokafka_durable_config", "client_config", "faust_credentials",
           "producer_config", "ssl_context"]

#: What every argus producer sets so that, on a replicated cluster, nothing acknowledged is lost and nothing
#: retried is doubled (librdkafka names): ``acks=all`` (a write counts once every in-sync replica has it, and
#: topics keep ``min.insync.replicas`` of them, see :attr:`Settings.min_insync_replicas`) and idempotence (the
#: broker drops a retried batch it already wrote, in order, across leader fail-over).
DURABLE_PRODUCER: Mapping[str, Any] = MappingProxyType({"acks": "all", "enable.idempotence": True})


def client_config(kafka: KafkaSettings, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A librdkafka (confluent-kafka) configuration: bootstrap servers and security, then ``extra``.

    ``extra`` holds the client's own options (group, acks, sizes); it cannot turn security off, since a
    security key in it raises :class:`ConfigError` rather than silently replacing the settings. librdkafka's
    own log goes to the ``argus.librdkafka`` logger (:func:`argus.core.kafka_logs.librdkafka_logger`).
    """
    conf: dict[str, Any] = {
        "bootstrap.servers": kafka.bootstrap_servers,
        "security.protocol": kafka.security_protocol.lower(),
        # librdkafka's own lines through logging (repeats held back), not straight to stderr.
        "logger": librdkafka_logger(),
    }
    if kafka.security_protocol.startswith("SASL_"):
        conf["sasl.mechanism"] = kafka.sasl_mechanism
        conf["sasl.username"] = kafka.sasl_username
        conf["sasl.password"] = kafka.sasl_password.reveal()
    if kafka.security_protocol.endswith("SSL"):
        for key, value in (("ssl.ca.location", kafka.ssl_ca_file),
                           ("ssl.certificate.location", kafka.ssl_cert_file),
                           ("ssl.key.location", kafka.ssl_key_file)):
            if value:
                conf[key] = value
    for key in extra or {}:
        if key.startswith(("security.", "sasl.", "ssl.")):
            raise ConfigError(f"Kafka option {key!r} comes from the kafka_* settings, not from a client")
    conf.update(extra or {})
    return conf


def producer_config(kafka: KafkaSettings, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The configuration of an argus confluent-kafka producer: :func:`client_config` with ``extra`` (the
    producer's own sizes, linger, partitioner) and :data:`DURABLE_PRODUCER`.

    Raises:
        ConfigError: ``extra`` sets a security option, or weakens ``acks``/``enable.idempotence``.
    """
    for key, value in (extra or {}).items():
        if key in DURABLE_PRODUCER and value != DURABLE_PRODUCER[key]:
            raise ConfigError(f"Kafka producer option {key}={value!r}: argus producers run with "
                              f"{key}={DURABLE_PRODUCER[key]!r} (nothing lost, nothing doubled)")
    return client_config(kafka, {**(extra or {}), **DURABLE_PRODUCER})


def aiokafka_durable_config() -> dict[str, Any]:
    """:data:`DURABLE_PRODUCER` in aiokafka's ``AIOKafkaProducer`` keyword names (``enable_idempotence``)."""
    return {key.replace(".", "_"): value for key, value in DURABLE_PRODUCER.items()}


class AuthWatch:
    """An ``error_cb`` for a confluent-kafka client that remembers the broker's refusal of the credentials,
    so that a failed call can say so instead of librdkafka's "broker transport failure".

    librdkafka reports errors through callbacks served by ``poll``: call the client's ``poll(0)`` before
    reading :attr:`refused`.
    """

    def __init__(self, kafka: KafkaSettings) -> None:
        self.kafka = kafka
        #: librdkafka's text of the last authentication failure, or None.
        self.refused: str | None = None

    def __call__(self, err: Any) -> None:
        from confluent_kafka import KafkaError

        if err.code() == KafkaError._AUTHENTICATION:
            self.refused = str(err.str())

    def explain(self) -> str:
        """What the broker refused, for an error message ("" when it refused nothing)."""
        if self.refused is None:
            return ""
        s = self.kafka
        who = (f"SASL user {s.sasl_username!r} ({s.sasl_mechanism})"
               if s.security_protocol.startswith("SASL_") else f"the {s.security_protocol} connection")
        return (f"Kafka on {s.bootstrap_servers} refused {who}: {self.refused}; check the ARGUS_KAFKA_* "
                "settings")


def ssl_context(kafka: KafkaSettings) -> ssl.SSLContext | None:
    """The TLS context of the ``SSL``/``SASL_SSL`` protocols (server verified against ``kafka_ssl_ca_file``
    or the system CAs, host name checked, client certificate loaded for mutual TLS); ``None`` without TLS.

    Raises:
        ConfigError: a CA, certificate or key file cannot be loaded.
    """
    if not kafka.security_protocol.endswith("SSL"):
        return None
    try:
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=kafka.ssl_ca_file or None)
        if kafka.ssl_cert_file:
            context.load_cert_chain(kafka.ssl_cert_file, kafka.ssl_key_file or None)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load the Kafka TLS files: {exc}") from exc
    return context


def faust_credentials(kafka: KafkaSettings) -> Any:
    """Faust's ``broker_credentials`` for ``kafka``: ``SASLCredentials`` (with the TLS context under
    ``SASL_SSL``), ``SSLCredentials``, or ``None`` for ``PLAINTEXT``.

    Faust is imported here, not at module level, so rank-side processes never load it.

    Raises:
        ConfigError: as :func:`ssl_context`.
    """
    import faust

    protocol = kafka.security_protocol
    context = ssl_context(kafka)
    if protocol.startswith("SASL_"):
        return faust.SASLCredentials(username=kafka.sasl_username,
                                     password=kafka.sasl_password.reveal(),
                                     mechanism=kafka.sasl_mechanism, ssl_context=context)
    if context is not None:
        return faust.SSLCredentials(context)
    return None
