"""The control plane's keys: derived from the master key, looked up by key id.

Who owns a key id and whether it was revoked comes from the ``credentials`` table,
read again when it changed: every few seconds a one-row digest of the table
(:func:`app.db.credentials.fingerprint`) says whether it did. An unknown key id is
looked up by itself at once, so a new tenant's first request is not refused for a
stale cache; those lookups are limited (:data:`MISSES_PER_S`), so a flood of made-up
key ids costs the database little. A revocation takes effect within :data:`REFRESH_S`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

from app import secret_files
from app.bus import KafkaLogin
from app.config import Settings
from app.credentials import Credential
from app.db import credentials as stored
from app.db.credentials import CredentialRow
from app.db.engine import transaction
from app.domain.kafka_access import principal_name
from app.domain.proof import (
    SCHEDULER_KEY_ID,
    KeyInfo,
    KeyLookup,
    Principal,
    Role,
    derive_secret,
    derive_ticket_key,
    kafka_password,
)
from app.errors import ConfigError

log = logging.getLogger(__name__)

#: How often the credentials are read again (revocations take this long at most).
REFRESH_S = 5.0
#: Lookups of unknown key ids per second at most (made-up ids cost a query each).
MISSES_PER_S = 20


class Keyring(KeyLookup):
    """Keys by id for the scheduler and the projector. Thread-safe."""

    def __init__(
        self,
        master: bytes,
        load: Callable[[], Iterable[CredentialRow]],
        refresh_s: float = REFRESH_S,
        load_one: Callable[[str], CredentialRow | None] | None = None,
        fingerprint: Callable[[], str] | None = None,
    ) -> None:
        self._master = master
        self._load = load
        # Reading every row and deriving every key each REFRESH_S cost a process ~10 ms
        # of CPU with 600 keys (most of them revoked long ago): the digest is ~0.7 ms.
        self._fingerprint = fingerprint
        self._mark: str | None = None
        self._load_one = load_one
        self._misses: list[float] = []
        self._refresh_s = refresh_s
        self._lock = threading.Lock()
        self._keys: dict[str, KeyInfo] = {}
        self._loaded_at = float("-inf")
        scheduler = Principal(SCHEDULER_KEY_ID, Role.SCHEDULER, "scheduler")
        self.scheduler = KeyInfo(
            scheduler, derive_secret(master, SCHEDULER_KEY_ID, Role.SCHEDULER, "scheduler")
        )

    @classmethod
    def from_settings(cls, settings: Settings) -> Keyring:
        """The keyring of a control-plane process (reads the master key file)."""
        return cls(
            read_master(settings),
            lambda: _load_rows(settings),
            load_one=lambda key_id: _load_row(settings, key_id),
            fingerprint=lambda: _fingerprint(settings),
        )

    def ticket_key(self) -> bytes:
        return derive_ticket_key(self._master)

    def lookup(self, key_id: str) -> KeyInfo | None:
        if key_id == SCHEDULER_KEY_ID:
            return self.scheduler
        now = time.monotonic()
        with self._lock:
            if now - self._loaded_at > self._refresh_s:
                self._reload(now)
            found = self._keys.get(key_id)
            if found is not None or self._load_one is None:
                return found
            self._misses = [t for t in self._misses if now - t < 1.0]
            if len(self._misses) >= MISSES_PER_S:
                return None
            self._misses.append(now)
            try:
                row = self._load_one(key_id)
            except Exception as exc:  # as for a reload: no key, say why in the log
                log.warning("keyring: cannot look %s up (%s)", key_id, exc)
                return None
            if row is None:
                return None
            info = self._info(row)
            self._keys[key_id] = info
            return info

    def current(self, role: Role, subject: str) -> KeyInfo | None:
        with self._lock:
            if time.monotonic() - self._loaded_at > self._refresh_s:
                self._reload(time.monotonic())
            found = [
                k for k in self._keys.values()
                if k.principal.role == role and k.principal.subject == subject and not k.revoked
            ]  # fmt: skip
        return found[-1] if found else None

    def tenants(self) -> set[str]:
        """Tenants and operators with a live key (each has its own replies topic)."""
        with self._lock:
            if time.monotonic() - self._loaded_at > self._refresh_s:
                self._reload(time.monotonic())
            return {
                k.principal.subject
                for k in self._keys.values()
                if not k.revoked and k.principal.role in (Role.TENANT, Role.OPERATOR)
            }

    def revoked(self) -> set[str]:
        """Key ids revoked (read again if the cache is older than its refresh)."""
        with self._lock:
            if time.monotonic() - self._loaded_at > self._refresh_s:
                self._reload(time.monotonic())
            return {key_id for key_id, k in self._keys.items() if k.revoked}

    def _reload(self, now: float) -> None:
        try:
            # Taken before the rows: a change between the two reads them again next time.
            mark = self._fingerprint() if self._fingerprint is not None else None
            if mark is not None and mark == self._mark:
                self._loaded_at = now
                return
            rows = list(self._load())
        except Exception as exc:  # keep the keys we had: Postgres may be back soon
            log.warning(
                "keyring: cannot read credentials (%s); keeping %d keys", exc, len(self._keys)
            )
            self._loaded_at = now
            return
        self._keys = {r.key_id: self._info(r) for r in rows}
        self._mark = mark
        self._loaded_at = now

    def _info(self, row: CredentialRow) -> KeyInfo:
        return KeyInfo(
            Principal(row.key_id, row.role, row.subject),
            derive_secret(self._master, row.key_id, row.role, row.subject),
            revoked=row.revoked_at is not None,
        )


def read_master(settings: Settings) -> bytes:
    """The master key, or a :class:`ConfigError` saying where it should be."""
    path = settings.master_key_path
    try:
        return secret_files.read(path)
    except (FileNotFoundError, PermissionError) as exc:
        raise ConfigError(
            f"no master key readable at {path}: control-plane services need it "
            "(`dsec up` makes one on a local stack)"
        ) from exc


def kafka_login_for(settings: Settings, row: CredentialRow) -> KafkaLogin:
    """The Kafka principal of a recorded key, as its holder reaches the brokers: the
    brokers other hosts reach (and the CA that proves them) where the settings name
    them, else what the holder's own settings say."""
    name = principal_name(row.role, row.subject, row.key_id)
    password = kafka_password(read_master(settings), name)
    bootstrap = settings.kafka_credential_bootstrap
    if bootstrap is None:
        return KafkaLogin(name, password)
    ca = settings.ca_dir / "ca.pem"
    return KafkaLogin(
        name, password, bootstrap=bootstrap, security_protocol="SASL_SSL",
        mechanism=settings.kafka_sasl_mechanism,
        ca_pem=ca.read_text() if ca.exists() else None,
    )  # fmt: skip


def credential_for(settings: Settings, row: CredentialRow) -> Credential:
    """The credential file's content for a recorded key (its holder's copy)."""
    return Credential(
        key_id=row.key_id,
        secret=derive_secret(read_master(settings), row.key_id, row.role, row.subject),
        role=row.role,
        subject=row.subject,
        kafka=kafka_login_for(settings, row),
    )


def _load_rows(settings: Settings) -> list[CredentialRow]:
    with transaction(settings.database_url) as conn:
        return stored.load(conn)


def _fingerprint(settings: Settings) -> str:
    with transaction(settings.database_url) as conn:
        return stored.fingerprint(conn)


def _load_row(settings: Settings, key_id: str) -> CredentialRow | None:
    with transaction(settings.database_url) as conn:
        return stored.find(conn, key_id)
