"""What the scheduler knows of each node's health, without I/O: when it was last heard
from and with which key, which of its sandboxes it last listed and when (so a
sandbox's bill ends when its node last spoke for it), and which nodes fell silent.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from datetime import datetime, timedelta

from app.domain.base import derived_id
from app.domain.events import NodeLost, NodeLostPayload
from app.domain.placement import NodeView
from app.domain.reconcile import NodeLedger, Verdict


class NodeHealth:
    """Heartbeats, sandbox sightings and silence, per node."""

    def __init__(self, timeout: timedelta, namespace: uuid.UUID) -> None:
        #: Silence after which a node is declared lost.
        self.timeout = timeout
        self._namespace = namespace
        # Newest heartbeat time per node (an older one replayed is ignored).
        self._heard_at: dict[str, datetime] = {}
        # The key each node proved its last heartbeat with: its tasks are sealed for it.
        self._keys: dict[str, str] = {}
        self._ledgers: dict[str, NodeLedger] = {}

    def heard(self, node_id: str, at: datetime, key_id: str) -> bool:
        """A heartbeat as of ``at`` (the node's clock), proven with ``key_id``; False if
        it is older than one already heard (replayed: its list is out of date)."""
        last = self._heard_at.get(node_id)
        if last is not None and at <= last:
            return False
        self._heard_at[node_id] = at
        self._keys[node_id] = key_id
        return True

    def key_of(self, node_id: str) -> str | None:
        """The key the node proved its last heartbeat with."""
        return self._keys.get(node_id)

    def saw(self, node_id: str, sandbox_id: str, at: datetime) -> None:
        """The node spoke for the sandbox as of ``at``: if it vanishes later, its bill
        ends no earlier than this."""
        self._ledger(node_id).saw(sandbox_id, at)

    def reconcile(
        self, node_id: str, placed: set[str], reported: set[str], unstarted: set[str], at: datetime
    ) -> Verdict:
        """Compare what the node lists with what is placed on it (see
        :class:`app.domain.reconcile.NodeLedger`)."""
        return self._ledger(node_id).observe(placed, reported, unstarted, at)

    def last_listed(self, node_id: str, sandbox_id: str) -> datetime | None:
        """When the node last listed (or spoke for) the sandbox."""
        ledger = self._ledgers.get(node_id)
        return ledger.seen_at.get(sandbox_id) if ledger is not None else None

    def last_alive(self, node_id: str, sandbox_id: str) -> datetime | None:
        """Until when the sandbox is known alive: its node's last word on it, else the
        node's last heartbeat."""
        return self.last_listed(node_id, sandbox_id) or self._heard_at.get(node_id)

    def orphan_handled(self, node_id: str, sandbox_id: str) -> None:
        """A container the node lists but nobody placed was sent a destroy."""
        self._ledger(node_id).extra.pop(sandbox_id, None)

    def silent(
        self, nodes: Iterable[NodeView], now: datetime, bus_since: datetime | None = None
    ) -> list[tuple[NodeView, str]]:
        """Alive nodes that missed their heartbeats, with why. Silence counts only
        from ``bus_since``, since when the bus has been reachable: a broker that was
        down kept every node's heartbeats from arriving, and said nothing of the nodes."""
        found = []
        for node in nodes:
            if not node.alive or node.last_seen is None:
                continue
            heard = node.last_seen if bus_since is None else max(node.last_seen, bus_since)
            quiet = now - heard
            if quiet > self.timeout:
                found.append((node, f"no heartbeat for {quiet.total_seconds():.0f}s"))
        return found

    def lost(self, node_id: str, detail: str) -> NodeLost:
        """The event declaring the node lost. Every scheduler watches every node: the id
        derives from the node's last heartbeat, so all who declare this loss append one."""
        heard = self._heard_at.get(node_id)
        return NodeLost(
            event_id=derived_id(
                self._namespace, f"{node_id}:lost:{heard.isoformat() if heard else ''}"
            ),
            node_id=node_id,
            payload=NodeLostPayload(detail=detail),
        )

    def _ledger(self, node_id: str) -> NodeLedger:
        return self._ledgers.setdefault(node_id, NodeLedger())
