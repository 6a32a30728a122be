"""The lifecycle only moves forward."""

from __future__ import annotations

from app.domain.sandbox_state import SandboxState, advance


def test_late_started_does_not_revive_a_stopped_sandbox() -> None:
    assert advance(SandboxState.STOPPED, SandboxState.RUNNING) == SandboxState.STOPPED


def test_started_after_scheduled_runs() -> None:
    assert advance(SandboxState.SCHEDULED, SandboxState.RUNNING) == SandboxState.RUNNING


def test_first_event_sets_state() -> None:
    assert advance(None, SandboxState.REQUESTED) == SandboxState.REQUESTED


def test_a_refused_create_moves_no_sandbox_that_lives() -> None:
    # Another create of a running sandbox's id is refused as a duplicate: the sandbox
    # still runs (before, the refusal ended it in the projection, and a restarted
    # scheduler then saw no life to recover and destroyed it as an orphan)
    for live in (SandboxState.REQUESTED, SandboxState.SCHEDULED, SandboxState.RUNNING):
        assert advance(live, SandboxState.REJECTED) == live
    assert advance(SandboxState.STOPPED, SandboxState.REJECTED) == SandboxState.STOPPED


def test_a_refused_id_may_live_later_and_ended_lives_stay_ended() -> None:
    assert advance(None, SandboxState.REJECTED) == SandboxState.REJECTED
    assert advance(SandboxState.REJECTED, SandboxState.REQUESTED) == SandboxState.REQUESTED
    assert advance(SandboxState.FAILED, SandboxState.RUNNING) == SandboxState.FAILED
    assert advance(SandboxState.STOPPED, SandboxState.REQUESTED) == SandboxState.STOPPED
