"""Tenants' egress secrets as stored: sealed values (app/control/egress_secrets.py
seals and opens them), who set each and when."""

from __future__ import annotations

from datetime import datetime
from typing import NamedTuple

from sqlalchemy import Connection, delete, func, select
from sqlalchemy.dialects.postgresql import insert

from app.db.tables import egress_secrets


class StoredSecret(NamedTuple):
    """One row: what a tenant set for a destination's header."""

    destination: str
    header: str
    sealed: bytes
    set_by: str
    set_at: datetime


def put(conn: Connection, tenant: str, destination: str, header: str, sealed: bytes,
        by: str) -> None:  # fmt: skip
    """Set (or replace) ``tenant``'s ``header`` for ``destination``."""
    row = {
        "tenant": tenant, "destination": destination, "header_key": header.lower(),
        "header": header, "sealed": sealed, "set_by": by,
    }  # fmt: skip
    statement = insert(egress_secrets).values(row)
    conn.execute(
        statement.on_conflict_do_update(
            index_elements=["tenant", "destination", "header_key"],
            set_={"header": header, "sealed": sealed, "set_by": by, "set_at": func.now()},
        )
    )


def of_tenant(conn: Connection, tenant: str) -> list[StoredSecret]:
    """Every secret ``tenant`` holds, by destination and header."""
    t = egress_secrets
    rows = conn.execute(
        select(t.c.destination, t.c.header, t.c.sealed, t.c.set_by, t.c.set_at)
        .where(t.c.tenant == tenant)
        .order_by(t.c.destination, t.c.header_key)
    )
    return [StoredSecret(r.destination, r.header, bytes(r.sealed), r.set_by, r.set_at)
            for r in rows]  # fmt: skip


def held(conn: Connection, tenant: str, destination: str, header: str) -> bool:
    """Whether ``tenant`` has that secret already."""
    t = egress_secrets
    found = conn.execute(
        select(func.count()).where(
            t.c.tenant == tenant, t.c.destination == destination,
            t.c.header_key == header.lower(),
        )
    ).scalar_one()  # fmt: skip
    return bool(found)


def remove(conn: Connection, tenant: str, destination: str, header: str | None) -> int:
    """Delete ``tenant``'s secret for ``destination`` (``header`` None: all of them
    for it); returns how many went."""
    t = egress_secrets
    where = [t.c.tenant == tenant, t.c.destination == destination]
    if header is not None:
        where.append(t.c.header_key == header.lower())
    return int(conn.execute(delete(t).where(*where)).rowcount or 0)
