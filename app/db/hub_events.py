"""The image hub's tables: its audit trail (``hub_events``), appended by the token
service as the registry reports and read by operators (SQL) and by the token service
(a tenant's repositories, for its images quota); and who else may use a tenant's
images (``image_shares``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, Connection, DateTime, Text, column, delete, func, select, table
from sqlalchemy.dialects.postgresql import insert

from app.db.tables import hub_events, image_shares
from app.domain.hub_access import readers_refusal
from app.domain.hub_events import HubEvent
from app.errors import StorageRefused


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
    """The repositories where ``tenant`` holds an image: a manifest pushed with a tag
    and not deleted since (a repository whose images were all deleted is free again)."""
    p, d = hub_events.alias("p"), hub_events.alias("d")
    deleted_since = (
        select(d.c.event_id)
        .where(
            d.c.action == "delete",
            d.c.repository == p.c.repository,
            d.c.digest == p.c.digest,
            d.c.at >= p.c.at,
        )
        .exists()
    )
    query = (
        select(p.c.repository)
        .where(p.c.tenant == tenant, p.c.action == "push", p.c.tag.is_not(None), ~deleted_since)
        .group_by(p.c.repository)
    )
    return {row.repository for row in conn.execute(query)}


@dataclass(frozen=True)
class NamePin:
    """What ``repository:tag`` means now: the manifest of its first push since its last
    deletion (``digest``), or that it was deleted and not pushed again (``deleted``);
    neither: no push of it is known yet."""

    digest: str | None
    deleted: bool = False


def name_pin(conn: Connection, repository: str, tag: str) -> NamePin:
    """What ``repository:tag`` means (:class:`NamePin`): a name keeps its first push,
    whatever the tag was moved to after, until a deletion of content it was pushed
    with; the first push after that is what it means from then on."""
    t = hub_events
    pushes = conn.execute(
        select(t.c.digest, t.c.at)
        .where(t.c.repository == repository, t.c.tag == tag, t.c.action == "push")
        .order_by(t.c.at, t.c.event_id)
    ).all()
    if not pushes:
        return NamePin(None)
    deleted = conn.execute(
        select(t.c.digest, func.max(t.c.at))
        .where(
            t.c.action == "delete",
            t.c.repository == repository,
            t.c.digest.in_({row.digest for row in pushes}),
        )
        .group_by(t.c.digest)
    ).all()
    first = _first_live(pushes, dict(deleted))
    return NamePin(str(first.digest)) if first is not None else NamePin(None, deleted=True)


def _first_live(pushes: Sequence[Any], deleted: Mapping[str, datetime]) -> Any | None:
    """Of a name's pushes (oldest first, each with its ``digest`` and ``at``), the one it
    means: the first after the last deletion (``deleted``: when each digest was last
    deleted in the name's repository) of content it was pushed with; None: deleted."""
    times = [deleted[row.digest] for row in pushes if row.digest in deleted]
    deleted_at = max(times, default=None)
    return next((row for row in pushes if deleted_at is None or row.at > deleted_at), None)


def last_deletion(conn: Connection) -> datetime | None:
    """When the hub last reported a deletion (what a cache of names checks against)."""
    t = hub_events
    return conn.execute(select(func.max(t.c.recorded_at)).where(t.c.action == "delete")).scalar()


@dataclass(frozen=True)
class HeldImage:
    """One of a tenant's images the hub holds, as its owner lists them."""

    name: str
    digest: str
    pushed_at: datetime
    #: Its manifest, configuration and layers (shared ones counted in each image).
    size: int


def images_of(conn: Connection, tenant: str) -> list[HeldImage]:
    """``tenant``'s images the hub holds: each name whose meaning was not deleted
    (what :func:`name_pin` says of each, in two queries for all of them)."""
    t = hub_events
    rows = conn.execute(
        select(t.c.repository, t.c.tag, t.c.digest, t.c.at, t.c.size, t.c.refs)
        .where(t.c.tenant == tenant, t.c.action == "push", t.c.tag.is_not(None))
        .order_by(t.c.at, t.c.event_id)
    ).all()
    deleted: dict[str, dict[str, datetime]] = {}
    for repository, digest, at in conn.execute(
        select(t.c.repository, t.c.digest, func.max(t.c.at))
        .where(t.c.tenant == tenant, t.c.action == "delete")
        .group_by(t.c.repository, t.c.digest)
    ):
        deleted.setdefault(repository, {})[digest] = at
    names: dict[tuple[str, str], list[Any]] = {}
    for row in rows:
        names.setdefault((row.repository, row.tag), []).append(row)
    held: list[HeldImage] = []
    for (repository, tag), pushes in names.items():
        first = _first_live(pushes, deleted.get(repository, {}))
        if first is not None:
            size = first.size + sum(int(ref.get("size", 0)) for ref in first.refs or ())
            held.append(HeldImage(f"{repository}:{tag}", str(first.digest), first.at, size))
    return held


#: Every blob a tenant's images hold or held (migration 0019): from its first push
#: until the last manifest referencing it was deleted (``released_at``; None: held).
hub_blobs = table(
    "hub_blobs",
    column("tenant", Text),
    column("job", Text),
    column("digest", Text),
    column("size", BigInteger),
    column("first_at", DateTime(timezone=True)),
    column("released_at", DateTime(timezone=True)),
)


def stored_bytes(conn: Connection, tenant: str) -> int:
    """Bytes of the distinct blobs ``tenant``'s images hold in the hub now (shared
    layers counted once per tenant; what it deleted no longer counts)."""
    b = hub_blobs
    blobs = (
        select(b.c.digest, func.max(b.c.size).label("size"))
        .where(b.c.tenant == tenant, b.c.released_at.is_(None))
        .group_by(b.c.digest)
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
    """Let ``readers_`` use ``repository``'s images (already allowed: unchanged);
    raises :class:`StorageRefused` (nothing shared) past
    :data:`~app.domain.hub_access.MAX_SHARED_READERS` readers in all."""
    if not readers_:
        return
    t = image_shares
    # One share of a repository at a time: two at once must not both pass the count.
    conn.execute(select(func.pg_advisory_xact_lock(func.hashtext(repository))))
    rows = [{"repository": repository, "reader": r, "shared_by": by} for r in readers_]
    conn.execute(insert(t).values(rows).on_conflict_do_nothing())
    held = conn.execute(
        select(func.count()).select_from(t).where(t.c.repository == repository)
    ).scalar_one()
    refused = readers_refusal(repository, int(held))
    if refused is not None:
        raise StorageRefused(refused)  # the transaction rolls back what it inserted


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
