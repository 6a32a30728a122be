"""What a command did and the request that runs one: plain data, no I/O."""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from app.domain.replies import ExecOutput
from app.domain.requests import Exec


@dataclass(frozen=True)
class ExecResult:
    """What a command did."""

    exit_code: int
    stdout: bytes
    stderr: bytes
    duration_ms: float
    timed_out: bool = False
    truncated: bool = False
    replayed: bool = False
    killed: bool = False

    @property
    def text(self) -> str:
        """Stdout decoded as UTF-8 (invalid bytes replaced)."""
        return self.stdout.decode(errors="replace")

    @property
    def ok(self) -> bool:
        """Exited 0 within its timeout."""
        return self.exit_code == 0 and not self.timed_out

    @classmethod
    def from_reply(cls, reply: ExecOutput) -> ExecResult:
        """The result a node's reply carries."""
        return cls(
            exit_code=reply.exit_code,
            stdout=base64.b64decode(reply.stdout_b64),
            stderr=base64.b64decode(reply.stderr_b64),
            duration_ms=reply.duration_ms,
            timed_out=reply.timed_out,
            truncated=reply.stdout_truncated or reply.stderr_truncated,
            replayed=reply.replayed,
            killed=reply.killed,
        )


@dataclass(frozen=True)
class Chunk:
    """A piece of a running command's output."""

    stream: Literal["stdout", "stderr"]
    data: bytes


OutputHandler = Callable[[Chunk], None]


def exec_request(
    common: dict[str, Any],
    command: str | Iterable[str],
    *,
    timeout_s: float,
    stdin: bytes = b"",
    stream_output: bool = False,
    **options: Any,
) -> Exec:
    """The Exec request for a command (a shell string or an argv list)."""
    return Exec(
        command=command if isinstance(command, str) else list(command),
        timeout_s=timeout_s,
        stdin_b64=base64.b64encode(stdin).decode(),
        stream_output=stream_output,
        **options,
        **common,
    )
