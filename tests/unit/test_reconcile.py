"""Reconciliation verdicts need two heartbeats in a row."""

from __future__ import annotations

from app.domain.reconcile import NodeLedger


def test_missing_once_is_not_vanished() -> None:
    ledger = NodeLedger()
    assert ledger.observe({"a", "b"}, {"a"}).vanished == frozenset()


def test_missing_twice_is_vanished() -> None:
    ledger = NodeLedger()
    ledger.observe({"a", "b"}, {"a"})
    assert ledger.observe({"a", "b"}, {"a"}).vanished == {"b"}


def test_reappearing_resets_suspicion() -> None:
    ledger = NodeLedger()
    ledger.observe({"a", "b"}, {"a"})
    ledger.observe({"a", "b"}, {"a", "b"})
    assert ledger.observe({"a", "b"}, {"a"}).vanished == frozenset()


def test_unplaced_container_twice_is_orphan() -> None:
    ledger = NodeLedger()
    assert ledger.observe({"a"}, {"a", "x"}).orphans == frozenset()
    assert ledger.observe({"a"}, {"a", "x"}).orphans == {"x"}


def test_released_sandbox_still_reported_becomes_orphan() -> None:
    ledger = NodeLedger()
    ledger.observe({"a"}, {"a"})
    ledger.observe(set(), {"a"})
    assert ledger.observe(set(), {"a"}).orphans == {"a"}


def test_a_create_still_queued_on_the_node_is_not_vanished() -> None:
    # Given a placed sandbox whose create waits in the node's queue (not yet reported)
    ledger = NodeLedger()
    for _ in range(3):
        verdict = ledger.observe({"a", "q"}, {"a"}, starting={"q"})
    # Then it is neither vanished nor, once reported while starting, an orphan
    assert verdict.vanished == frozenset()
    assert ledger.observe({"a", "q"}, {"a", "q"}, starting={"q"}).orphans == frozenset()


def test_a_vanished_sandbox_is_known_alive_until_its_last_listing() -> None:
    from datetime import UTC, datetime, timedelta

    t0 = datetime(2026, 12, 2, 10, 0, tzinfo=UTC)
    ledger = NodeLedger()
    # Given a node listing "a" and "b", then (rebooted) listing nothing
    ledger.observe({"a", "b"}, {"a", "b"}, at=t0)
    ledger.observe({"a", "b"}, {"a"}, at=t0 + timedelta(seconds=5))
    ledger.observe({"a", "b"}, set(), at=t0 + timedelta(seconds=60))
    verdict = ledger.observe({"a", "b"}, set(), at=t0 + timedelta(seconds=65))
    # Then both vanished, each last seen when the node last listed it
    assert verdict.vanished == {"a", "b"}
    assert ledger.seen_at == {"a": t0 + timedelta(seconds=5), "b": t0}
    # And an ended sandbox is forgotten with it
    ledger.observe({"a"}, set(), at=t0 + timedelta(seconds=70))
    assert set(ledger.seen_at) == {"a"}
