"""What each tenant image name means, as the schedulers hand it to nodes: the digest
its tag was first pushed with (``hub_events``). A tag moved after, by a client that
skips the SDK's refusal, changes nothing a node runs under the name; a deletion of
that content ends it (creates of the name are refused until it is pushed again).

A name's meaning changes only by a deletion, so a digest found is kept until the hub
reports a deletion (looked for every :data:`CHECK_S`); a name with none known yet (a
push whose report is on its way) or a deleted one is asked again after
:data:`RETRY_S`, and meanwhile goes unpinned (or refused), as does every name while
Postgres does not answer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import datetime

from app.config import Settings
from app.db import hub_events
from app.db.engine import transaction
from app.db.hub_events import NamePin
from app.domain.hub_access import hub_reference, owner_of

log = logging.getLogger(__name__)

#: How soon a name without a known push is asked again.
RETRY_S = 2.0
#: How often the hub's last deletion is looked for.
CHECK_S = 5.0
#: Names kept at most (the oldest found go first).
KEEP = 100_000


class StoredDigests:
    """``digest_of(image)``: the digest a tenant's image name was first pushed with;
    ``deleted(image)``: that content was deleted and the name not pushed again."""

    def __init__(
        self,
        load: Callable[[str, str], NamePin],
        deletions: Callable[[], datetime | None] = lambda: None,
        retry_s: float = RETRY_S,
        check_s: float = CHECK_S,
    ) -> None:
        self._load = load
        self._deletions = deletions
        self._retry_s = retry_s
        self._check_s = check_s
        self._found: dict[tuple[str, str], str] = {}
        self._missed: dict[tuple[str, str], tuple[float, NamePin]] = {}
        self._last_deletion: datetime | None = None
        self._checked = float("-inf")
        self._lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings: Settings) -> StoredDigests:
        def load(repository: str, tag: str) -> NamePin:
            with transaction(settings.database_url) as conn:
                return hub_events.name_pin(conn, repository, tag)

        def deletions() -> datetime | None:
            with transaction(settings.database_url) as conn:
                return hub_events.last_deletion(conn)

        return cls(load, deletions)

    def digest_of(self, image: str) -> str | None:
        """The digest ``image`` means, or None (not a tenant's image, unknown, deleted)."""
        pin = self._pin(image)
        return pin.digest if pin is not None else None

    def deleted(self, image: str) -> bool:
        """Whether ``image`` names a tenant's image whose content was deleted."""
        pin = self._pin(image)
        return pin is not None and pin.deleted

    def _pin(self, image: str) -> NamePin | None:
        ref = hub_reference(image)
        if ref is None or owner_of(ref.repository) is None:
            return None  # the platform's images are an operator's to replace
        key = (ref.repository, ref.tag)
        now = time.monotonic()
        self._forget_if_deleted(now)
        with self._lock:
            found = self._found.get(key)
            if found is not None:
                return NamePin(found)
            missed = self._missed.get(key)
            if missed is not None and now < missed[0]:
                return missed[1]
        try:
            pin = self._load(*key)
        except Exception as exc:  # unpinned rather than refused: Postgres may be back soon
            log.warning("image digests: cannot read %s (%s)", image, exc)
            pin = NamePin(None)
        with self._lock:
            if pin.digest is None:
                self._missed[key] = (now + self._retry_s, pin)
            else:
                self._missed.pop(key, None)
                if len(self._found) >= KEEP:
                    self._found.pop(next(iter(self._found)))
                self._found[key] = pin.digest
        return pin

    def _forget_if_deleted(self, now: float) -> None:
        """Drop every digest found once the hub reports a deletion after the last seen
        (deletions are rare: one look every few seconds costs less than one per name)."""
        with self._lock:
            if now - self._checked < self._check_s:
                return
            self._checked = now
        try:
            last = self._deletions()
        except Exception as exc:  # keep what is known: Postgres may be back soon
            log.warning("image digests: cannot read the hub's deletions (%s)", exc)
            return
        with self._lock:
            if last != self._last_deletion:
                self._last_deletion = last
                self._found.clear()
                self._missed.clear()
