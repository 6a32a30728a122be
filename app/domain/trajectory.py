"""The trajectory log as the scheduler sees it: a port, with an in-memory adapter.

A trainer tags its commands with (trajectory_id, step). A step already completed is
answered from the log instead of running again, so a trainer restarting after
preemption fast-forwards through non-idempotent commands; and a lost sandbox is
rebuilt by replaying a trajectory's commands, in order, into a fresh one.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class RecordedStep:
    """What one completed step returned."""

    request_id: uuid.UUID
    step: int
    command: str | list[str]
    exit_code: int
    stdout_b64: str
    stderr_b64: str
    duration_ms: float
    timed_out: bool
    truncated: bool


class TrajectoryLog(Protocol):
    """Where completed steps are looked up."""

    def lookup(self, trajectory_id: str, step: int) -> RecordedStep | None:
        """The recorded result of a step, if it completed."""

    def steps(self, trajectory_id: str) -> list[RecordedStep]:
        """Every completed step of a trajectory, in step order."""


@dataclass
class InMemoryTrajectoryLog:
    """A trajectory log in a dict (tests and benchmarks of the scheduler)."""

    recorded: dict[tuple[str, int], RecordedStep] = field(default_factory=dict)

    def lookup(self, trajectory_id: str, step: int) -> RecordedStep | None:
        return self.recorded.get((trajectory_id, step))

    def steps(self, trajectory_id: str) -> list[RecordedStep]:
        found = [s for (t, _), s in self.recorded.items() if t == trajectory_id]
        return sorted(found, key=lambda s: s.step)
