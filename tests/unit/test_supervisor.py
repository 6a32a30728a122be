"""The supervisor's restart rules: a service that had been running is started again
at once; one that keeps dying soon after each start waits ever longer, and is left
down after LIMIT such deaths in a row."""

from __future__ import annotations

from app.stack.restarts import BACKOFF_S, LIMIT, STABLE_S, Restarts


def test_a_service_that_had_been_running_is_started_again_at_once() -> None:
    record = Restarts()
    record.died(1000.0)
    assert record.due(1000.0)
    record.started(1000.0)
    # Many deaths, each after a stable run: never a pause (a node worker held back
    # longer than the heartbeat timeout would lose its node)
    for n in range(1, 3 * LIMIT):
        now = 1000.0 + n * (STABLE_S + 1)
        record.died(now)
        assert record.quick == 0 and record.due(now)
        record.started(now)


def test_quick_deaths_in_a_row_wait_ever_longer() -> None:
    record = Restarts(times=[1000.0])
    record.died(1001.0)  # one second after its start
    assert record.quick == 1
    assert not record.due(1001.0 + BACKOFF_S[1] / 2)
    assert record.due(1001.0 + BACKOFF_S[1])
    record.started(1002.0)
    record.died(1003.0)
    record.died(1010.0)  # the same death, seen again: counted once
    assert record.quick == 2
    assert not record.due(1003.0 + BACKOFF_S[2] - 0.1)
    assert record.due(1003.0 + BACKOFF_S[2])
    # A run longer than STABLE_S ends the loop
    record.started(1005.0)
    record.died(1005.0 + STABLE_S + 1)
    assert record.quick == 0


def test_a_service_that_keeps_dying_at_once_is_left_down() -> None:
    record = Restarts()
    now = 0.0
    for _ in range(LIMIT):
        record.started(now)
        now += 1.0
        record.died(now)
        now += BACKOFF_S[-1]
    assert record.quick == LIMIT and not record.due(now + 3600)
