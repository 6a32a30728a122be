"""The reconciler's rounds: every few seconds on a small node, spaced by their own
length on a full one, so that listing thousands of containers never takes a large
share of the node's CPU."""

from __future__ import annotations

import pytest

from workers.upkeep import HEARTBEAT_S, ROUND_PAUSE_MAX_S, ROUND_SPACING, pause_after


def test_quick_rounds_keep_the_heartbeats_period() -> None:
    assert pause_after(0.02, HEARTBEAT_S) == pytest.approx(HEARTBEAT_S - 0.02)


def test_a_slow_round_is_followed_by_a_pause_proportional_to_it() -> None:
    # 2,000 containers: a ~2 s listing, so the next round starts ~20 s after this one.
    pause = pause_after(2.0, HEARTBEAT_S)
    assert 2.0 + pause == pytest.approx(2.0 * ROUND_SPACING)
    # The share of the node's time spent listing stays at most 1 / ROUND_SPACING.
    for round_s in (0.1, 0.5, 1.0, 3.0):
        assert round_s / (round_s + pause_after(round_s, HEARTBEAT_S)) <= 1 / ROUND_SPACING


def test_a_very_slow_round_does_not_put_the_next_off_for_minutes() -> None:
    # A listing while Podman removes a thousand containers: 15 s, not 135 s of pause.
    assert pause_after(15.0, HEARTBEAT_S) == ROUND_PAUSE_MAX_S


def test_rounds_are_never_closer_than_a_second() -> None:
    assert pause_after(10.0, 1.0) >= 1.0
    assert pause_after(0.0, 0.5) == 1.0
