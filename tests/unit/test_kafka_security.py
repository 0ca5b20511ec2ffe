"""Kafka TLS/SASL settings: validated at start-up, secret, and the same for every client."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest

from argus.core.errors import ConfigError
from argus.core.kafka_logs import librdkafka_logger
from argus.core.kafka_security import AuthWatch, client_config, faust_credentials, ssl_context
from argus.core.settings import Settings

SASL = {"ARGUS_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT", "ARGUS_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
        "ARGUS_KAFKA_SASL_USERNAME": "trainer", "ARGUS_KAFKA_SASL_PASSWORD": "hunter2"}


def test_defaults_are_plaintext_everywhere() -> None:
    s = Settings.load(env={})
    assert client_config(s.kafka) == {"bootstrap.servers": s.bootstrap_servers, "security.protocol": "plaintext",
                                      "logger": librdkafka_logger()}
    assert faust_credentials(s.kafka) is None and ssl_context(s.kafka) is None


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"ARGUS_KAFKA_SECURITY_PROTOCOL": "TLS"}, "kafka_security_protocol must be one of"),
        ({**SASL, "ARGUS_KAFKA_SASL_MECHANISM": ""}, "kafka_sasl_mechanism must be one of"),
        ({**SASL, "ARGUS_KAFKA_SASL_MECHANISM": "GSSAPI"}, "kafka_sasl_mechanism must be one of"),
        ({**SASL, "ARGUS_KAFKA_SASL_USERNAME": ""}, "kafka_sasl_username and kafka_sasl_password are required"),
        ({**SASL, "ARGUS_KAFKA_SASL_PASSWORD": ""}, "kafka_sasl_username and kafka_sasl_password are required"),
        ({"ARGUS_KAFKA_SASL_MECHANISM": "PLAIN"}, "need kafka_security_protocol SASL_PLAINTEXT or SASL_SSL"),
        ({"ARGUS_KAFKA_SASL_USERNAME": "u"}, "need kafka_security_protocol SASL_PLAINTEXT or SASL_SSL"),
        ({"ARGUS_KAFKA_SSL_CA_FILE": "/etc/hostname"}, "need kafka_security_protocol SSL or SASL_SSL"),
        ({"ARGUS_KAFKA_SECURITY_PROTOCOL": "SSL", "ARGUS_KAFKA_SSL_CA_FILE": "/no/such/ca.pem"}, "not a readable"),
        ({"ARGUS_KAFKA_SECURITY_PROTOCOL": "SSL", "ARGUS_KAFKA_SSL_CERT_FILE": "/etc/hostname"}, "go together"),
    ],
)
def test_invalid_security_fails_at_start(env: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Settings.load(env=env)


def test_sasl_reaches_confluent_and_faust_and_stays_secret(tmp_path: Path) -> None:
    pw = tmp_path / "kafka-password"
    pw.write_text("s3cret\n")
    env = {**SASL, "ARGUS_KAFKA_SASL_PASSWORD_FILE": str(pw)}
    del env["ARGUS_KAFKA_SASL_PASSWORD"]
    s = Settings.load(env=env)
    assert s.kafka_sasl_password.reveal() == "s3cret" and "s3cret" not in repr(s)
    conf = client_config(s.kafka, {"group.id": "g"})
    assert conf == {"bootstrap.servers": s.bootstrap_servers, "security.protocol": "sasl_plaintext",
                    "sasl.mechanism": "SCRAM-SHA-512", "sasl.username": "trainer", "sasl.password": "s3cret",
                    "group.id": "g", "logger": librdkafka_logger()}
    creds = faust_credentials(s.kafka)
    assert (creds.username, creds.password, creds.mechanism.value, creds.protocol.value) == (
        "trainer", "s3cret", "SCRAM-SHA-512", "SASL_PLAINTEXT")
    assert "s3cret" not in repr(creds)
    # Child processes (worker, sink) get the same settings through the environment.
    assert Settings.load(env=s.to_env()).kafka_sasl_password.reveal() == "s3cret"
    with pytest.raises(ConfigError, match="comes from the kafka_"):
        client_config(s.kafka, {"security.protocol": "plaintext"})


def test_tls_files_reach_both_client_kinds(tmp_path: Path) -> None:
    ca = Path(ssl.get_default_verify_paths().cafile or "")
    if not ca.is_file():
        pytest.skip("no system CA bundle file")
    s = Settings.load(env={}, kafka_security_protocol="SASL_SSL", kafka_sasl_mechanism="PLAIN",
                      kafka_sasl_username="u", kafka_sasl_password="p", kafka_ssl_ca_file=str(ca))
    conf = client_config(s.kafka)
    assert conf["security.protocol"] == "sasl_ssl" and conf["ssl.ca.location"] == str(ca)
    creds = faust_credentials(s.kafka)
    assert creds.protocol.value == "SASL_SSL" and isinstance(creds.ssl_context, ssl.SSLContext)
    assert creds.ssl_context.check_hostname and creds.ssl_context.verify_mode == ssl.CERT_REQUIRED
    tls = Settings.load(env={}, kafka_security_protocol="SSL", kafka_ssl_ca_file=str(ca))
    assert faust_credentials(tls.kafka).context is not None
    bogus = tmp_path / "ca.pem"
    bogus.write_text("not a certificate")
    with pytest.raises(ConfigError, match="cannot load the Kafka TLS files"):
        ssl_context(tls.replace(kafka_ssl_ca_file=str(bogus)).kafka)


def test_auth_watch_explains_a_refusal() -> None:
    from confluent_kafka import KafkaError

    s = Settings.load(env=SASL)
    watch = AuthWatch(s.kafka)
    watch(KafkaError(KafkaError._TRANSPORT, "connection refused"))
    assert watch.explain() == ""
    watch(KafkaError(KafkaError._AUTHENTICATION, "SASL authentication error: Authentication failed"))
    assert "refused SASL user 'trainer' (SCRAM-SHA-512)" in watch.explain()
    assert "hunter2" not in watch.explain()
