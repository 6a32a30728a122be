"""Credentials as an operator manages them: tenants, operators and nodes.

Issuing a credential records its key id and owner in Postgres (as the owner role: the
services' role may only read them), makes its Kafka principal with the ACLs of its
role (app/domain/kafka_access.py), and writes the holder's copy (key id, key and
Kafka password, all derived from the master key) to a root-only file; a tenant's
replies topic and a node's inbox are made with it. Revoking removes the principal at
once (the broker refuses its next request) and the key within the keyring's refresh
(app/control/keyring.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from app import credentials, kafka_admin
from app.config import Settings
from app.control.keyring import credential_for, kafka_login_for
from app.credentials import Credential
from app.db import credentials as stored
from app.db.credentials import CredentialRow
from app.db.engine import transaction
from app.domain.kafka_access import Grant, key_grants
from app.domain.proof import SUBJECT, Role
from app.errors import ConfigError


@dataclass(frozen=True)
class Issued:
    """A credential just made, and where its holder's copy was written."""

    row: CredentialRow
    path: Path


def _check_name(name: str) -> None:
    if not SUBJECT.match(name):
        raise ConfigError(
            f"{name!r} is not a valid name: 2-63 characters of a-z, 0-9, '.', '_', '-', "
            "starting with a letter or digit (it names a Kafka topic)"
        )


def _file_for(settings: Settings, row: CredentialRow) -> Path:
    if row.role == Role.NODE:
        return credentials.node_file(settings, row.subject)
    return credentials.tenant_file(settings, row.subject)


def issue(
    settings: Settings, role: Role, subject: str, label: str = "", out: Path | None = None
) -> Issued:
    """A new credential for ``subject`` (written to ``out`` or the local default path)."""
    _check_name(subject)
    with transaction(settings.admin_database_url) as conn:
        existing = stored.load(conn, subject=subject)
        if any(r.role != role and r.revoked_at is None for r in existing):
            raise ConfigError(f"{subject!r} already holds live credentials of another role")
        row = stored.issue(conn, role, subject, label)
    _topics(settings, row)
    enable(settings, [row])
    path = credentials.save(credential_for(settings, row), out or _file_for(settings, row))
    return Issued(row, path)


def _topics(settings: Settings, row: CredentialRow) -> None:
    """A tenant's replies topic, a node's inbox."""
    if row.role in (Role.TENANT, Role.OPERATOR):
        kafka_admin.ensure_topics(settings, [row.subject], platform=False)
    elif row.role == Role.NODE:
        kafka_admin.ensure_topics(settings, nodes=[row.subject], platform=False)


def grants_of(settings: Settings, rows: list[CredentialRow]) -> list[Grant]:
    """The ACLs of ``rows``' principals for the settings' topic prefix."""
    return [
        grant
        for row in rows
        for grant in key_grants(
            settings.topic_prefix, row.role, row.subject, kafka_login_for(settings, row).username
        )
    ]


def live_keys(settings: Settings, subjects: list[str]) -> list[CredentialRow]:
    """The live keys of ``subjects``."""
    return [r for r in listing(settings) if r.subject in subjects and r.revoked_at is None]


def enable(settings: Settings, rows: list[CredentialRow]) -> None:
    """Make the Kafka principals of ``rows`` (keys) with the ACLs of their roles."""
    logins = [kafka_login_for(settings, row) for row in rows]
    kafka_admin.set_principals(settings, [(login.username, login.password) for login in logins])
    kafka_admin.grant(settings, grants_of(settings, rows))


def disable(settings: Settings, rows: list[CredentialRow]) -> None:
    """Remove the Kafka principals of ``rows`` and their ACLs."""
    kafka_admin.remove_principals(settings, [kafka_login_for(settings, r).username for r in rows])


def sync_kafka(settings: Settings) -> None:
    """Make the broker's principals match the credentials: every live key's principal
    with its ACLs, none for a revoked key (`dsec up` runs it: a broker formatted
    anew, or one that missed a revocation, is put right)."""
    rows = listing(settings)
    enable(settings, [r for r in rows if r.revoked_at is None])
    known = kafka_admin.principals(settings)
    revoked = [r for r in rows if r.revoked_at is not None]
    disable(settings, [r for r in revoked if kafka_login_for(settings, r).username in known])


def ensure(settings: Settings, role: Role, subject: str) -> Issued | None:
    """A live credential of ``subject`` with a local copy; None if one was there already.
    (``dsec up`` makes the local stack's own this way, idempotently.)"""
    with transaction(settings.admin_database_url) as conn:
        live = [r for r in stored.load(conn, role, subject) if r.revoked_at is None]
    if live:
        row = live[-1]
        path = _file_for(settings, row)
        try:
            held = credentials.load(path)
        except ConfigError:
            held = None
        wanted = credential_for(settings, row)
        if held != wanted:
            credentials.save(wanted, path)
        _topics(settings, row)
        return None
    return issue(settings, role, subject, "made by dsec up")


def local(settings: Settings, subject: str, role: Role = Role.TENANT) -> Credential:
    """The local credential of ``subject``, made first if missing: what the demo, the
    benchmarks and the tests on the stack's own machine connect with."""
    ensure(settings, role, subject)
    return credentials.load(credentials.tenant_file(settings, subject))


def rotate(
    settings: Settings, subject: str, out: Path | None = None, *, revoke_old: bool = True
) -> Issued:
    """A new key for ``subject`` (same role); its older keys are revoked unless
    ``revoke_old`` is false (then both hold until `dsec tenant revoke KEY_ID`)."""
    with transaction(settings.admin_database_url) as conn:
        live = [r for r in stored.load(conn, subject=subject) if r.revoked_at is None]
    if not live:
        raise ConfigError(f"{subject!r} has no live credential to rotate")
    issued = issue(settings, live[-1].role, subject, "rotated", out)
    if revoke_old:
        with transaction(settings.admin_database_url) as conn:
            gone = stored.revoke(conn, subject=subject, keep=issued.row.key_id)
        disable(settings, gone)
    return issued


def revoke(settings: Settings, target: str) -> list[CredentialRow]:
    """Revoke one key (by id) or every key of a tenant or node (by name)."""
    with transaction(settings.admin_database_url) as conn:
        if target.startswith("k-"):
            gone = stored.revoke(conn, key_id=target)
        else:
            gone = stored.revoke(conn, subject=target)
    disable(settings, gone)
    return gone


def listing(settings: Settings, role: Role | None = None) -> list[CredentialRow]:
    """Every credential (no secrets)."""
    with transaction(settings.database_url) as conn:
        return stored.load(conn, role)


def reply_subjects(settings: Settings) -> list[str]:
    """Tenants and operators with a live key: those whose replies topics must exist."""
    return sorted(
        {
            row.subject
            for row in listing(settings)
            if row.role in (Role.TENANT, Role.OPERATOR) and row.revoked_at is None
        }
    )
