"""The supervisor's restart rules: at once the first time, then ever longer pauses,
and never more than LIMIT times in the window."""

from __future__ import annotations

from app.supervisor import BACKOFF_S, LIMIT, WINDOW_S, Restarts


def test_the_first_restart_is_at_once_then_pauses_grow() -> None:
    record = Restarts()
    assert record.due(1000.0)
    record.times = [1000.0]
    assert not record.due(1000.0 + BACKOFF_S[1] / 2)
    assert record.due(1000.0 + BACKOFF_S[1])
    record.times = [1000.0, 1001.0, 1003.0]
    assert not record.due(1003.0 + BACKOFF_S[3] - 0.1)
    assert record.due(1003.0 + BACKOFF_S[3])


def test_a_service_that_keeps_dying_is_left_down_until_the_window_passes() -> None:
    times = [float(i * 10) for i in range(LIMIT)]
    record = Restarts(times=times)
    assert not record.due(times[-1] + BACKOFF_S[-1] + 1)  # LIMIT restarts in the window
    # Once the oldest restart leaves the window, it may try again
    assert record.due(times[0] + WINDOW_S + 1)
