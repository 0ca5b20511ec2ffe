"""Who may write what: the Kafka ACLs of argus's principals, as a table, applied and described through the admin
client (``argus acls``; ``argus up --secure`` applies them to its own broker).

The broker must run an authorizer (KRaft: ``authorizer.class.name=
org.apache.kafka.metadata.authorizer.StandardAuthorizer``) with ``allow.everyone.if.no.acl.found=false``, so that
a principal may do only what an ALLOW binding grants, and a super user (``super.users``) that applies them.

Details and reasoning: docs/internals/application.md (the threat model: docs/security.md).
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from argus.core.errors import ArgusError, ConfigError
from argus.core.kafka_security import client_config
from argus.core.settings import Settings
from argus.kafka_users import Role, upsert_users
from argus.topics import Topic

__all__ = ["READS", "WRITES", "Acl", "Operation", "Pattern", "Resource", "acl_table", "apply_acls",
           "describe_acls", "group_grants", "secure_local_kafka"]

log = logging.getLogger(__name__)


class Resource(enum.Enum):
    TOPIC = "TOPIC"
    GROUP = "GROUP"


class Pattern(enum.Enum):
    #: The name exactly.
    LITERAL = "LITERAL"
    #: Every name that starts with it.
    PREFIXED = "PREFIXED"


class Operation(enum.Enum):
    READ = "READ"
    WRITE = "WRITE"
    DESCRIBE = "DESCRIBE"


@dataclass(frozen=True)
class Acl:
    """One ALLOW binding: ``User:<principal>`` may do ``operation`` on the ``resource`` named (or prefixed)
    ``name``, from any host."""

    principal: str
    resource: Resource
    name: str
    pattern: Pattern
    operation: Operation

    def key(self) -> tuple[str, ...]:
        """Its sort key: principal, resource, name, pattern, operation."""
        return self.principal, self.resource.value, self.name, self.pattern.value, self.operation.value

    def __str__(self) -> str:
        star = "*" if self.pattern is Pattern.PREFIXED else ""
        return f"User:{self.principal} {self.operation.value} {self.resource.value.lower()} {self.name}{star}"


_INPUTS = (Topic.KERNELS, Topic.STEPS, Topic.PHASES, Topic.TOPOLOGY, Topic.LIFECYCLE, Topic.HEARTBEATS)

#: The argus topics each role writes (WRITE and DESCRIBE on each).
WRITES: Mapping[Role, frozenset[Topic]] = {
    Role.RANK: frozenset({*_INPUTS, Topic.STACKS}),
    # kernels: the job-end marker appended to every kernel partition when a job ends or is abandoned.
    Role.WORKER: frozenset({Topic.KERNELS, Topic.SUMMARIES, Topic.FINDINGS, Topic.FINDINGS_JSON, Topic.LIFECYCLE,
                            Topic.DEAD_LETTER, Topic.CONTEXT}),
    Role.SINK: frozenset({Topic.DEAD_LETTER}),
    Role.READER: frozenset(),
}
#: The argus topics each role reads (READ and DESCRIBE on each).
READS: Mapping[Role, frozenset[Topic]] = {
    # findings: argus stacks (which ranks a finding names); control: argus control's commands to running ranks.
    Role.RANK: frozenset({Topic.FINDINGS, Topic.CONTROL}),
    Role.WORKER: frozenset({*_INPUTS, Topic.SUMMARIES, Topic.CONTEXT}),
    # The topics the sink stores (argus.sinks.tables.TABLE_OF_TOPIC; a unit test keeps them equal).
    Role.SINK: frozenset({Topic.STEPS, Topic.PHASES, Topic.SUMMARIES, Topic.TOPOLOGY, Topic.LIFECYCLE,
                          Topic.FINDINGS, Topic.DEAD_LETTER, Topic.STACKS, Topic.HEARTBEATS}),
    Role.READER: frozenset({Topic.FINDINGS, Topic.FINDINGS_JSON}),
}


def group_grants(settings: Settings) -> dict[Role, tuple[tuple[str, Pattern], ...]]:
    """The consumer groups each role may use (READ), as (name, pattern)."""
    app = settings.app_id
    return {
        # argus stacks: <app_id>-stacks-<host>; the control thread: <app_id>-control-<job>-<rank> (assigned, never
        # joined: librdkafka needs a group id, and the broker checks READ on it when asked for offsets).
        Role.RANK: ((f"{app}-stacks-", Pattern.PREFIXED), (f"{app}-control-", Pattern.PREFIXED)),
        Role.WORKER: ((app, Pattern.LITERAL), (f"{app}-scan", Pattern.LITERAL),
                      (f"{app}-context-", Pattern.PREFIXED)),
        Role.SINK: ((settings.sink_group, Pattern.LITERAL),),
        Role.READER: ((f"{app}-follow-", Pattern.PREFIXED),),  # argus findings --follow
    }


def acl_table(settings: Settings, users: Mapping[Role, str] | None = None) -> list[Acl]:
    """Every ALLOW binding of argus's roles for ``settings`` (topic prefix, app id, sink group), sorted.

    ``users``: the SASL user of each role (default: the role's name, as ``argus up --secure`` and
    docker-compose name them). The admin gets none: it is a super user.
    """
    own = f"{settings.app_id}-"
    overlap = [t.full(settings) for t in Topic if t.full(settings).startswith(own)]
    if overlap:
        # The worker's PREFIXED grant on its own topics would then cover these too.
        raise ConfigError(f"topic_prefix {settings.topic_prefix!r} makes argus topics ({', '.join(overlap)}) start "
                          f"with the stream worker's own prefix {own!r} (app_id): choose names that do not overlap")
    names = {r: (users or {}).get(r, r.value) for r in Role}
    out: set[Acl] = set()
    for role in Role:
        if role is Role.ADMIN:
            continue
        who = names[role]
        for topics, op in ((WRITES[role], Operation.WRITE), (READS[role], Operation.READ)):
            for t in topics:
                for o in (op, Operation.DESCRIBE):
                    out.add(Acl(who, Resource.TOPIC, t.full(settings), Pattern.LITERAL, o))
        for name, pattern in group_grants(settings)[role]:
            out.add(Acl(who, Resource.GROUP, name, pattern, Operation.READ))
    # The worker's own topics: Faust's leader topic, and the changelogs of any table it declares.
    for op in Operation:
        out.add(Acl(names[Role.WORKER], Resource.TOPIC, own, Pattern.PREFIXED, op))
    return sorted(out, key=Acl.key)


def _binding(acl: Acl) -> Any:
    from confluent_kafka.admin import AclBinding, AclOperation, AclPermissionType, ResourcePatternType, ResourceType

    return AclBinding(ResourceType[acl.resource.value], acl.name, ResourcePatternType[acl.pattern.value],
                      f"User:{acl.principal}", "*", AclOperation[acl.operation.value], AclPermissionType.ALLOW)


def _refusal(settings: Settings, what: str, exc: Exception) -> ArgusError:
    """An error that says why the broker refused to ``what`` (no authorizer, not a super user, unreachable)."""
    err: Any = exc.args[0] if exc.args else None
    name = err.name() if hasattr(err, "name") else ""
    who = (f"user {settings.kafka_sasl_username!r}" if settings.kafka_security_protocol.startswith("SASL_")
           else f"an unauthenticated {settings.kafka_security_protocol} client")
    if name == "SECURITY_DISABLED":
        why = ("the broker runs no authorizer (set authorizer.class.name=org.apache.kafka.metadata.authorizer."
               "StandardAuthorizer, or start the local one with argus up --secure)")
    elif name == "CLUSTER_AUTHORIZATION_FAILED":
        why = f"{who} may not manage ACLs (it needs ALTER/DESCRIBE on the cluster: run as a super user)"
    else:
        why = str(err.str() if hasattr(err, "str") else exc)
    return ArgusError(f"Kafka on {settings.bootstrap_servers} refused to {what}: {why}")


def describe_acls(settings: Settings, timeout_s: float = 30.0) -> list[Acl]:
    """Every ALLOW binding on topics and groups that the broker holds (any principal), as :class:`Acl`; others
    (DENY, other resources or operations) are left out.

    Raises:
        ArgusError: the broker refused (no authorizer, not allowed to describe ACLs) or did not answer.
    """
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import (
        AclBindingFilter,
        AclOperation,
        AclPermissionType,
        AdminClient,
        ResourcePatternType,
        ResourceType,
    )

    admin = AdminClient(client_config(settings.kafka))
    none: Any = None  # a filter's None matches any name, principal or host (the stubs say str)
    match_all = AclBindingFilter(ResourceType.ANY, none, ResourcePatternType.ANY, none, none, AclOperation.ANY,
                                 AclPermissionType.ANY)
    try:
        bindings = admin.describe_acls(match_all, request_timeout=timeout_s).result()
    except KafkaException as exc:
        raise _refusal(settings, "describe its ACLs", exc) from exc
    out = []
    for b in bindings:
        try:
            acl = Acl(b.principal.removeprefix("User:"), Resource(b.restype.name), b.name,
                      Pattern(b.resource_pattern_type.name), Operation(b.operation.name))
        except ValueError:
            continue
        if b.permission_type.name == "ALLOW" and b.host == "*" and b.principal.startswith("User:"):
            out.append(acl)
    return sorted(out, key=Acl.key)


def apply_acls(settings: Settings, users: Mapping[Role, str] | None = None, prune: bool = False,
               timeout_s: float = 30.0) -> tuple[list[Acl], list[Acl]]:
    """Make the broker hold every binding of :func:`acl_table` (idempotent: existing ones are left as they are).

    Returns ``(created, extra)``: the bindings this call created, and the ALLOW bindings of argus's users that
    the table does not have (a grant made by hand, or by an older table). With ``prune`` the extra ones are
    deleted (and returned all the same).

    Raises:
        ConfigError: the topic prefix overlaps the worker's own topics (see :func:`acl_table`).
        ArgusError: the broker refused (no authorizer; ``settings`` are not a super user's) or did not answer.
    """
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    wanted = acl_table(settings, users)
    held = set(describe_acls(settings, timeout_s))
    principals = {a.principal for a in wanted}
    missing = [a for a in wanted if a not in held]
    extra = sorted((a for a in held - set(wanted) if a.principal in principals), key=Acl.key)
    admin = AdminClient(client_config(settings.kafka))
    if missing:
        bindings = {_binding(a): a for a in missing}
        for binding, fut in admin.create_acls(list(bindings), request_timeout=timeout_s).items():
            try:
                fut.result()
            except KafkaException as exc:
                raise _refusal(settings, f"create the ACL {bindings[binding]}", exc) from exc
        log.info("created %d ACL bindings on %s", len(missing), settings.bootstrap_servers)
        _await_acls(settings, wanted, timeout_s)
    if prune and extra:
        _delete(admin, settings, extra, timeout_s)
    return missing, extra


def _await_acls(settings: Settings, wanted: list[Acl], timeout_s: float) -> None:
    """Wait until the broker answering ``settings`` holds every binding of ``wanted``: the controller commits
    created ACLs before the broker's authorizer has them, and a client refused meanwhile keeps its refusal.

    Raises:
        ArgusError: not all of them within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        lacking = set(wanted) - set(describe_acls(settings, timeout_s))
        if not lacking:
            return
        if time.monotonic() > deadline:
            raise ArgusError(f"Kafka on {settings.bootstrap_servers} does not show {len(lacking)} ACL bindings "
                             f"{timeout_s:.0f} s after creating them (e.g. {min(lacking, key=Acl.key)})")
        time.sleep(0.2)


def _delete(admin: Any, settings: Settings, acls: Iterable[Acl], timeout_s: float) -> None:
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AclBindingFilter, AclPermissionType

    filters = []
    for a in acls:
        b = _binding(a)
        filters.append(AclBindingFilter(b.restype, b.name, b.resource_pattern_type, b.principal, b.host,
                                        b.operation, AclPermissionType.ALLOW))
    for fut in admin.delete_acls(filters, request_timeout=timeout_s).values():
        try:
            fut.result()
        except KafkaException as exc:
            raise _refusal(settings, "delete ACLs", exc) from exc


def secure_local_kafka(admin: Settings, home: Settings) -> tuple[list[str], list[Acl], list[Acl]]:
    """What ``argus up --secure`` does on its broker once it answers: every role but the admin gets its SCRAM
    user with the password of ``home``'s file (:func:`argus.kafka_users.upsert_users`), and the broker's ACLs
    become the table's (:func:`apply_acls` with ``prune``). ``admin``: the admin's settings. Returns the users,
    the bindings created and those removed.

    Raises:
        ArgusError: as :func:`apply_acls` and :func:`~argus.kafka_users.upsert_users`.
    """
    users = upsert_users(admin, home, [r for r in Role if r is not Role.ADMIN])
    created, removed = apply_acls(admin, prune=True)
    return users, created, removed
