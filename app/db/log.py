"""The event log: append a batch idempotently, and keep consumer offsets with it."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, select, text
from sqlalchemy.dialects.postgresql import insert

from app.db.tables import consumer_offsets
from app.domain.events import Event


@dataclass(frozen=True)
class SourcedEvent:
    """An event and where on the bus it came from."""

    event: Event
    topic: str
    topic_id: uuid.UUID
    partition: int
    offset: int


#: One round trip per batch: claim the ids in ``event_ids`` (the global dedupe key),
#: then append only the events whose id was new, in batch order.
_APPEND = text(
    """
    WITH batch AS (
        SELECT * FROM unnest(
            CAST(:event_id AS uuid[]), CAST(:type AS text[]), CAST(:version AS smallint[]),
            CAST(:sandbox_id AS text[]), CAST(:node_id AS text[]), CAST(:tenant AS text[]),
            CAST(:job_id AS text[]), CAST(:occurred_at AS timestamptz[]),
            CAST(:payload AS jsonb[]), CAST(:topic AS text[]), CAST(:topic_id AS uuid[]),
            CAST(:partition AS int[]), CAST(:offset AS bigint[]), CAST(:ord AS int[])
        ) AS b(event_id, type, version, sandbox_id, node_id, tenant, job_id, occurred_at,
               payload, topic, topic_id, partition, "offset", ord)
    ),
    fresh AS (
        INSERT INTO event_ids (event_id)
        SELECT event_id FROM batch ORDER BY ord
        ON CONFLICT DO NOTHING
        RETURNING event_id
    )
    INSERT INTO events (event_id, type, version, sandbox_id, node_id, tenant, job_id,
                        occurred_at, payload, topic, topic_id, partition, "offset")
    SELECT b.event_id, b.type, b.version, b.sandbox_id, b.node_id, b.tenant, b.job_id,
           b.occurred_at, b.payload, b.topic, b.topic_id, b.partition, b."offset"
    FROM batch b JOIN fresh USING (event_id)
    ORDER BY b.ord
    RETURNING event_id, position
    """
)


def append(conn: Connection, batch: Sequence[SourcedEvent]) -> list[tuple[SourcedEvent, int]]:
    """Append the batch; return the events that were new, with their positions.

    A redelivered event (an ``event_id`` already in the log, or twice in this batch)
    is skipped, so appending is idempotent. Positions follow batch order.
    """
    unique: dict[uuid.UUID, SourcedEvent] = {}
    for item in batch:
        unique.setdefault(item.event.event_id, item)
    if not unique:
        return []
    items = list(unique.values())
    params: dict[str, list[Any]] = {
        "event_id": [i.event.event_id for i in items],
        "type": [i.event.type for i in items],
        "version": [i.event.version for i in items],
        "sandbox_id": [i.event.sandbox_id for i in items],
        "node_id": [i.event.node_id for i in items],
        "tenant": [i.event.tenant for i in items],
        "job_id": [i.event.job_id for i in items],
        "occurred_at": [i.event.occurred_at for i in items],
        "payload": [i.event.payload.model_dump_json() for i in items],
        "topic": [i.topic for i in items],
        "topic_id": [i.topic_id for i in items],
        "partition": [i.partition for i in items],
        "offset": [i.offset for i in items],
        "ord": list(range(len(items))),
    }
    positions = {row.event_id: row.position for row in conn.execute(_APPEND, params)}
    new = [(i, positions[i.event.event_id]) for i in items if i.event.event_id in positions]
    new.sort(key=lambda pair: pair[1])
    return new


def ensure_partitions(conn: Connection, days_ahead: int = 7) -> int:
    """Create the log's daily partitions up to ``days_ahead``; return how many were new."""
    made = conn.execute(text("SELECT dsec_ensure_event_partitions(:d)"), {"d": days_ahead})
    return int(made.scalar() or 0)


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
