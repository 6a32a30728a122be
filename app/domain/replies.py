"""Replies to a waiting trainer, on the partition of the replies topic it chose."""

from __future__ import annotations

import base64
import hashlib
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
    direct: bool = Field(
        False,
        description=(
            "Its creator's commands may go straight to the node's inbox, proven under the"
            ' sandbox\'s key (docs/protocol.md, "The direct route").'
        ),
    )


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
    pieces: int = Field(
        0,
        ge=0,
        description=(
            "ReplyPiece records sent before this one with its output (then stdout_b64 and"
            " stderr_b64 are empty here): no reply record exceeds reply_piece_bytes of data."
        ),
    )
    sha256: dict[str, str] = Field(
        default_factory=dict,
        fail_fast=True,
        description="SHA-256 (hex) of each part sent in pieces: stdout, stderr.",
    )


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


class ReplyPiece(ReplyBase):
    """A piece of a large reply's data, sent before that reply on the same partition.

    The pieces of one part (``stdout``, ``stderr`` or a file's ``data``), in ``seq``
    order, add up to it; the reply that follows says how many pieces there were and
    the SHA-256 of each part, which the SDK checks before it hands the result over.
    """

    kind: Literal["piece"] = "piece"
    seq: int = Field(ge=0, description="Position among this reply's pieces, from 0.")
    part: Literal["stdout", "stderr", "data"] = Field(description="Which data it belongs to.")
    data_b64: str = Field(description="The bytes, base64.")


class FileContent(ReplyBase):
    """A file read from the sandbox."""

    kind: Literal["file"] = "file"
    data_b64: str = Field(description="Content, base64.")
    truncated: bool = Field(False, description="Cut at max_bytes.")
    pieces: int = Field(
        0, ge=0, description="ReplyPiece records sent before this one with the content."
    )
    sha256: dict[str, str] = Field(
        default_factory=dict,
        fail_fast=True,
        description="SHA-256 (hex) of the content (part data) if in pieces.",
    )


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
    SandboxReady | ExecOutput | OutputChunk | ReplyPiece | FileContent | Done | ErrorReply,
    Field(discriminator="kind"),
]
REPLY_ADAPTER: TypeAdapter[Reply] = TypeAdapter(Reply)
#: Each reply kind's fields: what a tolerant reader (the SDK) keeps of a reply.
REPLY_FIELDS = fields_by_tag(Reply, "kind")
REPLY_KINDS = frozenset(REPLY_FIELDS)


class IncompletePieces(ValueError):
    """A reply's pieces do not add up to what it says they were."""


def join_pieces(
    reply: ExecOutput | FileContent, pieces: list[ReplyPiece]
) -> ExecOutput | FileContent:
    """``reply`` with the data its pieces carried put back in; raises
    :class:`IncompletePieces` if one is missing or a part's digest does not match."""
    if not reply.pieces:
        return reply
    by_seq = {piece.seq: piece for piece in pieces}  # a piece delivered twice counts once
    if sorted(by_seq) != list(range(reply.pieces)):
        raise IncompletePieces(
            f"reply {reply.request_id}: {len(by_seq)} of {reply.pieces} pieces arrived"
        )
    parts: dict[str, bytearray] = {part: bytearray() for part in reply.sha256}
    for seq in range(reply.pieces):
        piece = by_seq[seq]
        if piece.part not in parts:
            raise IncompletePieces(f"reply {reply.request_id}: a piece of unknown {piece.part}")
        parts[piece.part] += base64.b64decode(piece.data_b64)
    for part, data in parts.items():
        if hashlib.sha256(data).hexdigest() != reply.sha256[part]:
            raise IncompletePieces(f"reply {reply.request_id}: {part} does not match its digest")
    filled = {f"{part}_b64": base64.b64encode(bytes(data)).decode() for part, data in parts.items()}
    return reply.model_copy(update={**filled, "pieces": 0, "sha256": {}})
