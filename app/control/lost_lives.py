"""The projector's rule for lives on lost nodes: every life open on a node the log
shows lost ends ``node_lost``, as of the node's last word on it.

The scheduler that declares a node lost ends the lives it knows there at once. This
rule ends the rest: lives placed by a scheduler that no longer runs (or by one whose
events another never read), and lives left open by a declarer that died between its
``NodeLost`` and its ends. It runs where the log is, with or without a scheduler.

The ends are stated as the control plane states them, not folded into the
projections directly: each is a ``SandboxStopped`` keyed by its sandbox, proven with
the scheduler's key, through the events topic, so it takes its sandbox's partition
and is appended in order with the sandbox's other events (a fold from the node's
partition would race the sandbox's own lane, and a rebuild would not find it in the
log). Its id is the one every declarer gives that end (:func:`app.domain.lives.end_id`),
so the log keeps one, and a life ended meanwhile by anyone else sets the late one
aside (``already_ended``). A projector that starts sweeps at once: a crash between a
``NodeLost`` and its ends loses nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from datetime import datetime
from typing import Protocol

from app.bus import Publisher
from app.config import Settings
from app.control.keyring import Keyring
from app.db import queries
from app.db.engine import transaction
from app.domain.base import StopReason
from app.domain.codec import encode
from app.domain.events import LastState, SandboxStopped
from app.domain.lives import OpenLife, declared_end, last_word
from app.domain.proof import SCHEDULER_KEY_ID, Purpose, headers

log = logging.getLogger(__name__)

#: How often the projector looks for lives open on lost nodes.
SWEEP_S = 10.0
#: An end sent is not sent again for this long (it is on its way to the log).
RESEND_S = 120.0


class LostLife(Protocol):
    """A live sandbox on a lost node, as :func:`app.db.queries.lives_on_lost_nodes`
    reads it."""

    @property
    def sandbox_id(self) -> str: ...
    @property
    def tenant(self) -> str: ...
    @property
    def job_id(self) -> str: ...
    @property
    def node_id(self) -> str: ...
    @property
    def started_at(self) -> datetime | None: ...
    @property
    def last_heartbeat_at(self) -> datetime | None: ...
    @property
    def lost_at(self) -> datetime | None: ...
    @property
    def last_command_at(self) -> datetime | None: ...


def ends_of(lives: Iterable[LostLife]) -> list[SandboxStopped]:
    """The end of each life on a lost node, as of the node's last word on it (its last
    heartbeat, the sandbox's start or its last command, whichever came last)."""
    found = []
    for row in lives:
        heard = row.last_heartbeat_at
        at = last_word(heard, row.started_at, row.last_command_at) or row.lost_at
        if at is None:
            continue  # nothing dates it: a node lost before it was ever heard from
        life = OpenLife(row.sandbox_id, row.tenant, row.job_id, row.node_id)
        detail = f"{row.node_id}: declared lost (ended by the projector's rule)"
        state = LastState(observed_by="projector", last_heartbeat_at=heard)
        found.append(declared_end(life, StopReason.NODE_LOST, detail, at, state))
    return found


class LostLives:
    """Sweeps the projections for lives open on lost nodes and states their ends."""

    def __init__(self, settings: Settings, publisher: Publisher, keys: Keyring) -> None:
        self.settings = settings
        self.publisher = publisher
        self._secret = keys.scheduler.secret
        self._swept = float("-inf")
        # Sandbox -> when its end was sent (monotonic).
        self._sent: dict[str, float] = {}

    def due(self) -> bool:
        """Time for a sweep (at once after a start)."""
        return time.monotonic() - self._swept >= SWEEP_S

    def sweep(self) -> int:
        """State the end of every life open on a lost node; return how many were sent."""
        self._swept = now = time.monotonic()
        with transaction(self.settings.database_url) as conn:
            rows = queries.lives_on_lost_nodes(conn)
        self._sent = {s: at for s, at in self._sent.items() if now - at < RESEND_S}
        ends = [e for e in ends_of(rows) if e.sandbox_id not in self._sent]
        for end in ends:
            value = encode(end)
            proof = headers(Purpose.EVENT, SCHEDULER_KEY_ID, self._secret, value)
            self.publisher.publish(self.settings.topic_events, end.key, value, headers=proof)
            self._sent[end.sandbox_id or ""] = now
        if ends:
            self.publisher.flush()
            log.warning(
                "projector: %d lives open on lost nodes ended node_lost (%s)",
                len(ends), ", ".join(sorted({e.node_id or "" for e in ends})),
            )  # fmt: skip
        return len(ends)
