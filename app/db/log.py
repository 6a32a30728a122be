"""The event log: append a batch idempotently, and keep consumer offsets with it."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import Connection, select
from sqlalchemy.dialects.postgresql import insert

from app.db.tables import consumer_offsets, events
from app.domain.events import Event


@dataclass(frozen=True)
class SourcedEvent:
    """An event and where on the bus it came from."""

    event: Event
    topic: str
    topic_id: uuid.UUID
    partition: int
    offset: int


def event_row(item: SourcedEvent) -> dict[str, object]:
    """The ``events`` row for one sourced event."""
    e = item.event
    return {
        "event_id": e.event_id,
        "type": e.type,
        "version": e.version,
        "sandbox_id": e.sandbox_id,
        "node_id": e.node_id,
        "tenant": e.tenant,
        "job_id": e.job_id,
        "occurred_at": e.occurred_at,
        "payload": e.payload.model_dump(mode="json"),
        "topic": item.topic,
        "topic_id": item.topic_id,
        "partition": item.partition,
        "offset": item.offset,
    }


def append(conn: Connection, batch: Sequence[SourcedEvent]) -> list[tuple[SourcedEvent, int]]:
    """Insert the batch; return the events that were new, with their positions.

    A redelivered event (same ``event_id``, or same topic/partition/offset) is
    skipped, so appending is idempotent.
    """
    if not batch:
        return []
    rows = [event_row(item) for item in batch]
    stmt = insert(events).on_conflict_do_nothing().returning(events.c.event_id, events.c.position)
    result = conn.execute(stmt, rows)
    positions = {row.event_id: row.position for row in result}
    new: list[tuple[SourcedEvent, int]] = []
    for item in batch:
        # pop: the same event twice in one batch was inserted once.
        position = positions.pop(item.event.event_id, None)
        if position is not None:
            new.append((item, position))
    new.sort(key=lambda pair: pair[1])
    return new


@dataclass(frozen=True)
class StoredOffset:
    """Where a consumer stands in one partition of one incarnation of a topic."""

    topic_id: uuid.UUID
    next_offset: int


def load_offsets(conn: Connection, consumer: str, topic: str) -> dict[int, StoredOffset]:
    """Next offset to read per partition, as last committed with the data."""
    rows = conn.execute(
        select(
            consumer_offsets.c.partition,
            consumer_offsets.c.topic_id,
            consumer_offsets.c.next_offset,
        ).where(consumer_offsets.c.consumer == consumer, consumer_offsets.c.topic == topic)
    )
    return {row.partition: StoredOffset(row.topic_id, row.next_offset) for row in rows}


def save_offsets(
    conn: Connection, consumer: str, topic: str, topic_id: uuid.UUID, offsets: dict[int, int]
) -> None:
    """Record the next offset per partition, in the caller's transaction."""
    if not offsets:
        return
    stmt = insert(consumer_offsets).values(
        [
            {
                "consumer": consumer,
                "topic": topic,
                "topic_id": topic_id,
                "partition": p,
                "next_offset": o,
            }
            for p, o in offsets.items()
        ]
    )
    stmt = stmt.on_conflict_do_update(
        index_elements=["consumer", "topic", "partition"],
        set_={
            "next_offset": stmt.excluded.next_offset,
            "topic_id": stmt.excluded.topic_id,
            "updated_at": stmt.excluded.updated_at,
        },
    )
    conn.execute(stmt)
