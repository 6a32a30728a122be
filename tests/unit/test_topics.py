"""The topic plan: what Apache Kafka gets (partitions, replication, settings) and
what the embedded broker gets, and how a pre-made topic is checked against it."""

from __future__ import annotations

from app.domain.topics import TopicRole, TopicRules, differences, plan

ROLES = list(TopicRole)
RULES = TopicRules(
    prefix="dsec",
    partitions=8,
    reply_partitions=16,
    replication=3,
    min_insync_replicas=2,
    retention_ms={role: 1000 * (i + 1) for i, role in enumerate(ROLES)},
    max_message_bytes={role: 2_000_000 for role in ROLES},
)


def test_apache_kafka_gets_replicated_topics_with_their_settings() -> None:
    topics = plan(RULES, ["alice"], ["node0"])
    assert set(topics) == {
        "dsec.requests", "dsec.events", "dsec.deadletters", "dsec.probe", "dsec.replies.alice",
        "dsec.node.node0",
    }  # fmt: skip
    events, replies, inbox = (
        topics["dsec.events"],
        topics["dsec.replies.alice"],
        topics["dsec.node.node0"],
    )
    assert (events.partitions, replies.partitions, inbox.partitions) == (8, 16, 1)
    assert {t.replication for t in topics.values()} == {3}
    assert events.configs["min.insync.replicas"] == "2"
    assert events.configs["retention.ms"] == str(RULES.retention_ms[TopicRole.EVENTS])
    assert replies.configs["max.message.bytes"] == "2000000"
    assert all(t.configs["cleanup.policy"] == "delete" for t in topics.values())


def test_only_the_asked_topics_are_planned() -> None:
    assert set(plan(RULES, nodes=["n1"], platform=False)) == {"dsec.node.n1"}


def test_a_pre_made_topic_is_checked_against_the_plan() -> None:
    topics = plan(RULES, ["alice"], ["node0"])
    events = topics["dsec.events"]
    assert differences(events, 8, 3, dict(events.configs)) == []
    found = differences(
        events, 4, 1,
        {"max.message.bytes": "1048588", "min.insync.replicas": "1", "cleanup.policy": "compact"},
    )  # fmt: skip
    assert len(found) == 5, found
    # The inbox and the dead letters are written to partition 0 by name: more or fewer
    # partitions are fine; a broker that does not report a setting is no finding
    assert differences(topics["dsec.node.node0"], 4, 3, {}) == []
    assert differences(topics["dsec.deadletters"], 1, 3, {}) == []
