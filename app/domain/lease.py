"""Trainer leases (pure): a trainer's sandboxes live as long as it does.

A trainer renews its lease every few seconds. When the renewals stop (the trainer
was preempted, its host died), the lease lapses: its sandboxes are frozen, so they
stop burning CPU but keep their state; if the trainer reattaches (renews the same
lease) within the grace period they are thawed and carry on, otherwise they are
destroyed with the reason ``lease_lapsed``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class LeaseState(StrEnum):
    """Where a lease stands."""

    HELD = "held"
    LAPSED = "lapsed"


class LeaseAction(StrEnum):
    """What the scheduler must do to a lease's sandboxes."""

    FREEZE = "freeze"
    THAW = "thaw"
    DESTROY = "destroy"


@dataclass
class Lease:
    """One trainer's lease, on the scheduler's monotonic clock."""

    lease_id: str
    ttl_s: float
    grace_s: float
    expires_s: float
    state: LeaseState = LeaseState.HELD
    lapsed_s: float | None = None
    sandboxes: set[str] = field(default_factory=set)

    def renew(self, now_s: float, ttl_s: float, grace_s: float) -> LeaseAction | None:
        """The trainer is alive; THAW if it comes back from a lapse."""
        self.ttl_s, self.grace_s = ttl_s, grace_s
        self.expires_s = now_s + ttl_s
        if self.state == LeaseState.LAPSED:
            self.state, self.lapsed_s = LeaseState.HELD, None
            return LeaseAction.THAW
        return None

    def tick(self, now_s: float) -> LeaseAction | None:
        """FREEZE when renewals stop; DESTROY when the grace period is over too."""
        if self.state == LeaseState.HELD and now_s > self.expires_s:
            self.state, self.lapsed_s = LeaseState.LAPSED, now_s
            return LeaseAction.FREEZE
        if (
            self.state == LeaseState.LAPSED
            and self.lapsed_s is not None
            and now_s > self.lapsed_s + self.grace_s
        ):
            return LeaseAction.DESTROY
        return None
