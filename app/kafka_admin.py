"""Kafka as the platform administers it: topics made from the plan, SCRAM principals
and their ACLs. Used by the hosts (`dsec up`, `dsec control prepare`) and by
`dsec tenant` / `dsec node`, as the stack's administrator principal.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

from kafka import KafkaAdminClient
from kafka.admin import (
    ACL,
    ACLFilter,
    ACLOperation,
    ACLPermissionType,
    ACLResourcePatternType,
    ConfigResource,
    ConfigResourceType,
    NewTopic,
    ResourcePattern,
    ResourcePatternFilter,
    ResourceType,
)
from kafka.admin._users import (
    ScramMechanism,
    UserScramCredentialDeletion,
    UserScramCredentialUpsertion,
)
from kafka.errors import KafkaError, TopicAlreadyExistsError, TopicAuthorizationFailedError

from app.bus import KafkaLogin, client_options
from app.config import Settings
from app.domain.kafka_access import Grant, Operation, Resource
from app.domain.topics import TopicRole, TopicRules, TopicSpec, differences, plan
from app.errors import AccessDenied, ServiceUnavailable

log = logging.getLogger(__name__)

#: Room for a record's headers and batch framing above its value.
_RECORD_OVERHEAD = 64 * 1024


def admin_client(settings: Settings, login: KafkaLogin | None = None) -> KafkaAdminClient:
    """An admin client (as the local administrator unless ``login`` says otherwise)."""
    try:
        options = client_options(settings, login)
        options.pop("allow_auto_create_topics")  # not an admin client's setting
        return KafkaAdminClient(**options, request_timeout_ms=10_000)
    except KafkaError as exc:
        raise ServiceUnavailable(f"Kafka at {settings.kafka_bootstrap}: {exc}") from exc


def topic_rules(settings: Settings) -> TopicRules:
    """The topic plan's rules, from settings."""
    hour = 3_600_000
    log_ms = settings.log_retention_hours * hour
    largest = settings.max_message_bytes + _RECORD_OVERHEAD
    return TopicRules(
        prefix=settings.topic_prefix,
        partitions=settings.topic_partitions,
        reply_partitions=settings.reply_partitions,
        replication=settings.kafka_replication_factor,
        min_insync_replicas=settings.kafka_min_insync_replicas,
        retention_ms={
            TopicRole.REQUESTS: log_ms,
            TopicRole.EVENTS: log_ms,
            TopicRole.INBOX: log_ms,
            TopicRole.REPLIES: settings.replies_retention_hours * hour,
            TopicRole.DEAD_LETTERS: settings.dead_letters_retention_hours * hour,
            TopicRole.PROBE: hour,
        },
        # Replies too: larger outputs and files travel as pieces (ReplyPiece).
        max_message_bytes=dict.fromkeys(TopicRole, largest),
    )


def ensure_topics(
    settings: Settings,
    tenants: Iterable[str] = (),
    nodes: Iterable[str] = (),
    *,
    platform: bool = True,
    check: bool = True,
) -> list[str]:
    """Make the topics of the plan (:mod:`app.domain.topics`) that are missing: the
    platform's (unless ``platform`` is false), each tenant's replies topic and each
    node's inbox. With ``check`` (the administrator's: it reads topic settings),
    those that exist are checked against it; returns how they fall short, each also
    logged."""
    specs = plan(topic_rules(settings), tenants, nodes, platform=platform)
    admin = admin_client(settings)
    try:
        existing = set(admin.list_topics())
        missing = [
            NewTopic(spec.name, spec.partitions, spec.replication, topic_configs=dict(spec.configs))
            for spec in specs.values()
            if spec.name not in existing
        ]
        for new in missing:
            try:
                admin.create_topics([new])
            except TopicAlreadyExistsError:  # a concurrent `up`
                continue
        # Made is not yet usable: each partition needs its leader, and the brokers'
        # metadata the new topic (whoever is told next may send to it at once).
        if missing:
            admin.wait_for_topics([new.name for new in missing], timeout_ms=30_000)
        found = (
            _check(admin, [spec for spec in specs.values() if spec.name in existing])
            if check
            else []
        )
    except TopicAuthorizationFailedError as exc:
        raise AccessDenied(f"Kafka at {settings.kafka_bootstrap}: {exc}") from exc
    except KafkaError as exc:
        raise ServiceUnavailable(f"Kafka at {settings.kafka_bootstrap}: {exc}") from exc
    finally:
        admin.close()
    for finding in found:
        log.warning("topic made beforehand differs from the plan: %s", finding)
    return found


def drop_topics(settings: Settings, names: Iterable[str] | None = None) -> None:
    """Delete ``names``, or every topic of the settings' prefix (a benchmark's or a
    test's own)."""
    admin = admin_client(settings)
    try:
        listed = admin.list_topics()
        if names is None:
            mine = [t for t in listed if t.startswith(f"{settings.topic_prefix}.")]
        else:
            mine = sorted(set(listed) & set(names))
        if mine:
            admin.delete_topics(mine)
    except KafkaError as exc:
        raise ServiceUnavailable(f"Kafka at {settings.kafka_bootstrap}: {exc}") from exc
    finally:
        admin.close()


def _check(admin: KafkaAdminClient, specs: Sequence[TopicSpec]) -> list[str]:
    """How the pre-made topics of ``specs`` fall short of them."""
    if not specs:
        return []
    described = {t["name"]: t for t in admin.describe_topics([s.name for s in specs])}
    resources = [ConfigResource(ConfigResourceType.TOPIC, s.name) for s in specs]
    configs = _topic_configs(admin.describe_configs(resources))
    found: list[str] = []
    for spec in specs:
        parts = described.get(spec.name, {}).get("partitions", [])
        replication = min((len(p.get("replica_nodes", [])) for p in parts), default=0)
        found += differences(spec, len(parts), replication, configs.get(spec.name, {}))
    return found


def _topic_configs(answer: dict[str, Any]) -> dict[str, dict[str, str]]:
    """Topic settings by topic from kafka-python's DescribeConfigs answer,
    ``{"topic": {name: {key: {"value": ...}}}}`` (only those set on the topic)."""
    return {
        name: {
            key: str(data.get("value") if isinstance(data, dict) else data)
            for key, data in (entries or {}).items()
        }
        for name, entries in (answer or {}).get("topic", {}).items()
    }


# -- principals -------------------------------------------------------------------

_MECHANISM = ScramMechanism.SCRAM_SHA_512


def set_principals(
    settings: Settings,
    logins: Iterable[tuple[str, str]],
    *,
    client: KafkaAdminClient | None = None,
) -> None:
    """Make (or set the password of) each ``(name, password)`` SCRAM principal (through
    ``client`` if given: the brokers' own, before the administrator exists)."""
    upserts = [
        UserScramCredentialUpsertion(name, _MECHANISM, password) for name, password in logins
    ]
    if not upserts:
        return
    admin = client or admin_client(settings)
    try:
        failed = {u: e for u, e in admin.alter_user_scram_credentials(upserts).items() if e}
    except KafkaError as exc:
        raise ServiceUnavailable(f"Kafka: setting principals: {exc}") from exc
    finally:
        if client is None:
            admin.close()
    if failed:
        raise ServiceUnavailable(f"Kafka refused principals: {failed}")


def principals(settings: Settings) -> set[str]:
    """Every SCRAM principal the broker knows."""
    admin = admin_client(settings)
    try:
        return set(admin.describe_user_scram_credentials())
    except KafkaError as exc:
        raise ServiceUnavailable(f"Kafka: listing principals: {exc}") from exc
    finally:
        admin.close()


def remove_principals(settings: Settings, names: Iterable[str]) -> None:
    """Remove SCRAM principals and every ACL they hold: an open connection of theirs
    is refused at its next request, a new one at its handshake."""
    names = sorted(set(names))
    if not names:
        return
    admin = admin_client(settings)
    try:
        admin.delete_acls([_filter_of(name) for name in names])
        deletions = [UserScramCredentialDeletion(name, _MECHANISM) for name in names]
        admin.alter_user_scram_credentials(deletions)
    except KafkaError as exc:
        raise ServiceUnavailable(f"Kafka: removing principals: {exc}") from exc
    finally:
        admin.close()


def _filter_of(name: str) -> ACLFilter:
    return ACLFilter(
        principal=f"User:{name}",
        host="*",
        operation=ACLOperation.ANY,
        permission_type=ACLPermissionType.ANY,
        resource_pattern=ResourcePatternFilter(ResourceType.ANY, None, ACLResourcePatternType.ANY),
    )


_RESOURCE = {Resource.TOPIC: ResourceType.TOPIC, Resource.GROUP: ResourceType.GROUP}
_OPERATION = {
    Operation.READ: ACLOperation.READ,
    Operation.WRITE: ACLOperation.WRITE,
    Operation.DESCRIBE: ACLOperation.DESCRIBE,
}


def _acl(grant: Grant) -> ACL:
    pattern = ACLResourcePatternType.PREFIXED if grant.prefixed else ACLResourcePatternType.LITERAL
    return ACL(
        principal=f"User:{grant.principal}",
        host="*",
        operation=_OPERATION[grant.operation],
        permission_type=ACLPermissionType.ALLOW,
        resource_pattern=ResourcePattern(_RESOURCE[grant.resource], grant.name, pattern),
    )


def grant(settings: Settings, grants: Iterable[Grant]) -> None:
    """Add ACLs (adding one that exists changes nothing)."""
    acls = [_acl(g) for g in sorted(set(grants))]
    if not acls:
        return
    admin = admin_client(settings)
    try:
        result = admin.create_acls(acls)
    except KafkaError as exc:
        raise ServiceUnavailable(f"Kafka: granting ACLs: {exc}") from exc
    finally:
        admin.close()
    if result.get("failed"):
        raise ServiceUnavailable(f"Kafka refused ACLs: {result['failed']}")


def ungrant(settings: Settings, grants: Iterable[Grant]) -> None:
    """Remove exactly these ACLs (a test's or a benchmark's topic prefix, done with)."""
    filters = [_acl(g) for g in sorted(set(grants))]
    if not filters:
        return
    admin = admin_client(settings)
    try:
        admin.delete_acls(filters)
    except KafkaError as exc:
        raise ServiceUnavailable(f"Kafka: removing ACLs: {exc}") from exc
    finally:
        admin.close()
