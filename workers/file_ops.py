"""Files into and out of a sandbox, through its agent.

The host never opens a path inside the sandbox: the agent does, and refuses links
and traversal. Every file that crosses the sandbox's boundary is recorded
(FileWritten, FileRead) with its size, then answered to the trainer.
"""

from __future__ import annotations

import base64

from app.domain.events import FilePayload, FileRead, FileWritten
from app.domain.replies import Done, FileContent
from app.domain.requests import ReadFile, WriteFile
from workers.courier import Courier
from workers.failures import Failed, Failures, envelope


class FileOps:
    """One node's file transfers."""

    def __init__(self, node_id: str, courier: Courier, failures: Failures) -> None:
        self.node_id = node_id
        self.courier = courier
        self.failures = failures

    def write_file(self, request: WriteFile) -> None:
        """Write a file through the agent (which refuses links and traversal)."""
        data = base64.b64decode(request.data_b64)
        size = self.failures.by_agent(
            request, lambda c: c.write_file(request.path, data, request.mode)
        )
        if isinstance(size, Failed):
            return
        self._file_moved(request, size)
        self.courier.reply(
            request.reply_to,
            Done(
                request_id=request.request_id, sandbox_id=request.sandbox_id, detail=f"{size} bytes"
            ),
        )

    def read_file(self, request: ReadFile) -> None:
        """Read a file through the agent."""
        read = self.failures.by_agent(
            request, lambda c: c.read_file(request.path, request.max_bytes)
        )
        if isinstance(read, Failed):
            return
        data, truncated = read
        self._file_moved(request, len(data))
        self.courier.reply_with_data(
            request.reply_to,
            FileContent(
                request_id=request.request_id,
                sandbox_id=request.sandbox_id,
                data_b64="",
                truncated=truncated,
            ),
            {"data": data},
        )

    def _file_moved(self, request: WriteFile | ReadFile, size: int) -> None:
        """Record that a file crossed the sandbox's boundary."""
        written = isinstance(request, WriteFile)
        kind: type[FileWritten] | type[FileRead] = FileWritten if written else FileRead
        self.courier.event(
            kind(
                event_id=request.event_of("written" if written else "read"),
                **envelope(request, self.node_id),
                payload=FilePayload(
                    request_id=request.request_id, actor=request.actor, path=request.path, size=size
                ),
            )
        )
