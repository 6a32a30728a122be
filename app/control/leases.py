"""The scheduler's book of trainer leases, without I/O.

A trainer holds its sandboxes under a lease it renews; a lease that lapses freezes
them and, after its grace, destroys them (the clock itself: :mod:`app.domain.lease`).
Lease ids are the tenant's own, so a lease is known by (owner, lease id). With
several schedulers, only the one that reads a lease's renewals keeps its clock
(``keeps``); the others follow its freezes and thaws from the log.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from datetime import datetime

from app.domain.base import StopReason, new_id
from app.domain.lease import Lease, LeaseAction, LeaseState
from app.domain.requests import DestroySandbox, FreezeSandbox, RequestBase, ThawSandbox

#: (owner, lease id)
LeaseKey = tuple[str, str]


class Leases:
    """Every lease this scheduler knows and which lease each sandbox is under."""

    def __init__(self, ttl_s: float, grace_s: float) -> None:
        #: The terms of a lease first seen on a sandbox's label, before any renewal.
        self.ttl_s = ttl_s
        self.grace_s = grace_s
        self._by_key: dict[LeaseKey, Lease] = {}
        self._of: dict[str, LeaseKey] = {}
        #: Leases per owner (its lease quota counts them).
        self._held: Counter[str] = Counter()
        #: Whether this scheduler keeps a lease's clock (freezes and destroys on its
        #: lapse); alone, it keeps every lease.
        self.keeps: Callable[[str], bool] = lambda _lease_id: True

    def __getitem__(self, key: LeaseKey) -> Lease:
        return self._by_key[key]

    def holds(self, owner: str, lease_id: str) -> bool:
        """Whether ``owner`` has a lease ``lease_id`` here."""
        return (owner, lease_id) in self._by_key

    def count(self, owner: str) -> int:
        """How many leases ``owner`` has here."""
        return self._held[owner]

    def _new(self, key: LeaseKey, lease: Lease) -> Lease:
        self._by_key[key] = lease
        self._held[key[0]] += 1
        return lease

    def _drop(self, key: LeaseKey) -> None:
        if self._by_key.pop(key, None) is not None:
            self._held[key[0]] -= 1
            if not self._held[key[0]]:
                del self._held[key[0]]

    def join(self, sandbox_id: str, owner: str, lease_id: str, now_s: float) -> Lease:
        """Put a sandbox under its owner's lease, made with the default terms on first
        sight (a renewal sets the trainer's own)."""
        key = (owner, lease_id)
        lease = self._by_key.get(key)
        if lease is None:
            lease = self._new(key, Lease(lease_id, self.ttl_s, self.grace_s, now_s + self.ttl_s))
        lease.sandboxes.add(sandbox_id)
        self._of[sandbox_id] = key
        return lease

    def leave(self, sandbox_id: str) -> None:
        """The sandbox ended: its lease no longer holds it. A lease whose clock another
        scheduler keeps is forgotten with its last sandbox (its keeper destroys it)."""
        key = self._of.pop(sandbox_id, None)
        lease = self._by_key.get(key) if key is not None else None
        if lease is not None and key is not None:
            lease.sandboxes.discard(sandbox_id)
            if not lease.sandboxes and not self.keeps(key[1]):
                self._drop(key)

    def of(self, sandbox_id: str) -> Lease | None:
        """The lease the sandbox is under, if any."""
        key = self._of.get(sandbox_id)
        return self._by_key.get(key) if key is not None else None

    def lapsed(self, sandbox_id: str) -> Lease | None:
        """The sandbox's lease if it lapsed (its sandboxes are frozen), else None."""
        lease = self.of(sandbox_id)
        return lease if lease is not None and lease.state == LeaseState.LAPSED else None

    def renew(
        self, owner: str, lease_id: str, ttl_s: float, grace_s: float, now_s: float
    ) -> tuple[Lease, LeaseAction | None]:
        """A trainer renewed its lease (made on first renewal): the lease, and THAW if
        it had lapsed. Another tenant renewing "the same" id renews a lease of its own."""
        key = (owner, lease_id)
        lease = self._by_key.get(key)
        if lease is None:
            lease = self._new(key, Lease(lease_id, ttl_s, grace_s, now_s + ttl_s))
        return lease, lease.renew(now_s, ttl_s, grace_s)

    def follow(self, sandbox_id: str, frozen: bool, now_s: float) -> None:
        """The scheduler that keeps the sandbox's lease froze or thawed it: requests are
        refused while it is frozen, here too. (The keeper's own state leads its events:
        a late freeze must not undo a renewal there.)"""
        lease = self.of(sandbox_id)
        if lease is None or self.keeps(lease.lease_id):
            return
        if frozen and lease.state == LeaseState.HELD:
            lease.state, lease.lapsed_s = LeaseState.LAPSED, now_s
        elif not frozen and lease.state == LeaseState.LAPSED:
            lease.state, lease.lapsed_s = LeaseState.HELD, None
            lease.expires_s = now_s + lease.ttl_s

    def recovered(
        self,
        sandbox_id: str,
        owner: str,
        lease_id: str,
        frozen: bool,
        now_s: float,
        frozen_at: datetime | None = None,
        now: datetime | None = None,
    ) -> None:
        """A live sandbox of a previous scheduler: its lease's clock restarts (a trainer
        still there renews it); one left frozen is recovered lapsed, so a renewal thaws
        it, its grace running from its freeze (``frozen_at``, the log's time; ``now``
        the same clock's now) rather than from this restart: restarts must not keep
        a frozen sandbox alive."""
        lease = self.join(sandbox_id, owner, lease_id, now_s)
        if frozen:
            ago = (now - frozen_at).total_seconds() if frozen_at and now else 0.0
            lapsed_s = now_s - max(ago, 0.0)
            if lease.lapsed_s is None or lapsed_s < lease.lapsed_s:
                lease.state, lease.lapsed_s = LeaseState.LAPSED, lapsed_s

    def restart_clocks(self, keeps: Callable[[str], bool], now_s: float) -> None:
        """Leases whose clock this scheduler keeps from now on start a fresh term (the
        trainer renews it, or it lapses one TTL later: its renewals are not in the log).
        A lapsed one keeps its lapse: the freeze is in the log, and its grace runs
        from there, whoever keeps the clock."""
        for (_, lease_id), lease in self._by_key.items():
            if keeps(lease_id) and lease.state == LeaseState.HELD:
                lease.expires_s = max(lease.expires_s, now_s + lease.ttl_s)

    def due(self, now_s: float) -> list[tuple[Lease, LeaseAction]]:
        """What the leases whose clock this scheduler keeps call for now (freeze on a
        lapse, destroy after the grace); a destroyed lease is forgotten."""
        found = []
        for key, lease in list(self._by_key.items()):
            if not self.keeps(key[1]):
                continue
            action = lease.tick(now_s)
            if action is None:
                continue
            found.append((lease, action))
            if action == LeaseAction.DESTROY:
                self._drop(key)
        return found


def lease_request(
    lease: Lease, action: LeaseAction, sandbox_id: str, tenant: str, job_id: str
) -> RequestBase:
    """The node task that carries out ``action`` on one sandbox of ``lease``."""
    common = {
        "request_id": new_id(),
        "sandbox_id": sandbox_id,
        "tenant": tenant,
        "job_id": job_id,
        "actor": f"scheduler/lease {lease.lease_id}"[:200],
    }
    if action == LeaseAction.FREEZE:
        return FreezeSandbox(reason=StopReason.LEASE_LAPSED.value, **common)
    if action == LeaseAction.THAW:
        return ThawSandbox(**common)
    return DestroySandbox(reason=StopReason.LEASE_LAPSED.value, **common)
