"""The positioned reader's contract: how the projector, the scheduler and a node's
inbox read the bus (chosen partitions of one topic, from positions they store), run
against Kafka (the embedded broker) and the in-memory reader alike, so a unit test on
the latter relies only on what the former does too."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest

from app import kafka_admin
from app.config import Settings
from app.domain.records import Record, StoredOffset
from app.memory import InMemoryBus, InMemoryPositionedReader
from app.ports import Bus, PositionedReader

#: Partitions of the topic under test.
PARTITIONS = 3


@dataclass
class Topic:
    """A topic of :data:`PARTITIONS` partitions nobody else writes to, the bus that
    writes it, and readers of it, closed after the test."""

    name: str
    bus: Bus
    open_reader: Callable[[Sequence[int] | None], PositionedReader]
    #: The settings the topic was made with (None: in memory).
    settings: Settings | None = None
    readers: list[PositionedReader] = field(default_factory=list)

    def reader(self, partitions: Sequence[int] | None = None) -> PositionedReader:
        """A reader of ``partitions`` (None: all of them)."""
        reader = self.open_reader(partitions)
        self.readers.append(reader)
        return reader

    def publish(self, partition: int, *values: str) -> None:
        """``values`` in order to ``partition``, keyed and headed after each; stored."""
        for value in values:
            self.bus.publish(
                self.name, f"k-{value}", value.encode(), partition=partition,
                headers=[("h", value.encode())],
            )  # fmt: skip
        self.bus.flush()


@contextmanager
def _memory() -> Iterator[Topic]:
    bus = InMemoryBus()
    name = "contract.positioned"
    bus.make_topic(name, PARTITIONS)
    yield Topic(
        name, bus, lambda partitions: InMemoryPositionedReader(bus, name, "contract", partitions)
    )


@contextmanager
def _kafka(request: pytest.FixtureRequest, client: str) -> Iterator[Topic]:
    from app.consuming import PositionedConsumer
    from app.kafka_bus import KafkaBus
    from app.rdkafka_bus import RdkafkaReader

    stack: Settings = request.getfixturevalue("stack")
    own = stack.model_copy(
        update={
            "topic_prefix": f"contract{uuid.uuid4().hex[:8]}",
            "topic_partitions": PARTITIONS,
        }
    )
    kafka_admin.ensure_topics(own)
    real = KafkaBus(own)
    name = own.topic_events
    reader = RdkafkaReader if client == "librdkafka" else PositionedConsumer
    try:
        yield Topic(name, real, lambda partitions: reader(own, name, "contract", partitions), own)
    finally:
        real.close()
        kafka_admin.drop_topics(own)


@pytest.fixture(
    params=[
        "memory",
        pytest.param("kafka-python", marks=pytest.mark.integration),
        pytest.param("librdkafka", marks=pytest.mark.integration),
    ]
)
def topic(request: pytest.FixtureRequest) -> Iterator[Topic]:
    kafka = request.param != "memory"
    with _kafka(request, request.param) if kafka else _memory() as topic:
        try:
            yield topic
        finally:
            for reader in topic.readers:
                reader.close()


def read(reader: PositionedReader, count: int, max_records: int = 2000) -> list[Record]:
    """Polls until ``count`` records came (a Kafka consumer's first polls may bring
    none while it fetches), and fails if more came."""
    got: list[Record] = []
    deadline = time.monotonic() + 20
    while len(got) < count and time.monotonic() < deadline:
        got.extend(reader.poll(timeout_ms=500, max_records=min(max_records, count - len(got))))
    assert len(got) == count, f"{len(got)} records read, {count} wanted"
    return got


def of(records: Sequence[Record], partition: int) -> list[tuple[int, bytes | None]]:
    """The (offset, value) of ``records`` from ``partition``, in the order read."""
    return [(r.offset, r.value) for r in records if r.partition == partition]


def test_records_come_in_order_per_partition_with_their_key_value_and_headers(
    topic: Topic,
) -> None:
    topic.publish(0, "a0", "a1", "a2")
    topic.publish(1, "b0", "b1")
    reader = topic.reader()
    assert reader.seek({}) == []
    got = read(reader, 5)
    assert of(got, 0) == [(0, b"a0"), (1, b"a1"), (2, b"a2")]
    assert of(got, 1) == [(0, b"b0"), (1, b"b1")]
    assert sorted((r.value, r.topic, r.key, [tuple(h) for h in r.headers or []]) for r in got) == [
        (v.encode(), topic.name, f"k-{v}".encode(), [("h", v.encode())])
        for v in ("a0", "a1", "a2", "b0", "b1")
    ]
    assert reader.poll(timeout_ms=300) == []


def test_a_reader_of_some_partitions_reads_those_alone(topic: Topic) -> None:
    topic.publish(0, "a0")
    topic.publish(1, "b0", "b1")
    reader = topic.reader([1])
    assert list(reader.all_partitions) == list(range(PARTITIONS))
    assert list(reader.partitions) == [1]
    reader.seek({})
    assert of(read(reader, 2), 1) == [(0, b"b0"), (1, b"b1")]
    assert reader.poll(timeout_ms=300) == []


def test_a_seek_resumes_each_partition_at_its_stored_offset(topic: Topic) -> None:
    # Given records in three partitions, and stored offsets for two of them
    topic.publish(0, "a0", "a1", "a2", "a3", "a4")
    topic.publish(1, "b0", "b1", "b2")
    topic.publish(2, "c0", "c1")
    reader = topic.reader()
    here = reader.topic_id
    # When the reader seeks to them
    warnings = reader.seek({0: StoredOffset(here, 3), 1: StoredOffset(here, 1)})
    # Then each resumes where it stood, the third from its beginning, without a word
    assert warnings == []
    assert [reader.position(p) for p in range(3)] == [3, 1, 0]
    got = read(reader, 6)
    assert of(got, 0) == [(3, b"a3"), (4, b"a4")]
    assert of(got, 1) == [(1, b"b1"), (2, b"b2")]
    assert of(got, 2) == [(0, b"c0"), (1, b"c1")]


def test_the_topic_id_is_the_topics_whoever_reads_it(topic: Topic) -> None:
    assert topic.reader().topic_id == topic.reader([0]).topic_id


def test_an_offset_stored_for_another_incarnation_restarts_at_the_beginning(
    topic: Topic,
) -> None:
    # Given an offset stored with the id of another topic of this name
    topic.publish(0, "a0", "a1", "a2")
    reader = topic.reader([0])
    other = uuid.uuid4()
    assert other != reader.topic_id
    # When the reader seeks to it
    warnings = reader.seek({0: StoredOffset(other, 2)})
    # Then the partition is read from its beginning, and the caller is told
    assert len(warnings) == 1 and f"{topic.name}[0]" in warnings[0]
    assert reader.position(0) == 0
    assert of(read(reader, 3), 0) == [(0, b"a0"), (1, b"a1"), (2, b"a2")]


def test_an_offset_past_the_end_restarts_at_the_beginning(topic: Topic) -> None:
    topic.publish(0, "a0", "a1")
    reader = topic.reader([0])
    # The end itself is a position: the next record's
    assert reader.seek({0: StoredOffset(reader.topic_id, 2)}) == []
    assert reader.position(0) == 2
    # One past it is none (a broker restored from older disks)
    warnings = reader.seek({0: StoredOffset(reader.topic_id, 3)})
    assert len(warnings) == 1 and f"{topic.name}[0]" in warnings[0]
    assert reader.position(0) == 0
    assert of(read(reader, 2), 0) == [(0, b"a0"), (1, b"a1")]


def test_a_reassign_keeps_kept_partitions_where_they_stand_and_seeks_new_ones(
    topic: Topic,
) -> None:
    # Given a reader of partition 0 that has read two of its four records
    topic.publish(0, "a0", "a1", "a2", "a3")
    topic.publish(1, "b0", "b1", "b2")
    reader = topic.reader([0])
    reader.seek({})
    assert of(read(reader, 2, max_records=2), 0) == [(0, b"a0"), (1, b"a1")]
    here = reader.topic_id
    # When it reads partitions 0 and 1, with offsets stored for both
    warnings = reader.reassign([0, 1], {0: StoredOffset(here, 0), 1: StoredOffset(here, 1)})
    # Then partition 0 goes on where it stood and partition 1 starts at its stored offset
    assert warnings == []
    assert list(reader.partitions) == [0, 1]
    assert (reader.position(0), reader.position(1)) == (2, 1)
    got = read(reader, 4)
    assert of(got, 0) == [(2, b"a2"), (3, b"a3")]
    assert of(got, 1) == [(1, b"b1"), (2, b"b2")]
    # And a new partition's stored offset is checked as a seek checks it
    assert len(reader.reassign([0, 1, 2], {2: StoredOffset(uuid.uuid4(), 1)})) == 1
    assert reader.position(2) == 0
    # And given back, a partition is read no more
    topic.publish(0, "a4")
    assert reader.reassign([1], {}) == []
    assert list(reader.partitions) == [1]
    assert reader.position(1) == 3
    assert reader.poll(timeout_ms=300) == []


def test_a_rewind_reads_the_records_again(topic: Topic) -> None:
    # Given every record of two partitions read
    topic.publish(0, "a0", "a1", "a2")
    topic.publish(1, "b0", "b1")
    reader = topic.reader([0, 1])
    reader.seek({})
    got = read(reader, 5)
    # When the last two of partition 0 are given back unhandled
    reader.rewind([r for r in got if r.partition == 0 and r.offset >= 1])
    # Then partition 0 is read again from the first of them, partition 1 stays
    assert (reader.position(0), reader.position(1)) == (1, 2)
    assert of(read(reader, 2), 0) == [(1, b"a1"), (2, b"a2")]


def test_ends_and_positions(topic: Topic) -> None:
    topic.publish(0, "a0", "a1", "a2")
    reader = topic.reader([0, 1])
    assert reader.ends() == {0: 3, 1: 0}
    reader.seek({})
    assert reader.position(0) == 0
    read(reader, 3)
    assert reader.position(0) == 3
    topic.publish(0, "a3")
    assert reader.ends() == {0: 4, 1: 0}


def test_an_empty_assignment_reads_nothing_and_waits_its_timeout(topic: Topic) -> None:
    topic.publish(0, "a0")
    reader = topic.reader([])
    assert list(reader.partitions) == []
    assert list(reader.all_partitions) == list(range(PARTITIONS))
    assert reader.seek({}) == []
    # An idle loop on it must not spin: the poll takes its timeout
    started = time.monotonic()
    assert reader.poll(timeout_ms=300) == []
    assert time.monotonic() - started >= 0.25
    # Nor after its last partition is given back
    reader.reassign([0], {})
    assert of(read(reader, 1), 0) == [(0, b"a0")]
    reader.reassign([], {})
    assert list(reader.partitions) == []
    assert reader.poll(timeout_ms=300) == []


@pytest.mark.integration
def test_both_kafka_clients_name_a_topic_by_the_same_id(request: pytest.FixtureRequest) -> None:
    """Positions a node stored reading its inbox with one client are positions for the
    other: switching a node's client must not make it read its inbox again."""
    from app.consuming import PositionedConsumer
    from app.rdkafka_bus import RdkafkaReader

    with _kafka(request, "kafka-python") as topic:
        assert topic.settings is not None
        python = PositionedConsumer(topic.settings, topic.name, "contract", [0])
        rdkafka = RdkafkaReader(topic.settings, topic.name, "contract", [0])
        try:
            assert python.topic_id == rdkafka.topic_id
        finally:
            python.close()
            rdkafka.close()
