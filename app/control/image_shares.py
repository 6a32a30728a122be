"""Who besides their owners may use tenants' images, as the schedulers and the hub's
token service see it: ``image_shares`` read again every few seconds (a share or an
unshare takes effect within :data:`REFRESH_S`), the last known kept while Postgres
does not answer."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from app.config import Settings
from app.db import hub_events
from app.db.engine import transaction

log = logging.getLogger(__name__)

#: How often the shares are read again.
REFRESH_S = 5.0


class StoredShares:
    """``readers(repository)``: the tenants (or ``*``) a repository is shared with."""

    def __init__(
        self, load: Callable[[], dict[str, frozenset[str]]], refresh_s: float = REFRESH_S
    ) -> None:
        self._load = load
        self._refresh_s = refresh_s
        self._shares: dict[str, frozenset[str]] = {}
        self._loaded_at = float("-inf")
        self._lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings: Settings) -> StoredShares:
        def load() -> dict[str, frozenset[str]]:
            with transaction(settings.database_url) as conn:
                return hub_events.readers(conn)

        return cls(load)

    def readers(self, repository: str) -> frozenset[str]:
        now = time.monotonic()
        with self._lock:
            if now - self._loaded_at > self._refresh_s:
                self._loaded_at = now
                try:
                    self._shares = self._load()
                except Exception as exc:  # keep the last: Postgres may be back soon
                    log.warning("image shares: cannot read them (%s); keeping the last", exc)
            return self._shares.get(repository, frozenset())
