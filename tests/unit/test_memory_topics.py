"""The in-memory bus's topics: made with a partition count, and made again under a new
id, as the positioned reader's contract (tests/contracts/test_positioned_reader.py)
needs of it."""

from __future__ import annotations

import pytest

from app.domain.records import StoredOffset
from app.errors import ServiceUnavailable
from app.memory import InMemoryBus, InMemoryPositionedReader


def test_a_topic_made_again_is_another_incarnation_and_starts_empty() -> None:
    # Given a topic read up to its end, and where the reader stood stored
    bus = InMemoryBus()
    first = bus.make_topic("t", 2)
    for n in range(3):
        bus.publish("t", "k", b"%d" % n, partition=0)
    reader = InMemoryPositionedReader(bus, "t", "test")
    assert [r.offset for r in reader.poll(timeout_ms=0)] == [0, 1, 2]
    stored = {0: StoredOffset(reader.topic_id, reader.position(0))}
    # When the topic is made again and written anew, as far as before
    again = bus.make_topic("t", 2)
    for n in range(3):
        bus.publish("t", "k", b"new %d" % n, partition=0)
    # Then it has another id, and only its new records
    assert again != first and bus.topic_id("t") == again
    assert [r.value for r in bus.read("t", 0, 0, wait_s=0)] == [b"new 0", b"new 1", b"new 2"]
    # And a reader of it takes the old position for none: it starts from the beginning
    fresh = InMemoryPositionedReader(bus, "t", "test")
    assert len(fresh.seek(stored)) == 1
    assert [r.value for r in fresh.poll(timeout_ms=0)] == [b"new 0", b"new 1", b"new 2"]


def test_a_topic_never_made_cannot_be_read() -> None:
    with pytest.raises(ServiceUnavailable):
        InMemoryPositionedReader(InMemoryBus(), "missing", "test")
