"""Topics are made as planned, with their settings, and topics an operator made
beforehand are checked against the plan: against the real broker, as Apache Kafka
would be asked (the embedded broker's own rule switched off, on a prefix of the
test's own)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from kafka.admin import NewTopic

from app import kafka_admin
from app.config import Settings

pytestmark = pytest.mark.integration


@pytest.fixture
def kafka_like(stack: Settings) -> Iterator[Settings]:
    ours = stack.model_copy(update={"topic_prefix": f"plan-{uuid.uuid4().hex[:8]}"})
    yield ours
    kafka_admin.drop_topics(ours)


def _partitions(settings: Settings) -> dict[str, int]:
    admin = kafka_admin.admin_client(settings)
    try:
        mine = [t for t in admin.list_topics() if t.startswith(f"{settings.topic_prefix}.")]
        return {t["name"]: len(t["partitions"]) for t in admin.describe_topics(mine)}
    finally:
        admin.close()


def test_topics_are_made_as_planned_and_pre_made_ones_are_checked(kafka_like: Settings) -> None:
    prefix = kafka_like.topic_prefix
    # Given a replies topic an operator made beforehand, with too few partitions
    admin = kafka_admin.admin_client(kafka_like)
    try:
        admin.create_topics([NewTopic(f"{prefix}.replies.alice", 2, 1)])
    finally:
        admin.close()
    # When the platform makes its topics
    found = kafka_admin.ensure_topics(kafka_like, ["alice", "bob"], ["node0"])
    # Then the missing ones are made with their planned partitions
    assert _partitions(kafka_like) == {
        f"{prefix}.requests": kafka_like.topic_partitions,
        f"{prefix}.events": kafka_like.topic_partitions,
        f"{prefix}.deadletters": 1,
        f"{prefix}.probe": 1,
        f"{prefix}.replies.alice": 2,
        f"{prefix}.replies.bob": kafka_like.reply_partitions,
        f"{prefix}.node.node0": 1,
    }
    # and the pre-made one is reported, not silently used as if it were right
    assert found == [f"{prefix}.replies.alice: 2 partitions, {kafka_like.reply_partitions} wanted"]
    # And a second look finds nothing new to make, and the same shortfall
    assert kafka_admin.ensure_topics(kafka_like, ["alice", "bob"], ["node0"]) == found
