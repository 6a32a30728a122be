"""Which topics the platform needs and how each is made: partitions, replication and
the topic settings a Kafka deployment expects. Pure: ``app.kafka_admin`` creates them, or
checks the ones an operator made beforehand against this plan.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum


class TopicRole(StrEnum):
    """What a topic carries (each role has its own retention)."""

    REQUESTS = "requests"
    EVENTS = "events"
    DEAD_LETTERS = "dead_letters"
    REPLIES = "replies"
    INBOX = "inbox"
    #: Records nobody reads: a scheduler's proof that the log commits writes now.
    PROBE = "probe"


@dataclass(frozen=True)
class TopicSpec:
    """How one topic is made."""

    name: str
    role: TopicRole
    partitions: int
    replication: int
    configs: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class TopicRules:
    """The settings the plan reads (from ``Settings``, see :func:`app.kafka_admin.topic_rules`)."""

    prefix: str
    partitions: int
    reply_partitions: int
    replication: int
    min_insync_replicas: int | None
    retention_ms: Mapping[TopicRole, int]
    #: max.message.bytes per role (a record's largest size, with Kafka's overhead).
    max_message_bytes: Mapping[TopicRole, int]


def plan(
    rules: TopicRules,
    tenants: Iterable[str] = (),
    nodes: Iterable[str] = (),
    *,
    platform: bool = True,
) -> dict[str, TopicSpec]:
    """The topics wanted, by name: the platform's (unless ``platform`` is false), each
    tenant's replies and each node's inbox."""
    wanted: list[tuple[str, TopicRole, int]] = []
    if platform:
        wanted += [
            (f"{rules.prefix}.requests", TopicRole.REQUESTS, rules.partitions),
            (f"{rules.prefix}.events", TopicRole.EVENTS, rules.partitions),
            (f"{rules.prefix}.deadletters", TopicRole.DEAD_LETTERS, 1),
            (f"{rules.prefix}.probe", TopicRole.PROBE, 1),
        ]
    wanted += [(f"{rules.prefix}.replies.{t}", TopicRole.REPLIES, rules.reply_partitions)
               for t in tenants]  # fmt: skip
    # One partition: a node's commands in the order the scheduler decided.
    wanted += [(f"{rules.prefix}.node.{n}", TopicRole.INBOX, 1) for n in nodes]
    return {name: _spec(rules, name, role, partitions) for name, role, partitions in wanted}


def _spec(rules: TopicRules, name: str, role: TopicRole, partitions: int) -> TopicSpec:
    configs = {
        "retention.ms": str(rules.retention_ms[role]),
        "max.message.bytes": str(rules.max_message_bytes[role]),
        # The log is append-only: never compacted away.
        "cleanup.policy": "delete",
    }
    if rules.min_insync_replicas is not None:
        configs["min.insync.replicas"] = str(rules.min_insync_replicas)
    return TopicSpec(name, role, partitions, rules.replication, configs)


#: Roles whose records go to partition 0 by name: any partition count will do.
_BY_NAME = frozenset({TopicRole.INBOX, TopicRole.DEAD_LETTERS, TopicRole.PROBE})

#: Settings a pre-made topic may exceed, not fall short of.
_AT_LEAST = frozenset({"max.message.bytes", "min.insync.replicas"})


def differences(
    spec: TopicSpec, partitions: int, replication: int, configs: Mapping[str, str]
) -> list[str]:
    """How a topic that exists falls short of ``spec`` (empty: it does not). Fewer
    partitions than planned is tolerated for the roles written to partition 0 by name
    (inbox, dead letters, probe); more is fine everywhere."""
    found: list[str] = []
    if partitions < spec.partitions and spec.role not in _BY_NAME:
        found.append(f"{spec.name}: {partitions} partitions, {spec.partitions} wanted")
    if replication < spec.replication:
        found.append(f"{spec.name}: replication factor {replication}, {spec.replication} wanted")
    for key, value in sorted(spec.configs.items()):
        have = configs.get(key)
        if have is None:
            continue  # a broker that does not say (or its default) is not a finding
        if key in _AT_LEAST and int(have) < int(value):
            found.append(f"{spec.name}: {key}={have}, at least {value} wanted")
        elif key == "cleanup.policy" and "compact" in have:
            found.append(f"{spec.name}: {key}={have}: the log must not be compacted")
    return found
