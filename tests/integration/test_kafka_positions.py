"""Positions on the broker: a stored offset at the true end is taken as valid."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator

import pytest
from kafka import KafkaProducer, TopicPartition
from kafka.admin import NewTopic

from app import bus, kafka_admin
from app.config import Settings
from app.consuming import PositionedConsumer
from app.domain.records import StoredOffset
from tests.conftest import wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def topic(stack: Settings) -> Iterator[str]:
    name = f"{stack.topic_prefix}.positions-{uuid.uuid4().hex[:8]}"
    admin = kafka_admin.admin_client(stack)
    admin.create_topics([NewTopic(name, 1, 1)])
    yield name
    admin.delete_topics([name])
    admin.close()


def test_the_end_after_a_batch_of_several_records_is_where_it_is(
    stack: Settings, topic: str
) -> None:
    # Given one record batch of three records (the producer lingers, so they go together)
    producer = KafkaProducer(**bus.client_options(stack), linger_ms=100)
    for n in range(3):
        producer.send(topic, key=b"k", value=b"%d" % n)
    producer.flush()
    producer.close()
    tp = TopicPartition(topic, 0)
    # Then the partition ends at 3
    assert bus.high_watermarks(stack, [tp]) == {tp: 3}
    # And a consumer that stored "next is 3" resumes there, not from the beginning
    consumer = PositionedConsumer(stack, topic, "positions-test")
    try:
        assert consumer.seek({0: StoredOffset(consumer.topic_id, 3)}) == []
        assert consumer.position(0) == 3
    finally:
        consumer.close()


def test_a_producer_keeps_every_topic_after_a_new_one(stack: Settings) -> None:
    # Given a producer that has sent to an existing topic (known from its bootstrap)
    publisher = bus.Publisher(stack)
    admin = kafka_admin.admin_client(stack)
    late = f"{stack.topic_prefix}.late-{uuid.uuid4().hex[:8]}"
    try:
        publisher.publish(stack.topic_dead_letters, "k", b"x", wait=True)
        # When it sends to a topic made after it started (a new tenant's replies)
        admin.create_topics([NewTopic(late, 1, 1)])
        publisher.publish(late, "k", b"y", wait=True)
        # Then its metadata still knows the first topic's leader: without that, its
        # sender thread asks for metadata in a tight loop, a whole core for good
        metadata = publisher._producer._metadata
        assert metadata.leader_for_partition(TopicPartition(stack.topic_dead_letters, 0))
    finally:
        publisher.close()
        admin.delete_topics([late])
        admin.close()


def test_a_producer_stops_asking_for_a_topic_it_asked_about_that_never_came(
    stack: Settings,
) -> None:
    # Given a producer asked how many partitions a topic has that does not exist (a
    # tenant's replies topic deleted behind the platform's back, as a scheduler asks)
    publisher = bus.Publisher(stack)
    never = f"{stack.topic_prefix}.never-{uuid.uuid4().hex[:8]}"
    try:
        assert publisher.partitions_of(never, 0.2) is None
        metadata = publisher._producer._metadata
        # Then, past the grace a topic just made gets, it no longer follows it, and
        # stops asking for metadata (kafka-python would ask every 100 ms for good)
        wait_for(lambda: never not in metadata._topics, bus.UNKNOWN_TOPIC_GRACE_S + 10, "let go")
        wait_for(lambda: not metadata._need_update, 5, "no metadata update pending")
    finally:
        publisher.close()


def test_a_producer_stops_asking_for_a_deleted_topic(stack: Settings) -> None:
    # Given a producer that sent to a topic (a tenant's replies, say)
    publisher = bus.Publisher(stack)
    admin = kafka_admin.admin_client(stack)
    doomed = f"{stack.topic_prefix}.doomed-{uuid.uuid4().hex[:8]}"
    try:
        admin.create_topics([NewTopic(doomed, 1, 1)])
        publisher.publish(doomed, "k", b"x", wait=True)
        metadata = publisher._producer._metadata
        # When the topic is deleted behind its back, and its metadata is refreshed
        admin.delete_topics([doomed])
        metadata.request_update()
        # Then it no longer follows it, and stops asking for metadata: kafka-python
        # would ask every 100 ms for good while a followed topic is unknown
        wait_for(lambda: doomed not in metadata._topics, 15, "the deleted topic let go")
        wait_for(lambda: not metadata._need_update, 5, "no metadata update pending")
        # And sending to a topic of that name again follows it again
        admin.create_topics([NewTopic(doomed, 1, 1)])
        publisher.publish(doomed, "k", b"y", wait=True)
        assert doomed in metadata._topics
    finally:
        publisher.close()
        with contextlib.suppress(Exception):
            admin.delete_topics([doomed])
        admin.close()


def test_a_consumer_that_moves_reads_at_once_and_keeps_its_place(stack: Settings) -> None:
    """kafka-python sends no fetch to a broker holding one: a consumer that moved used
    to wait out its held fetch (the idle wait) before reading from the new place."""
    name = f"{stack.topic_prefix}.moves-{uuid.uuid4().hex[:8]}"
    admin = kafka_admin.admin_client(stack)
    admin.create_topics([NewTopic(name, 2, 1)])
    publisher = bus.Publisher(stack)
    held_s = 20
    consumer = PositionedConsumer(stack, name, "moves-test", [0], fetch_max_wait_ms=held_s * 1000)
    try:
        # Given a consumer of partition 0 that read its one record, and whose next
        # fetch the broker now holds (nothing more comes)
        consumer.seek({})
        publisher.publish(name, "k", b"first", partition=0, wait=True)
        got = wait_for(lambda: consumer.poll(timeout_ms=500), 10, "the first record")
        assert [r.value for r in got] == [b"first"]
        assert consumer.poll(timeout_ms=500) == []
        # When it moves to partitions 0 and 1 and a record comes on 1
        started = time.monotonic()
        assert consumer.reassign([0, 1], {}) == []
        publisher.publish(name, "k", b"second", partition=1, wait=True)
        # Then it reads it well within the held fetch's wait, and not partition 0 again
        later: list[bytes | None] = []
        while not later and time.monotonic() - started < held_s / 3:
            later = [r.value for r in consumer.poll(timeout_ms=500)]
        assert later == [b"second"]
        assert consumer.position(0) == 1
    finally:
        consumer.close()
        publisher.close()
        admin.delete_topics([name])
        admin.close()
