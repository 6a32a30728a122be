"""The bus port's contract: what every bus does, run against Kafka (the embedded
broker) and the in-memory bus alike, so a unit test on the latter relies only on
what the former does too."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from app import kafka_admin
from app.config import Settings
from app.kafka_bus import KafkaBus
from app.memory import InMemoryBus
from app.ports import Bus


@pytest.fixture(params=["memory", pytest.param("kafka", marks=pytest.mark.integration)])
def port(request: pytest.FixtureRequest) -> Iterator[tuple[Bus, str]]:
    """A bus and a topic of two or more partitions nobody else writes to."""
    if request.param == "memory":
        yield InMemoryBus(), "contract.topic"
        return
    stack: Settings = request.getfixturevalue("stack")
    own = stack.model_copy(update={"topic_prefix": f"contract{uuid.uuid4().hex[:8]}"})
    kafka_admin.ensure_topics(own)
    real = KafkaBus(own)
    try:
        yield real, own.topic_events
    finally:
        real.close()
        kafka_admin.drop_topics(own)


def test_records_come_back_in_order_with_their_key_value_and_headers(
    port: tuple[Bus, str],
) -> None:
    bus, topic = port
    for n in range(3):
        bus.publish(topic, f"k{n}", f"v{n}".encode(), partition=0, headers=[("h", bytes([n]))])
    bus.flush()
    got = bus.read(topic, 0, 0, wait_s=10)
    assert [(r.offset, r.key, r.value) for r in got] == [
        (0, b"k0", b"v0"),
        (1, b"k1", b"v1"),
        (2, b"k2", b"v2"),
    ]
    assert [list(r.headers or []) for r in got] == [[("h", bytes([n]))] for n in range(3)]
    assert {(r.topic, r.partition) for r in got} == {(topic, 0)}


def test_a_reader_resumes_from_any_position(port: tuple[Bus, str]) -> None:
    bus, topic = port
    for n in range(5):
        bus.publish(topic, "k", str(n).encode(), partition=0)
    bus.flush()
    assert [(r.offset, r.value) for r in bus.read(topic, 0, 3, wait_s=10)] == [
        (3, b"3"),
        (4, b"4"),
    ]


def test_a_read_returns_at_most_its_limit(port: tuple[Bus, str]) -> None:
    bus, topic = port
    for n in range(10):
        bus.publish(topic, "k", str(n).encode(), partition=0)
    bus.flush()
    got = bus.read(topic, 0, 0, limit=4, wait_s=10)
    assert 1 <= len(got) <= 4
    assert [r.offset for r in got] == list(range(len(got)))


def test_partitions_are_apart_and_numbered_from_zero_each(port: tuple[Bus, str]) -> None:
    bus, topic = port
    bus.publish(topic, "a", b"first", partition=0)
    bus.publish(topic, "b", b"second", partition=1)
    bus.publish(topic, "b", b"third", partition=1)
    bus.flush()
    assert [(r.offset, r.value) for r in bus.read(topic, 0, 0, wait_s=10)] == [(0, b"first")]
    assert [(r.offset, r.value) for r in bus.read(topic, 1, 0, wait_s=10)] == [
        (0, b"second"),
        (1, b"third"),
    ]


def test_the_end_is_the_next_offset_and_reading_there_finds_nothing(
    port: tuple[Bus, str],
) -> None:
    bus, topic = port
    assert bus.end(topic, 0) == 0
    for n in range(3):
        bus.publish(topic, "k", str(n).encode(), partition=0)
    bus.flush()
    assert bus.end(topic, 0) == 3
    assert bus.read(topic, 0, 3, wait_s=0.3) == []


def test_a_record_published_while_a_reader_waits_reaches_it(port: tuple[Bus, str]) -> None:
    import threading

    bus, topic = port
    later = threading.Timer(
        0.3, lambda: (bus.publish(topic, "k", b"late", partition=0), bus.flush())
    )
    later.start()
    try:
        got = bus.read(topic, 0, 0, wait_s=15)
    finally:
        later.join()
    assert [r.value for r in got] == [b"late"]
