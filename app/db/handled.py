"""Request ids the scheduler handled, kept for the freshness window: the gate's memory
across restarts and takeovers (a replayed request is refused even by a scheduler that
just started). Ids are scoped by the key that proved them, as in the gate.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import Connection, delete, select
from sqlalchemy.dialects.postgresql import insert

from app.db.tables import handled_requests
from app.domain.gate import Handled

#: Compiled once, executed with the rows (see app.db.log's _SAVE_OFFSETS for why).
_SAVE = insert(handled_requests).on_conflict_do_nothing()


def save(conn: Connection, rows: Sequence[Handled]) -> None:
    """Record handled ids, in the transaction that saves the offsets past them."""
    if not rows:
        return
    values = [
        {"key_id": h.key_id, "request_id": h.request_id, "partition": h.partition,
         "offset": h.offset, "handled_at": h.at}
        for h in rows
    ]  # fmt: skip
    conn.execute(_SAVE, values)


def load(conn: Connection, since: datetime) -> list[Handled]:
    """Ids handled since ``since``, oldest first."""
    t = handled_requests
    rows = conn.execute(
        select(t.c.key_id, t.c.request_id, t.c.partition, t.c.offset, t.c.handled_at)
        .where(t.c.handled_at >= since)
        .order_by(t.c.handled_at)
    ).all()
    return [Handled(r.key_id, r.request_id, r.partition, r.offset, r.handled_at) for r in rows]


def prune(conn: Connection, before: datetime) -> int:
    """Forget ids handled before ``before`` (older requests are refused as stale)."""
    result = conn.execute(delete(handled_requests).where(handled_requests.c.handled_at < before))
    return int(result.rowcount or 0)
