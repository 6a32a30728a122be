"""Errors of the host side of the in-sandbox agent.

Socket errors never leave ``client``: they become one of these, each also inheriting
the builtin a caller would naturally catch.
"""

from __future__ import annotations

from app.errors import DsecError


class AgentError(DsecError):
    """Base of every agent error."""


class AgentUnavailable(AgentError, ConnectionError):
    """No agent is connected, or the connection broke during a request."""


class AgentTimeout(AgentError, TimeoutError):
    """The agent did not answer in time; the connection was dropped (which also makes
    the agent kill the command it was running)."""


class AgentRefused(AgentError, ValueError):
    """The agent answered with an error (status 1), e.g. a refused path or a missing
    file; ``errno`` is the OS error number, 0 when the refusal is not an OS error."""

    def __init__(self, message: str, errno: int = 0) -> None:
        super().__init__(message)
        self.errno = errno


class AgentProtocolError(AgentUnavailable):
    """A frame broke the protocol (bad length, unknown version, malformed fields); the
    connection is unusable and is dropped, as for any other broken connection."""


class AgentBuildError(AgentError, RuntimeError):
    """The agent binary or the static busybox could not be staged."""
