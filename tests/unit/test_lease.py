"""A lease freezes its sandboxes when the trainer goes quiet, thaws them when it
comes back, and destroys them when the grace period runs out."""

from __future__ import annotations

from app.domain.lease import Lease, LeaseAction, LeaseState


def lease() -> Lease:
    return Lease("l1", ttl_s=10, grace_s=60, expires_s=10)


def test_renewed_lease_does_nothing() -> None:
    held = lease()
    assert held.renew(5, 10, 60) is None
    assert held.tick(14) is None


def test_quiet_trainer_freezes_then_destroys() -> None:
    quiet = lease()
    assert quiet.tick(11) == LeaseAction.FREEZE
    assert quiet.state == LeaseState.LAPSED
    assert quiet.tick(30) is None
    assert quiet.tick(72) == LeaseAction.DESTROY


def test_reattaching_trainer_thaws() -> None:
    back = lease()
    back.tick(11)
    assert back.renew(20, 10, 60) == LeaseAction.THAW
    assert back.state == LeaseState.HELD
    assert back.tick(25) is None
