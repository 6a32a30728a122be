"""Proven records for unit tests of the pure parts: keys derived as the platform
derives them, requests signed as the SDK signs them, events as nodes sign them."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

from app.domain.codec import encode
from app.domain.node_tasks import read_inbox_record
from app.domain.partition_counts import FixedPartitions
from app.domain.partitioner import key_partition
from app.domain.proof import SCHEDULER_KEY_ID, InMemoryKeys, KeyInfo, Purpose, Role, headers
from app.domain.records import Inbound
from app.domain.requests import ReplyTo

MASTER = bytes(range(32))


def keys() -> InMemoryKeys:
    """Tenants t and u, an operator ops, nodes n0 and n1."""
    found = InMemoryKeys(MASTER)
    found.add("k-tenant-t", Role.TENANT, "t")
    found.add("k-tenant-u", Role.TENANT, "u")
    found.add("k-operator", Role.OPERATOR, "ops")
    found.add("k-node-n0", Role.NODE, "n0")
    found.add("k-node-n1", Role.NODE, "n1")
    return found


KEYS = keys()
#: The partitions of the topics unit tests read and answer on: requests have 8, every
#: replies topic 16 (the gate checks reply partitions and where a request was read).
PARTITIONS = FixedPartitions(requests_topic=8, replies_each=16)


def reply_to(tenant: str = "t", partition: int = 0) -> ReplyTo:
    """Where tenant ``tenant``'s replies may go."""
    return ReplyTo(topic=f"dsec.replies.{tenant}", partition=partition)


def record(
    message: BaseModel,
    offset: int = 0,
    *,
    key_id: str | None = None,
    partition: int | None = None,
    purpose: Purpose | None = None,
    value: bytes | None = None,
) -> Inbound:
    """A record carrying ``message`` with the proof its sender would give it: a
    request signed by tenant t (or ``key_id``), an event by its node (or the
    scheduler, for events without a node), keyed and placed as a Kafka client would
    (on ``partition`` if one is given)."""
    body = value if value is not None else encode(message)
    kind = purpose or (Purpose.EVENT if hasattr(message, "event_id") else Purpose.REQUEST)
    if key_id is None:
        if kind == Purpose.REQUEST:
            key_id = "k-tenant-t"
        else:
            node = getattr(message, "node_id", None)
            key_id = f"k-node-{node}" if node else SCHEDULER_KEY_ID
    info: KeyInfo | None = KEYS.lookup(key_id)
    assert info is not None, key_id
    subject = getattr(message, "sandbox_id", None) or getattr(message, "node_id", None) or "x"
    if partition is None:
        partition = key_partition(str(subject), PARTITIONS.requests_topic)
    return Inbound(
        topic="t", partition=partition, offset=offset, key=str(subject).encode(), value=body,
        headers=headers(kind, key_id, info.secret, body),
    )  # fmt: skip


def task_request(args: list[str]) -> dict[str, Any]:
    """The request inside a sealed node task's arguments."""
    return dict(json.loads(json.loads(args[0])["request"]))


def inbox_tasks(out: Any) -> list[tuple[str, str, list[str]]]:
    """(topic, task, sealed arguments) of each record a batch sends to node inboxes."""
    found = []
    for topic, _key, value in out.inbox:
        opened = read_inbox_record(value)
        assert not isinstance(opened, str), opened
        found.append((topic, opened[0].value, opened[1]))
    return found
