"""Replies to a waiting trainer, on the partition of the replies topic it chose."""

from __future__ import annotations

import uuid
from typing import Annotated, Literal

from pydantic import Field, TypeAdapter

from app.domain.base import SCHEMA_VERSION, Message, fields_by_tag


class ReplyBase(Message):
    """Fields every reply carries."""

    request_id: uuid.UUID = Field(description="The request answered.")
    sandbox_id: str = Field(description="The sandbox concerned.")
    version: Literal[1] = Field(SCHEMA_VERSION, description="Schema version.")


class SandboxReady(ReplyBase):
    """The sandbox runs; commands may be sent."""

    kind: Literal["ready"] = "ready"
    node_id: str = Field(description="Node it runs on.")


class ExecOutput(ReplyBase):
    """A command's result."""

    kind: Literal["exec"] = "exec"
    exit_code: int = Field(description="Exit status; negative: killed by that signal.")
    stdout_b64: str = Field(description="Standard output, base64.")
    stderr_b64: str = Field(description="Standard error, base64.")
    duration_ms: float = Field(description="Wall time inside the sandbox.")
    timed_out: bool = Field(False, description="Killed by its timeout.")
    stdout_truncated: bool = Field(False, description="Stdout was capped.")
    stderr_truncated: bool = Field(False, description="Stderr was capped.")
    replayed: bool = Field(False, description="Answered from the trajectory log.")
    killed: bool = Field(False, description="Killed by a KillCommand before it ended.")


class OutputChunk(ReplyBase):
    """Output of a running command (Exec with ``stream_output``), before its ExecOutput.

    The chunks of one stream, in ``seq`` order, add up to the ExecOutput's output for
    that stream (both capped at ``max_output_bytes``). A step answered from the
    trajectory log streams nothing: its ExecOutput carries everything.
    """

    kind: Literal["output"] = "output"
    seq: int = Field(ge=0, description="Position among this command's chunks, from 0.")
    stream: Literal["stdout", "stderr"] = Field(description="Which stream it came from.")
    data_b64: str = Field(description="The bytes, base64.")


class FileContent(ReplyBase):
    """A file read from the sandbox."""

    kind: Literal["file"] = "file"
    data_b64: str = Field(description="Content, base64.")
    truncated: bool = Field(False, description="Cut at max_bytes.")


class Done(ReplyBase):
    """The request was carried out (write, destroy)."""

    kind: Literal["done"] = "done"
    detail: str = Field("", description="What happened.")


class ErrorReply(ReplyBase):
    """The request failed or was refused; ``reason`` is the event's reason."""

    kind: Literal["error"] = "error"
    reason: str = Field(description="Machine-readable reason (RejectReason or FailReason).")
    detail: str = Field(description="Human-readable explanation.")


Reply = Annotated[
    SandboxReady | ExecOutput | OutputChunk | FileContent | Done | ErrorReply,
    Field(discriminator="kind"),
]
REPLY_ADAPTER: TypeAdapter[Reply] = TypeAdapter(Reply)
#: Each reply kind's fields: what a tolerant reader (the SDK) keeps of a reply.
REPLY_FIELDS = fields_by_tag(Reply, "kind")
REPLY_KINDS = frozenset(REPLY_FIELDS)
