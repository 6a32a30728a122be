"""The lifecycle only moves forward."""

from __future__ import annotations

from app.domain.sandbox_state import SandboxState, advance


def test_late_started_does_not_revive_a_stopped_sandbox() -> None:
    assert advance(SandboxState.STOPPED, SandboxState.RUNNING) == SandboxState.STOPPED


def test_started_after_scheduled_runs() -> None:
    assert advance(SandboxState.SCHEDULED, SandboxState.RUNNING) == SandboxState.RUNNING


def test_first_event_sets_state() -> None:
    assert advance(None, SandboxState.REQUESTED) == SandboxState.REQUESTED
