"""How the node's handlers report a request they could not carry out.

A failure is filed under the reason its exception names (:func:`reason_for`) and
answered twice: a SandboxFailed event for the log and an ErrorReply for the trainer
(:meth:`Failures.fail`). Work done with a sandbox's agent answers its own failure that
way (:meth:`Failures.by_agent`). Also here: the envelope every event the node records
about a request's sandbox carries.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from enum import Enum
from typing import TypeVar

from app.domain.base import MAX_DETAIL, FailReason
from app.domain.events import FailedPayload, SandboxFailed
from app.domain.replies import ErrorReply
from app.domain.requests import RequestBase
from workers.agent.connection import AgentConnection
from workers.agent.errors import AgentError, AgentRefused, AgentTimeout, AgentUnavailable
from workers.agent.pool import AgentPool
from workers.containers.port import ContainerDriver
from workers.courier import Courier
from workers.errors import (
    CommandInterrupted,
    DirectRefused,
    EgressDisabled,
    ImageNotFound,
    ImageRefused,
    NodeError,
    NoSpace,
    SandboxNotRunning,
    StaleCommand,
    StaleCreate,
)
from workers.tally import NodeTally

log = logging.getLogger(__name__)

T = TypeVar("T")

#: How long a request waits for a sandbox's agent (reconnecting after a worker restart).
AGENT_WAIT_S = 10.0


def reason_for(exc: Exception) -> FailReason:
    """The reason the log and the trainer are given for a request that raised ``exc``."""
    if isinstance(exc, CommandInterrupted):
        return FailReason.INTERRUPTED
    if isinstance(exc, EgressDisabled | DirectRefused | ImageRefused):
        return FailReason.REFUSED
    if isinstance(exc, SandboxNotRunning):
        return FailReason.SANDBOX_NOT_RUNNING
    if isinstance(exc, NoSpace) or "no space left on device" in str(exc).lower():
        return FailReason.NO_SPACE
    if isinstance(exc, ImageNotFound):
        return FailReason.IMAGE_NOT_FOUND
    if isinstance(exc, AgentTimeout | StaleCreate | StaleCommand):
        return FailReason.TIMEOUT
    if isinstance(exc, AgentRefused):
        return FailReason.REFUSED
    if isinstance(exc, AgentUnavailable):
        return FailReason.AGENT_UNAVAILABLE
    if isinstance(exc, NodeError | AgentError):
        return FailReason.RUNTIME_ERROR
    return FailReason.INTERNAL


def envelope(request: RequestBase, node_id: str) -> dict[str, str]:
    """The envelope of an event node ``node_id`` records about a request's sandbox."""
    return {
        "sandbox_id": request.sandbox_id,
        "node_id": node_id,
        "tenant": request.tenant,
        "job_id": request.job_id,
    }


class Failed(Enum):
    """What :meth:`Failures.by_agent` returns once it has answered its request with the
    failure."""

    ANSWERED = "answered"


class Failures:
    """Failures of one node's requests, told to the log and to their trainers."""

    def __init__(
        self,
        node_id: str,
        courier: Courier,
        driver: ContainerDriver,
        agents: AgentPool,
        tally: NodeTally,
    ) -> None:
        self.node_id = node_id
        self.tally = tally
        self.courier = courier
        self.driver = driver
        self.agents = agents

    def fail(self, request: RequestBase, exc: Exception) -> None:
        """Record and answer ``request`` as failed with ``exc``."""
        reason = reason_for(exc)
        detail = str(exc)[:MAX_DETAIL] or type(exc).__name__
        if reason == FailReason.AGENT_UNAVAILABLE and request.type != "CreateSandbox":
            # No agent: most often the sandbox itself is gone (its memory limit killed
            # PID 1); say that, and why, rather than blame the agent.
            ended = self._why_not_running(request.sandbox_id)
            if ended is not None:
                reason, detail = FailReason.SANDBOX_NOT_RUNNING, ended
        log.warning("%s %s failed: %s: %s", request.type, request.sandbox_id, reason, detail)
        self.tally.refused(reason.value)
        self.courier.event(
            SandboxFailed(
                event_id=request.event_of("failed"),
                **envelope(request, self.node_id),
                payload=FailedPayload(
                    request_id=request.request_id,
                    request_type=request.type,
                    reason=reason,
                    detail=detail,
                ),
            )
        )
        self.courier.reply(
            request.reply_to,
            ErrorReply(
                request_id=request.request_id,
                sandbox_id=request.sandbox_id,
                reason=reason.value,
                detail=detail,
            ),
        )

    def by_agent(self, request: RequestBase, work: Callable[[AgentConnection], T]) -> T | Failed:
        """What ``work`` returns, done with the sandbox's agent (waited for while it
        reconnects); if anything fails, the request is answered with the failure and
        :data:`Failed.ANSWERED` returned."""
        try:
            with self.agents.using(request.sandbox_id, AGENT_WAIT_S) as conn:
                return work(conn)
        except Exception as exc:
            self.fail(request, exc)
            return Failed.ANSWERED

    def _why_not_running(self, sandbox_id: str) -> str | None:
        """Why the sandbox's container no longer runs; None if it does."""
        try:
            box = self.driver.get(sandbox_id)
        except NodeError:
            return None
        if box is None:
            return f"sandbox {sandbox_id} is gone"
        if box.running:
            return None
        if box.oom_killed:
            return f"sandbox {sandbox_id} ended: out of memory (OOM kill)"
        return f"sandbox {sandbox_id} ended: its container exited with {box.exit_code}"
