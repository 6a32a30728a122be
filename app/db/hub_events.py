"""The image hub's tables: its audit trail (``hub_events``), appended by the token
service as the registry reports and read by operators (SQL) and by the token service
(a tenant's repositories, for its images quota); and who else may use a tenant's
images (``image_shares``)."""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import Connection, delete, func, select
from sqlalchemy.dialects.postgresql import insert

from app.db.tables import hub_events, image_shares
from app.domain.hub_events import HubEvent


def record(conn: Connection, events: Iterable[HubEvent]) -> int:
    """Append ``events`` (one already there by its id is skipped); returns how many
    were new."""
    rows = [e.model_dump() for e in events]
    if not rows:
        return 0
    done = conn.execute(
        insert(hub_events).values(rows).on_conflict_do_nothing(index_elements=["event_id"])
    )
    return int(done.rowcount or 0)


def repositories_of(conn: Connection, tenant: str) -> set[str]:
    """The repositories ``tenant`` has pushed a manifest to."""
    t = hub_events
    query = (
        select(t.c.repository)
        .where(t.c.tenant == tenant, t.c.action == "push", t.c.tag.is_not(None))
        .group_by(t.c.repository)
    )
    return {row.repository for row in conn.execute(query)}


def first_digest(conn: Connection, repository: str, tag: str) -> str | None:
    """The manifest ``repository:tag`` was first pushed with (None: no push of it is
    known yet): what the name means, whatever the tag was moved to after."""
    t = hub_events
    query = (
        select(t.c.digest)
        .where(t.c.repository == repository, t.c.tag == tag, t.c.action == "push")
        .order_by(t.c.at, t.c.event_id)
        .limit(1)
    )
    found = conn.execute(query).scalar()
    return str(found) if found is not None else None


def stored_bytes(conn: Connection, tenant: str) -> int:
    """Bytes of the distinct blobs ``tenant`` pushed (what its images hold in the hub,
    shared layers counted once per tenant)."""
    t = hub_events
    blobs = (
        select(t.c.digest, func.max(t.c.size).label("size"))
        .where(t.c.tenant == tenant, t.c.action == "push", t.c.tag.is_(None))
        .group_by(t.c.digest)
        .subquery()
    )
    return int(conn.execute(select(func.coalesce(func.sum(blobs.c.size), 0))).scalar_one())


def readers(conn: Connection) -> dict[str, frozenset[str]]:
    """Every shared repository's readers (``*``: every tenant)."""
    found: dict[str, set[str]] = {}
    for row in conn.execute(select(image_shares.c.repository, image_shares.c.reader)):
        found.setdefault(row.repository, set()).add(row.reader)
    return {repository: frozenset(names) for repository, names in found.items()}


def share(conn: Connection, repository: str, readers_: list[str], by: str) -> None:
    """Let ``readers_`` use ``repository``'s images (already allowed: unchanged)."""
    if readers_:
        rows = [{"repository": repository, "reader": r, "shared_by": by} for r in readers_]
        conn.execute(insert(image_shares).values(rows).on_conflict_do_nothing())


def unshare(conn: Connection, repository: str, readers_: list[str]) -> int:
    """Take ``readers_`` back; returns how many were there."""
    t = image_shares
    done = conn.execute(delete(t).where(t.c.repository == repository, t.c.reader.in_(readers_)))
    return int(done.rowcount or 0)


def set_readers(
    conn: Connection, repository: str, readers_: list[str], by: str, remove: bool
) -> None:
    """Share ``repository`` with ``readers_`` (by ``by``), or with ``remove`` take
    them back: what both an owner (through the token service) and an operator do."""
    if remove:
        unshare(conn, repository, readers_)
    else:
        share(conn, repository, readers_, by)
