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

from app.domain.events import CommandCompleted, CommandPayload, CommandReplayed, ReplayedPayload
from app.domain.replies import ExecOutput
from app.domain.requests import Exec


@dataclass(frozen=True)
class RecordedStep:
    """A completed step's outcome, what its replays answer: read from the log (the
    ``commands`` projection) by the scheduler, and kept by the node that ran it
    until the log has it (``workers/redis_state.py``)."""

    request_id: uuid.UUID
    step: int
    command: str | list[str]
    exit_code: int
    stdout_b64: str
    stderr_b64: str
    duration_ms: float
    timed_out: bool
    #: Either output was cut (to what the log keeps, or by the command's own cap).
    truncated: bool

    @classmethod
    def of(cls, completed: CommandPayload) -> RecordedStep | None:
        """What the log will keep of a command that ran; None if it is no step."""
        if completed.trajectory_id is None or completed.step is None:
            return None
        if completed.stdout_b64 is None or completed.stderr_b64 is None:
            return None
        return cls(
            request_id=completed.request_id,
            step=completed.step,
            command=completed.command,
            exit_code=completed.exit_code,
            stdout_b64=completed.stdout_b64,
            stderr_b64=completed.stderr_b64,
            duration_ms=completed.duration_ms,
            timed_out=completed.timed_out,
            truncated=completed.truncated,
        )

    def replay(
        self, request: Exec, node_id: str | None = None
    ) -> tuple[CommandReplayed, ExecOutput]:
        """The audit event and the trainer's reply for ``request``, a step answered from
        this record instead of running again; the log keeps one truncation flag, so
        both streams say it."""
        assert request.trajectory_id is not None and request.step is not None
        event = CommandReplayed(
            event_id=request.event_of("replayed"),
            sandbox_id=request.sandbox_id,
            node_id=node_id,
            tenant=request.tenant,
            job_id=request.job_id,
            payload=ReplayedPayload(
                request_id=request.request_id,
                actor=request.actor,
                trajectory_id=request.trajectory_id,
                step=request.step,
                original_request_id=self.request_id,
            ),
        )
        reply = ExecOutput(
            request_id=request.request_id,
            sandbox_id=request.sandbox_id,
            exit_code=self.exit_code,
            stdout_b64=self.stdout_b64,
            stderr_b64=self.stderr_b64,
            duration_ms=self.duration_ms,
            timed_out=self.timed_out,
            stdout_truncated=self.truncated,
            stderr_truncated=self.truncated,
            replayed=True,
        )
        return event, reply


class TrajectoryLog(Protocol):
    """Where completed steps are looked up."""

    def lookup(self, tenant: str, trajectory_id: str, step: int) -> RecordedStep | None:
        """The recorded result of one of ``tenant``'s steps, if it completed."""

    def steps(self, tenant: str, trajectory_id: str) -> list[RecordedStep]:
        """Every completed step of one of ``tenant``'s trajectories, in step order."""


@dataclass
class InMemoryTrajectoryLog:
    """A trajectory log in a dict (tests and benchmarks of the scheduler)."""

    recorded: dict[tuple[str, str, int], RecordedStep] = field(default_factory=dict)

    def completed(self, event: CommandCompleted) -> None:
        """Keep a step as the ``commands`` projection does: steps only, and of two
        completions claiming one step the first."""
        step = RecordedStep.of(event.payload)
        if step is not None and event.payload.trajectory_id is not None:
            key = (event.tenant, event.payload.trajectory_id, step.step)
            self.recorded.setdefault(key, step)

    def lookup(self, tenant: str, trajectory_id: str, step: int) -> RecordedStep | None:
        return self.recorded.get((tenant, trajectory_id, step))

    def steps(self, tenant: str, trajectory_id: str) -> list[RecordedStep]:
        found = [
            s for (owner, t, _), s in self.recorded.items() if (owner, t) == (tenant, trajectory_id)
        ]
        return sorted(found, key=lambda s: s.step)
