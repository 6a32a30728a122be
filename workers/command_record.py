"""What a command is on its way to the agent and back, with no I/O: the arguments the
agent is asked to run an Exec with, and what its end becomes (the log's
CommandCompleted, a killed command's result, the sign that the OOM killer ended it).
"""

from __future__ import annotations

import base64
import signal
from typing import Any

from app.domain.events import CommandCompleted, CommandPayload
from app.domain.requests import Exec
from workers.agent.messages import AgentExecResult
from workers.commands import Running
from workers.failures import envelope

#: Bytes of each output stream copied into the audit event.
AUDIT_HEAD = 256


def command_completed(
    request: Exec,
    result: AgentExecResult,
    node_id: str,
    step_output_bytes: int,
    killed_by: str | None = None,
) -> CommandCompleted:
    """The log's record of one command that ran. A trajectory command's carries the
    outputs its replays answer with, each cut to what the log keeps
    (``step_output_bytes``: an event must stay within the log's message size)."""
    truncated = result.stdout_truncated or result.stderr_truncated
    stdout_b64 = stderr_b64 = None
    if request.trajectory_id is not None:
        cap = step_output_bytes
        truncated |= len(result.stdout) > cap or len(result.stderr) > cap
        stdout_b64 = base64.b64encode(result.stdout[:cap]).decode()
        stderr_b64 = base64.b64encode(result.stderr[:cap]).decode()
    return CommandCompleted(
        event_id=request.event_of("completed"),
        **envelope(request, node_id),
        payload=CommandPayload(
            request_id=request.request_id,
            actor=request.actor,
            command=request.command,
            exit_code=result.exit_code,
            duration_ms=result.duration_s * 1000,
            stdout_bytes=len(result.stdout),
            stderr_bytes=len(result.stderr),
            stdout_head=audit_head(result.stdout),
            stderr_head=audit_head(result.stderr),
            timed_out=result.timed_out,
            truncated=truncated,
            killed_by=killed_by,
            trajectory_id=request.trajectory_id,
            step=request.step,
            stdout_b64=stdout_b64,
            stderr_b64=stderr_b64,
        ),
    )


def killed_result(running: Running, duration_s: float) -> AgentExecResult:
    """What a killed command answers: SIGKILL, and the output it streamed."""
    return AgentExecResult(
        exit_code=-signal.SIGKILL,
        stdout=bytes(running.stdout),
        stderr=bytes(running.stderr),
        duration_s=duration_s,
    )


def oom_suspect(result: AgentExecResult) -> bool:
    """True if the kernel's OOM killer may have ended the command (SIGKILL, and not at
    its timeout): its sandbox's OOM count is then read, and the sandbox ended if hit."""
    return result.exit_code == -signal.SIGKILL and not result.timed_out


def exec_args(request: Exec) -> dict[str, Any]:
    """What the agent is asked to run for ``request`` (``AgentConnection.exec``'s args)."""
    command = request.command
    return {
        "argv": ["/bin/sh", "-c", command] if isinstance(command, str) else command,
        "env": dict(request.env) or None,
        "cwd": request.cwd,
        "timeout_s": request.timeout_s,
        "max_output": request.max_output_bytes,
        "stdin": base64.b64decode(request.stdin_b64),
    }


def audit_head(data: bytes) -> str:
    """The start of a command's output as text for the log.

    NUL becomes U+FFFD: Postgres' jsonb refuses ``\\u0000``, and one such event would
    stop the projector (a sandbox printing /proc/*/cmdline did).
    """
    return data[:AUDIT_HEAD].decode(errors="replace").replace("\x00", "\ufffd")
