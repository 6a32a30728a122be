"""Tenants' egress secrets on the control plane: sealed at rest under the platform's
key, set and listed through the hub's token service (``/secrets``, the tenant's own
login), and handed by the schedulers to the node of each sandbox whose allowlist
reaches their destination (sealed again for that node: app/domain/node_tasks.py).

A value is AES-256-GCM under a key derived from the master key, its tenant,
destination and header bound in as associated data: a row copied to another tenant
or header does not open. Values are never logged, listed or put in an event; who set
which secret, and when, is in the table.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from pydantic import ValidationError

from app.config import Settings
from app.control.keyring import read_master
from app.db import egress_secrets as table
from app.db.engine import transaction
from app.domain.egress import MAX_SECRETS, EgressSecret, NetworkPolicy, carries

log = logging.getLogger(__name__)

#: How long a scheduler keeps a tenant's secrets before reading them again (a new or
#: changed secret reaches sandboxes created after that).
REFRESH_S = 5.0


class SecretVault:
    """Seals and opens stored values under the master-derived secrets key."""

    def __init__(self, master: bytes) -> None:
        self._cipher = AESGCM(hmac.digest(master, b"dsec egress secrets v1", hashlib.sha256))

    @staticmethod
    def _bound(tenant: str, destination: str, header: str) -> bytes:
        return f"{tenant}\n{destination}\n{header.lower()}".encode()

    def seal(self, tenant: str, secret: EgressSecret) -> bytes:
        nonce = os.urandom(12)
        plain = secret.value.get_secret_value().encode()
        bound = self._bound(tenant, secret.destination, secret.header)
        return nonce + self._cipher.encrypt(nonce, plain, bound)

    def open(self, tenant: str, row: table.StoredSecret) -> EgressSecret | None:
        """The secret a row holds; None (logged) if it does not open as its tenant's."""
        try:
            bound = self._bound(tenant, row.destination, row.header)
            plain = self._cipher.decrypt(row.sealed[:12], row.sealed[12:], bound)
            return EgressSecret(destination=row.destination, header=row.header,
                                value=plain.decode())  # fmt: skip
        except (InvalidTag, ValueError):
            log.error("egress secret of %s for %s does not open: skipped", tenant, row.destination)
            return None


class StoredSecrets:
    """The schedulers' view: a tenant's secrets, read again every :data:`REFRESH_S`
    (the last known kept while Postgres does not answer)."""

    def __init__(
        self,
        vault: SecretVault,
        load: Callable[[str], list[table.StoredSecret]],
        refresh_s: float = REFRESH_S,
    ) -> None:
        self._vault = vault
        self._load = load
        self._refresh_s = refresh_s
        self._known: dict[str, tuple[float, list[EgressSecret]]] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings: Settings) -> StoredSecrets:
        def load(tenant: str) -> list[table.StoredSecret]:
            with transaction(settings.database_url) as conn:
                return table.of_tenant(conn, tenant)

        return cls(SecretVault(read_master(settings)), load)

    def for_sandbox(self, tenant: str, policy: NetworkPolicy) -> list[EgressSecret]:
        """The secrets a sandbox of ``tenant`` with allowlist ``policy`` carries."""
        return [s for s in self._of(tenant) if carries(policy, s.destination)]

    def _of(self, tenant: str) -> list[EgressSecret]:
        now = time.monotonic()
        with self._lock:
            known = self._known.get(tenant)
            if known is not None and now - known[0] <= self._refresh_s:
                return known[1]
            try:
                opened = [self._vault.open(tenant, row) for row in self._load(tenant)]
                found = [secret for secret in opened if secret is not None]
            except Exception as exc:  # keep the last: Postgres may be back soon
                log.warning("egress secrets of %s: cannot read them (%s)", tenant, exc)
                found = known[1] if known is not None else []
            self._known[tenant] = (now, found)
            return found


class SecretsService:
    """``/secrets`` on the hub's token service: a tenant sets (PUT), lists (GET, no
    values) and deletes (DELETE) its own secrets; answers (status, JSON body)."""

    def __init__(self, settings: Settings) -> None:
        self._url = settings.database_url
        self._vault = SecretVault(read_master(settings))

    def handle(self, method: str, tenant: str, by: str, body: Any) -> tuple[int, dict[str, Any]]:
        if method == "GET":
            with transaction(self._url) as conn:
                rows = table.of_tenant(conn, tenant)
            return 200, {"secrets": [
                {"destination": r.destination, "header": r.header, "set_by": r.set_by,
                 "set_at": r.set_at.isoformat()}
                for r in rows
            ]}  # fmt: skip
        if not isinstance(body, dict):
            return 400, _error("INVALID", "a JSON object")
        if method == "PUT":
            try:
                secret = EgressSecret.model_validate(body)
            except ValidationError as exc:
                return 400, _error("INVALID", _without_input(exc))
            with transaction(self._url) as conn:
                new = not table.held(conn, tenant, secret.destination, secret.header)
                if new and len(table.of_tenant(conn, tenant)) >= MAX_SECRETS:
                    return 403, _error("DENIED", f"at most {MAX_SECRETS} secrets per tenant")
                sealed = self._vault.seal(tenant, secret)
                table.put(conn, tenant, secret.destination, secret.header, sealed, by)
            log.info("egress secrets: %s set %s for %s", by, secret.header, secret.destination)
            return 200, {"destination": secret.destination, "header": secret.header}
        if method == "DELETE":
            destination, header = body.get("destination"), body.get("header")
            if not isinstance(destination, str) or not isinstance(header, str | None):
                return 400, _error("INVALID", "destination (and header) are strings")
            with transaction(self._url) as conn:
                removed = table.remove(conn, tenant, destination.lower().rstrip("."), header)
            log.info("egress secrets: %s deleted %d for %s", by, removed, destination[:253])
            return 200, {"removed": removed}
        return 405, _error("UNSUPPORTED", method)


def _error(code: str, message: str) -> dict[str, Any]:
    return {"errors": [{"code": code, "message": message[:500]}]}


def _without_input(exc: ValidationError) -> str:
    """What is wrong, without echoing what was sent (a value is a secret)."""
    return json.dumps(
        [{"field": ".".join(map(str, e["loc"])), "problem": e["msg"]} for e in exc.errors()]
    )
