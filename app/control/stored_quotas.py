"""Tenants' quotas as stored: the settings' defaults with the limits an operator set
for a tenant (``dsec tenant quota``, in Postgres).

The scheduler reads the stored limits again every :data:`REFRESH_S`, as the keyring
reads revocations: a change takes effect within that on every scheduler. If Postgres
cannot be read, the limits read last hold (and the defaults, before any read).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum

from app.config import Settings
from app.control.quotas import default_quota
from app.db import quotas as stored
from app.db.engine import transaction
from app.db.quotas import Overrides
from app.domain.quotas import Limit, Quota, Resource

log = logging.getLogger(__name__)

#: How often the stored limits are read again.
REFRESH_S = 5.0


class StoredQuotas:
    """Every tenant's quota for the scheduler (a :class:`app.control.quotas.QuotaLookup`)."""

    def __init__(
        self, settings: Settings, load: Callable[[], Overrides], refresh_s: float = REFRESH_S
    ) -> None:
        self._settings = settings
        self._load = load
        self._refresh_s = refresh_s
        self._overrides: Overrides = {}
        self._known: dict[str, Quota] = {}
        self._loaded_at = float("-inf")

    @classmethod
    def from_settings(cls, settings: Settings) -> StoredQuotas:
        return cls(settings, lambda: _load(settings))

    def of(self, tenant: str) -> Quota:
        now = time.monotonic()
        if now - self._loaded_at > self._refresh_s:
            self._reload(now)
        found = self._known.get(tenant)
        if found is None:
            default = default_quota(self._settings, tenant)
            found = self._known[tenant] = default.overridden(self._overrides.get(tenant, {}))
        return found

    def _reload(self, now: float) -> None:
        self._loaded_at = now
        try:
            overrides = self._load()
        except Exception as exc:  # keep the limits we had: Postgres may be back soon
            log.warning("quotas: cannot read the stored limits (%s); keeping the last", exc)
            return
        self._overrides = overrides
        self._known = {}


def _load(settings: Settings) -> Overrides:
    with transaction(settings.database_url) as conn:
        return stored.load(conn)


@dataclass(frozen=True)
class Held:
    """One of a tenant's limits, and where it comes from."""

    resource: Resource
    limit: Limit
    #: "tenant" (an operator set it for this tenant) or "default" (the settings').
    source: str


class Back(Enum):
    """A tenant's own limit given up: the settings' default holds again."""

    DEFAULT = "default"


#: What ``change`` sets a limit to: a number, None (no limit), or back to the default.
Change = Limit | Back


def change(settings: Settings, tenant: str, changes: Mapping[Resource, Change]) -> list[Held]:
    """Set ``tenant``'s own limits (as the owner role); returns all its limits now."""
    own = {r: n for r, n in changes.items() if not isinstance(n, Back)}
    back = [r for r, n in changes.items() if isinstance(n, Back)]
    with transaction(settings.admin_database_url) as conn:
        stored.set_limits(conn, tenant, own)
        stored.reset(conn, tenant, back)
    return limits(settings, tenant)


def limits(settings: Settings, tenant: str) -> list[Held]:
    """``tenant``'s limits, each with where it comes from."""
    with transaction(settings.database_url) as conn:
        own = stored.load(conn, tenant).get(tenant, {})
    default = default_quota(settings, tenant)
    return [
        Held(r, own[r], "tenant") if r in own else Held(r, default.limit(r), "default")
        for r in Resource
    ]
