"""The event log: append a batch idempotently, and keep consumer offsets with it."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

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


#: One round trip per batch, with the batch as ONE json parameter: Postgres parses
#: it in C, where binding fourteen arrays cost more in psycopg's dumpers than the
#: insert itself. Claim the ids in ``event_ids`` (the global dedupe key) first, then
#: append only the events whose id was new, in batch order.
_APPEND = text(
    """
    WITH batch AS (
        SELECT x.ord, x.item->'e' AS e, x.item->>'t' AS topic,
               (x.item->>'i')::uuid AS topic_id, (x.item->>'p')::int AS partition,
               (x.item->>'o')::bigint AS "offset"
        FROM jsonb_array_elements(CAST(:batch AS jsonb)) WITH ORDINALITY AS x(item, ord)
    ),
    fresh AS (
        INSERT INTO event_ids (event_id)
        SELECT (e->>'event_id')::uuid FROM batch ORDER BY ord
        ON CONFLICT DO NOTHING
        RETURNING event_id
    )
    INSERT INTO events (event_id, type, version, sandbox_id, node_id, tenant, job_id,
                        occurred_at, payload, topic, topic_id, partition, "offset")
    SELECT f.event_id, b.e->>'type', (b.e->>'version')::smallint, b.e->>'sandbox_id',
           b.e->>'node_id', b.e->>'tenant', b.e->>'job_id',
           (b.e->>'occurred_at')::timestamptz, b.e->'payload', b.topic, b.topic_id,
           b.partition, b."offset"
    FROM batch b JOIN fresh f ON f.event_id = (b.e->>'event_id')::uuid
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
    # The validated model is re-serialised (not the bytes received), so defaults
    # are filled in and the stored form is canonical.
    body = ",".join(
        f'{{"t":{json.dumps(i.topic)},"i":"{i.topic_id}","p":{i.partition},"o":{i.offset},'
        f'"e":{i.event.model_dump_json()}}}'
        for i in items
    )
    positions = {
        row.event_id: row.position for row in conn.execute(_APPEND, {"batch": f"[{body}]"})
    }
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
