"""A record as consumers see it, without the Kafka client's type: what the pure
parts of the platform (the dispatcher, decoders) read from the bus."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


class Record(Protocol):
    """A bus record: kafka-python's ConsumerRecord is one, so is :class:`Inbound`."""

    @property
    def topic(self) -> str: ...
    @property
    def partition(self) -> int: ...
    @property
    def offset(self) -> int: ...
    @property
    def key(self) -> bytes | None: ...
    @property
    def value(self) -> bytes | None: ...
    @property
    def headers(self) -> Sequence[tuple[str, bytes]] | None: ...


@dataclass(frozen=True)
class Inbound:
    """A record made by hand (unit tests, benchmarks, in-memory buses)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: Sequence[tuple[str, bytes]] | None = field(default_factory=list)


@dataclass(frozen=True)
class StoredOffset:
    """Where a consumer stands in one partition of one incarnation of a topic: the
    position it resumes from, kept with the data it produced."""

    topic_id: uuid.UUID
    next_offset: int


def not_a_position(
    reader: str, topic: str, partition: int, saved: StoredOffset, topic_id: uuid.UUID, end: int
) -> str | None:
    """Why ``saved`` is no position in this partition, which now ends at ``end`` and
    whose topic now has id ``topic_id`` (None: it is one, and reading resumes there).

    An offset stored for another incarnation of the topic (deleted and made again under
    the same name) or past the partition's end (a broker restored from older disks)
    would skip records, or wait for ones that never come: the reader starts the
    partition at its beginning instead, and says so."""
    if saved.topic_id == topic_id and saved.next_offset <= end:
        return None
    return (
        f"{reader}: {topic}[{partition}] stored offset {saved.next_offset} "
        f"is not a position in this topic (made again, or a broker restored "
        f"from older disks); reading it from its beginning"
    )


def first_offsets(records: Sequence[Record]) -> dict[int, int]:
    """Each partition of ``records`` and the lowest offset among them: where a reader
    goes back to read them again."""
    first: dict[int, int] = {}
    for record in records:
        first[record.partition] = min(first.get(record.partition, record.offset), record.offset)
    return first
