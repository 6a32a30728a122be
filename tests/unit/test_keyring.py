"""The keyring reads the credentials again only when their digest says they changed,
and a revocation still takes effect at the next refresh."""

from __future__ import annotations

import os
from dataclasses import replace
from datetime import UTC, datetime

from app.control.keyring import Keyring
from app.db.credentials import CredentialRow
from app.domain.proof import Role

MASTER = os.urandom(32)


class Table:
    """A credentials table in memory, counting how often it is read whole."""

    def __init__(self, *rows: CredentialRow) -> None:
        self.rows = list(rows)
        self.reads = 0
        self.down = False

    def load(self) -> list[CredentialRow]:
        self.reads += 1
        return list(self.rows)

    def fingerprint(self) -> str:
        if self.down:
            raise ConnectionError("Postgres is gone")
        return repr(self.rows)


def _row(key_id: str, subject: str) -> CredentialRow:
    return CredentialRow(key_id, Role.TENANT, subject, "", datetime.now(UTC), "test", None)


def _keyring(table: Table) -> Keyring:
    # refresh 0: every question is a refresh
    return Keyring(MASTER, table.load, refresh_s=0, fingerprint=table.fingerprint)


def test_an_unchanged_table_is_not_read_again() -> None:
    table = Table(_row("k-1", "team-a"), _row("k-2", "team-b"))
    keys = _keyring(table)
    for _ in range(5):
        assert keys.tenants() == {"team-a", "team-b"}
    assert table.reads == 1


def test_a_revocation_and_a_new_key_are_seen_at_the_next_refresh() -> None:
    table = Table(_row("k-1", "team-a"))
    keys = _keyring(table)
    assert keys.lookup("k-1") is not None and not keys.revoked()
    table.rows = [replace(table.rows[0], revoked_at=datetime.now(UTC)), _row("k-2", "team-b")]
    assert keys.revoked() == {"k-1"}
    assert keys.tenants() == {"team-b"}
    assert table.reads == 2


def test_keys_are_kept_while_the_table_cannot_be_read() -> None:
    table = Table(_row("k-1", "team-a"))
    keys = _keyring(table)
    assert keys.tenants() == {"team-a"}
    table.down = True
    assert keys.tenants() == {"team-a"}
    table.down = False
    table.rows = []
    assert keys.tenants() == set()
