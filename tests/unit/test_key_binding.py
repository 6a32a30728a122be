"""What the database stores never grants power: a key's role and owner are bound into
the key itself, so a credentials row changed by whoever can write the table (a
superuser reached without a password, a stolen backup restored) demotes nothing and
promotes nobody: the holder's key no longer proves anything."""

from __future__ import annotations

import os
from datetime import UTC, datetime

from app.control.keyring import Keyring
from app.db.credentials import CredentialRow
from app.domain.proof import ProofError, Purpose, Role, derive_secret, headers, verify
from app.domain.trust import REQUEST_SENDERS

MASTER = os.urandom(32)


def _row(role: Role, subject: str = "team-a") -> CredentialRow:
    return CredentialRow("k-abc123", role, subject, "", datetime.now(UTC), "test", None)


def test_the_key_depends_on_its_role_and_owner() -> None:
    tenant = derive_secret(MASTER, "k-abc123", Role.TENANT, "team-a")
    assert tenant != derive_secret(MASTER, "k-abc123", Role.OPERATOR, "team-a")
    assert tenant != derive_secret(MASTER, "k-abc123", Role.TENANT, "team-b")


def test_a_tenant_key_promoted_in_the_table_proves_nothing() -> None:
    # Given a tenant's key, as its holder has it
    held = derive_secret(MASTER, "k-abc123", Role.TENANT, "team-a")
    value = b'{"type": "Exec"}'
    proof = headers(Purpose.REQUEST, "k-abc123", held, value)
    # When someone rewrites its row to make it an operator's (or another tenant's)
    for forged in (_row(Role.OPERATOR), _row(Role.TENANT, "team-b")):
        keys = Keyring(MASTER, lambda f=forged: [f])
        # Then the holder's requests no longer verify at all: no power was gained
        try:
            verify(Purpose.REQUEST, value, proof, keys, REQUEST_SENDERS)
        except ProofError as exc:
            assert exc.failure.value == "bad_mac"
        else:
            raise AssertionError("a promoted row let the old key's proof through")
    # while the row as issued still verifies it as the tenant it is
    keys = Keyring(MASTER, lambda: [_row(Role.TENANT)])
    principal = verify(Purpose.REQUEST, value, proof, keys, REQUEST_SENDERS)
    assert principal.role == Role.TENANT and principal.subject == "team-a"
