"""Agreeing with a node on what runs there (pure).

A node's heartbeat lists the sandboxes it runs. What the scheduler placed there but
the node no longer reports has vanished; what the node runs but the scheduler never
placed (or already ended) is an orphan. Either verdict needs two heartbeats in a row:
a Stopped event and the heartbeat after it travel on different partitions, and a
create may be under way while a heartbeat is cut.
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass, field
from datetime import datetime

#: Heartbeats in a row that must agree before the scheduler acts.
SIGHTINGS = 2


@dataclass(frozen=True)
class Verdict:
    """What to do after one heartbeat."""

    vanished: frozenset[str] = frozenset()
    orphans: frozenset[str] = frozenset()


@dataclass
class NodeLedger:
    """Suspicions about one node, carried from heartbeat to heartbeat."""

    missing: dict[str, int] = field(default_factory=dict)
    extra: dict[str, int] = field(default_factory=dict)
    #: When each placed sandbox was last listed by the node: a sandbox that vanished
    #: (a reboot, a crash) is known alive until then, and is billed until then.
    seen_at: dict[str, datetime] = field(default_factory=dict)

    def saw(self, sandbox_id: str, at: datetime) -> None:
        """The node spoke for ``sandbox_id`` at ``at`` (it started, a command finished)."""
        known = self.seen_at.get(sandbox_id)
        self.seen_at[sandbox_id] = at if known is None else max(known, at)

    def observe(
        self,
        placed: set[str],
        reported: set[str],
        starting: Set[str] = frozenset(),
        at: datetime | None = None,
    ) -> Verdict:
        """Compare one heartbeat's list with what the scheduler placed on the node.

        ``starting``: placed sandboxes whose create the node has not answered yet. A
        node reports a sandbox from the moment it begins creating it, but a create can
        wait in the node's queue for longer than two heartbeats (a burst of thousands);
        so these are not missing, and a lost create is the trainer's timeout to report.
        """
        if at is not None:
            self.seen_at = {s: self.seen_at[s] for s in placed if s in self.seen_at}
            for s in placed & reported:
                self.saw(s, at)
        self.missing = {s: self.missing.get(s, 0) + 1 for s in placed - reported - starting}
        self.extra = {s: self.extra.get(s, 0) + 1 for s in reported - placed}
        return Verdict(
            vanished=frozenset(s for s, n in self.missing.items() if n >= SIGHTINGS),
            orphans=frozenset(s for s, n in self.extra.items() if n >= SIGHTINGS),
        )
