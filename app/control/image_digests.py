"""What each tenant image name means, as the schedulers hand it to nodes: the digest
its tag was first pushed with (``hub_events``). A tag moved after, by a client that
skips the SDK's refusal, changes nothing a node runs under the name.

A name's first push never changes, so a digest found is kept; a name with none known
yet (a push whose report is on its way) is asked again after :data:`RETRY_S`, and
meanwhile goes unpinned, as does every name while Postgres does not answer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from app.config import Settings
from app.db import hub_events
from app.db.engine import transaction
from app.domain.hub_access import hub_reference, owner_of

log = logging.getLogger(__name__)

#: How soon a name without a known push is asked again.
RETRY_S = 2.0
#: Names kept at most (the oldest found go first).
KEEP = 100_000


class StoredDigests:
    """``digest_of(image)``: the digest a tenant's image name was first pushed with."""

    def __init__(self, load: Callable[[str, str], str | None], retry_s: float = RETRY_S) -> None:
        self._load = load
        self._retry_s = retry_s
        self._found: dict[tuple[str, str], str] = {}
        self._missed: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings: Settings) -> StoredDigests:
        def load(repository: str, tag: str) -> str | None:
            with transaction(settings.database_url) as conn:
                return hub_events.first_digest(conn, repository, tag)

        return cls(load)

    def digest_of(self, image: str) -> str | None:
        """The digest ``image`` means, or None (not a tenant's image, or unknown)."""
        ref = hub_reference(image)
        if ref is None or owner_of(ref.repository) is None:
            return None  # the platform's images are an operator's to replace
        key = (ref.repository, ref.tag)
        now = time.monotonic()
        with self._lock:
            found = self._found.get(key)
            if found is not None or now < self._missed.get(key, 0.0):
                return found
        try:
            found = self._load(*key)
        except Exception as exc:  # unpinned rather than refused: Postgres may be back soon
            log.warning("image digests: cannot read %s (%s)", image, exc)
            found = None
        with self._lock:
            if found is None:
                self._missed[key] = now + self._retry_s
            else:
                self._missed.pop(key, None)
                if len(self._found) >= KEEP:
                    self._found.pop(next(iter(self._found)))
                self._found[key] = found
        return found
