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
