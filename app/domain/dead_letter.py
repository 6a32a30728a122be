"""A message no consumer could use, kept with its reason and original bytes."""

from __future__ import annotations

from datetime import datetime

from pydantic import Field

from app.domain.base import Message, utcnow


class DeadLetter(Message):
    """What was refused, by whom, from where, and why."""

    consumer: str = Field(description="The consumer that refused it.")
    topic: str = Field(description="Topic it was read from.")
    partition: int = Field(description="Partition it was read from.")
    offset: int = Field(description="Offset it was read at.")
    reason: str = Field(description="Machine-readable reason (DeadLetterReason).")
    detail: str = Field(description="Human-readable explanation.")
    original_b64: str = Field(description="The message's bytes, base64.")
    original_size: int = Field(description="Size of the original message in bytes.")
    original_truncated: bool = Field(False, description="Only the first bytes were kept.")
    key: str | None = Field(None, description="The message's key, if text.")
    headers: list[tuple[str, str]] = Field(
        default_factory=list,
        description="The message's record headers (name, value base64): its proof, for a replay.",
    )
    refused_at: datetime = Field(default_factory=utcnow, description="When it was refused.")
