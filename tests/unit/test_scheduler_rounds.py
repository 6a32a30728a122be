"""How long a scheduler's round waits for requests: never while it is behind the log."""

from __future__ import annotations

from app.control.scheduler import (
    EVENTS_PER_READ,
    QUIET_WAIT_MS,
    REQUEST_WAIT_MS,
    round_wait_ms,
)


def test_a_round_behind_the_log_waits_for_nothing() -> None:
    # A unit's nodes log ~40,000 events a second: a quiet scheduler waiting a second
    # after each full read would fall further behind every round.
    assert round_wait_ms(EVENTS_PER_READ, quiet=True, creates_waiting=False) == 0
    assert round_wait_ms(EVENTS_PER_READ, quiet=False, creates_waiting=True) == 0


def test_a_round_that_caught_up_waits_as_its_requests_say() -> None:
    assert round_wait_ms(EVENTS_PER_READ - 1, quiet=True, creates_waiting=False) == QUIET_WAIT_MS
    assert round_wait_ms(0, quiet=True, creates_waiting=True) == REQUEST_WAIT_MS
    assert round_wait_ms(0, quiet=False, creates_waiting=False) == REQUEST_WAIT_MS
