"""The sandbox lifecycle as a state machine (pure)."""

from __future__ import annotations

from enum import StrEnum


class SandboxState(StrEnum):
    """Where a sandbox is in its life; every value is queryable in SQL."""

    REQUESTED = "requested"
    SCHEDULED = "scheduled"
    RUNNING = "running"
    STOPPED = "stopped"
    FAILED = "failed"
    REJECTED = "rejected"


#: Events only move a sandbox forward: a late or replayed event never revives it.
_RANK = {
    SandboxState.REQUESTED: 0,
    SandboxState.SCHEDULED: 1,
    SandboxState.RUNNING: 2,
    SandboxState.FAILED: 3,
    SandboxState.REJECTED: 3,
    SandboxState.STOPPED: 4,
}

TERMINAL = frozenset({SandboxState.STOPPED, SandboxState.FAILED, SandboxState.REJECTED})
LIVE = frozenset({SandboxState.REQUESTED, SandboxState.SCHEDULED, SandboxState.RUNNING})
#: The ends of a life: a sandbox moves no more after one. (A refused create is no end:
#: nothing lived, and a later create of the same id lives.)
ENDED = frozenset({SandboxState.STOPPED, SandboxState.FAILED})

#: The state each lifecycle event leads to.
STATE_AFTER = {
    "SandboxRequested": SandboxState.REQUESTED,
    "SandboxScheduled": SandboxState.SCHEDULED,
    "SandboxStarted": SandboxState.RUNNING,
    "SandboxStopped": SandboxState.STOPPED,
    "SandboxRejected": SandboxState.REJECTED,
}


def advance(current: SandboxState | None, new: SandboxState) -> SandboxState:
    """The state after ``new`` is observed in ``current``: never moves backwards, and
    never after an end. A refused create names a sandbox that never lived: it moves no
    sandbox that lives (another's create of a live id, refused as a duplicate, must not
    end it), and a later create of that id lives anew."""
    if current is None:
        return new
    if current in ENDED or new == SandboxState.REJECTED:
        return current
    if current == SandboxState.REJECTED:
        return new
    return new if _RANK[new] >= _RANK[current] else current


def rank(state: SandboxState) -> int:
    """Order of states along the lifecycle (for SQL guards)."""
    return _RANK[state]
