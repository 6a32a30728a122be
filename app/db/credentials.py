"""The credentials table: issue, list, revoke (the owner role), load (any service)."""

from __future__ import annotations

import getpass
import secrets
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Connection, func, insert, literal, select, update
from sqlalchemy.dialects.postgresql import aggregate_order_by

from app.db.tables import credentials
from app.domain.proof import Role


@dataclass(frozen=True)
class CredentialRow:
    """One credential as the platform records it (no secret)."""

    key_id: str
    role: Role
    subject: str
    label: str
    created_at: datetime
    created_by: str
    revoked_at: datetime | None


def new_key_id() -> str:
    """A fresh key id (not a secret: it names a key, the master key makes it)."""
    return "k-" + secrets.token_hex(8)


def _operator() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown"


def issue(conn: Connection, role: Role, subject: str, label: str = "") -> CredentialRow:
    """Record a new credential for ``subject``; returns it (its key comes from the
    master key, see app/control/keyring.py)."""
    row = conn.execute(
        insert(credentials)
        .values(key_id=new_key_id(), role=role.value, subject=subject, label=label,
                created_by=_operator())
        .returning(*credentials.c)
    ).one()  # fmt: skip
    return _row(row)


def revoke(conn: Connection, *, key_id: str | None = None, subject: str | None = None,
           role: Role | None = None, keep: str | None = None) -> list[CredentialRow]:  # fmt: skip
    """Revoke one key, or every live key of a subject (but ``keep``); returns them."""
    query = update(credentials).where(credentials.c.revoked_at.is_(None))
    if key_id is not None:
        query = query.where(credentials.c.key_id == key_id)
    if subject is not None:
        query = query.where(credentials.c.subject == subject)
    if role is not None:
        query = query.where(credentials.c.role == role.value)
    if keep is not None:
        query = query.where(credentials.c.key_id != keep)
    rows = conn.execute(
        query.values(revoked_at=datetime.now().astimezone(), revoked_by=_operator()).returning(
            *credentials.c
        )
    ).all()
    return [_row(r) for r in rows]


def load(conn: Connection, role: Role | None = None, subject: str | None = None
         ) -> list[CredentialRow]:  # fmt: skip
    """Every credential (optionally of one role or subject), oldest first."""
    query = select(credentials).order_by(credentials.c.created_at, credentials.c.key_id)
    if role is not None:
        query = query.where(credentials.c.role == role.value)
    if subject is not None:
        query = query.where(credentials.c.subject == subject)
    return [_row(r) for r in conn.execute(query).all()]


def fingerprint(conn: Connection) -> str:
    """A digest of every credential's id, owner and revocation: it changes whenever a
    key is issued, revoked or removed, so a reader that keeps the table in memory asks
    this one-row question instead of reading every row again."""
    t = credentials
    line = func.concat_ws(":", t.c.key_id, t.c.role, t.c.subject, t.c.revoked_at)
    joined = func.string_agg(line, aggregate_order_by(literal(","), t.c.key_id))
    digest = func.md5(func.coalesce(joined, ""))
    return str(conn.execute(select(digest)).scalar_one())


def find(conn: Connection, key_id: str) -> CredentialRow | None:
    """One credential by key id."""
    row = conn.execute(select(credentials).where(credentials.c.key_id == key_id)).first()
    return _row(row) if row is not None else None


def _row(row: object) -> CredentialRow:
    m = row._mapping  # type: ignore[attr-defined]
    return CredentialRow(
        key_id=m["key_id"], role=Role(m["role"]), subject=m["subject"], label=m["label"],
        created_at=m["created_at"], created_by=m["created_by"], revoked_at=m["revoked_at"],
    )  # fmt: skip
