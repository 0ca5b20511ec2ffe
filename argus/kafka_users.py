"""The Kafka users of a secure local stack (``argus up --secure``, ``ARGUS_KAFKA_SECURE=1``): one SASL/SCRAM user
per role, its password generated once and kept in a file of its own.

Roles (:class:`Role`): ``admin`` (the broker's own principal and a super user: it formats the storage, creates
topics, users and ACLs, and answers ``argus status``), ``rank`` (training processes and ``argus stacks``),
``worker`` (the stream worker), ``sink`` (the ClickHouse sink) and ``reader`` (findings readers, and the query
service, which touches no topic). What each may do is the table of :mod:`argus.kafka_acls`.

Details and reasoning: docs/internals/application.md (the threat model: docs/security.md).
"""

from __future__ import annotations

import enum
import logging
import os
import secrets
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from argus.core.errors import ArgusError, ConfigError
from argus.core.kafka_security import client_config
from argus.core.settings import Secret, Settings

__all__ = ["MECHANISM", "PROTOCOL", "Role", "admin_settings", "ensure_passwords", "password_path", "role_env",
           "role_settings", "secrets_dir", "upsert_users", "uses_home_users"]

log = logging.getLogger(__name__)

#: SASL mechanism of the secure local broker (its users live in the cluster metadata, salted and hashed).
MECHANISM = "SCRAM-SHA-512"
#: Security protocol of the secure local broker (loopback only; TLS is for a broker of your own).
PROTOCOL = "SASL_PLAINTEXT"
_SCRAM_ITERATIONS = 8192


class Role(enum.Enum):
    """A principal of argus; its value is the SASL user name (``User:<value>`` in ACLs)."""

    ADMIN = "admin"
    RANK = "rank"
    WORKER = "worker"
    SINK = "sink"
    READER = "reader"


def secrets_dir(settings: Settings) -> Path:
    """``<home>/secrets``: where the secure stack's Kafka passwords are kept (0700)."""
    return (settings.home / "secrets").resolve()


def password_path(settings: Settings, role: Role) -> Path:
    """The password file of ``role``: ``<home>/secrets/kafka-<role>.password`` (0600)."""
    return secrets_dir(settings) / f"kafka-{role.value}.password"


def ensure_passwords(settings: Settings, roles: Iterable[Role] = tuple(Role)) -> dict[Role, Path]:
    """Generate the password of each role that has none yet (existing ones are kept); their files.

    The home and ``<home>/secrets`` are made 0700, each file 0600 whatever the umask.

    Raises:
        ConfigError: a file cannot be written.
    """
    out: dict[Role, Path] = {}
    directory = secrets_dir(settings)
    try:
        directory.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        directory.mkdir(mode=0o700, exist_ok=True)
        for path in (directory.parent, directory):
            if path.stat().st_uid == os.getuid():
                path.chmod(0o700)
        for role in roles:
            path = password_path(settings, role)
            if not path.exists():
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as fh:
                    fh.write(secrets.token_hex(24) + "\n")
                log.info("generated the Kafka password of user %s in %s", role.value, path)
            path.chmod(0o600)
            out[role] = path
    except OSError as exc:
        raise ConfigError(f"cannot write the Kafka passwords in {directory}: {exc}") from exc
    return out


def _password(settings: Settings, role: Role) -> Secret:
    path = password_path(settings, role)
    try:
        value = path.read_text().strip()
    except OSError as exc:
        raise ConfigError(f"no Kafka password of user {role.value} in {path} ({exc.strerror}): start the secure "
                          "stack first (argus up --secure), or unset ARGUS_KAFKA_SECURE") from exc
    if not value:
        raise ConfigError(f"the Kafka password file {path} is empty")
    return Secret(value)


def uses_home_users(settings: Settings) -> bool:
    """Whether ``settings`` reach a secure local stack with the home's users: ``kafka_secure`` set and no SASL
    credentials of their own (credentials given explicitly, such as a child process's role, win)."""
    return settings.kafka_secure and settings.kafka_security_protocol == "PLAINTEXT"


def role_settings(settings: Settings, role: Role) -> Settings:
    """``settings`` as ``role``'s user of the home's secure stack; unchanged unless :func:`uses_home_users`.

    Raises:
        ConfigError: the role's password file is missing or empty.
    """
    if not uses_home_users(settings):
        return settings
    return settings.replace(kafka_security_protocol=PROTOCOL, kafka_sasl_mechanism=MECHANISM,
                            kafka_sasl_username=role.value, kafka_sasl_password=_password(settings, role))


def admin_settings(settings: Settings) -> Settings:
    """``settings`` as the admin of the home's secure stack (the local broker's own principal), whatever
    credentials they carry; the admin's password is generated if the home has none yet.

    Raises:
        ConfigError: the password file cannot be written or read.
    """
    ensure_passwords(settings, (Role.ADMIN,))
    return settings.replace(kafka_security_protocol=PROTOCOL, kafka_sasl_mechanism=MECHANISM,
                            kafka_sasl_username=Role.ADMIN.value, kafka_sasl_password=_password(settings, Role.ADMIN))


def role_env(settings: Settings, role: Role) -> dict[str, str]:
    """The ``ARGUS_KAFKA_*`` variables that make a child process ``role``'s user (the password as a file); empty
    unless :func:`uses_home_users`."""
    if not uses_home_users(settings):
        return {}
    return {"ARGUS_KAFKA_SECURITY_PROTOCOL": PROTOCOL, "ARGUS_KAFKA_SASL_MECHANISM": MECHANISM,
            "ARGUS_KAFKA_SASL_USERNAME": role.value,
            "ARGUS_KAFKA_SASL_PASSWORD_FILE": str(password_path(settings, role))}


def upsert_users(admin: Settings, home: Settings, roles: Iterable[Role], timeout_s: float = 30.0) -> list[str]:
    """Create each role's SCRAM user on the broker of ``admin`` (the admin's settings) with its password from
    ``home``'s files, or set that password again (idempotent); the user names, in the order of ``roles``.

    Raises:
        ArgusError: the broker refused (e.g. ``admin`` is not a super user) or did not answer.
    """
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import (
        AdminClient,
        ScramCredentialInfo,
        ScramMechanism,
        UserScramCredentialUpsertion,
    )

    client = AdminClient(client_config(admin.kafka))
    info = ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, _SCRAM_ITERATIONS)
    upserts: list[Any] = [UserScramCredentialUpsertion(r.value, info, _password(home, r).reveal().encode())
                          for r in roles]
    for user, fut in client.alter_user_scram_credentials(upserts, request_timeout=timeout_s).items():
        try:
            fut.result()
        except KafkaException as exc:
            raise ArgusError(f"Kafka on {admin.bootstrap_servers} refused to set the SCRAM user {user}: "
                             f"{exc.args[0].str() if exc.args else exc}") from exc
    return [u.user for u in upserts]
