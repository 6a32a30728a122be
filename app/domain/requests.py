"""Requests (commands) a trainer sends on the requests topic, keyed by sandbox id."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated, Literal

from pydantic import Field, TypeAdapter

from app.domain.base import SCHEMA_VERSION, Message, new_id, utcnow

SandboxId = Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9_.-]{2,62}$")]
Name = Annotated[str, Field(min_length=1, max_length=128)]
#: Absolute path inside a sandbox; traversal is refused again by the in-sandbox agent.
SandboxPath = Annotated[str, Field(pattern=r"^/", max_length=4096)]


class ReplyTo(Message):
    """Where a trainer waits for the answer."""

    topic: str = Field(description="Replies topic.")
    partition: int = Field(ge=0, description="Partition the trainer reads.")


class RequestBase(Message):
    """Fields every request carries."""

    type: str = Field(description="Request type (the discriminator).")
    request_id: uuid.UUID = Field(default_factory=new_id, description="Idempotency key.")
    version: Literal[1] = Field(SCHEMA_VERSION, description="Schema version.")
    sandbox_id: SandboxId = Field(description="Target sandbox; also the Kafka key.")
    tenant: Name = Field(description="Who pays.")
    job_id: Name = Field("default", description="The trainer's job, for audit and billing.")
    actor: Name = Field("sdk", description="Who sent it (user, host, service), for audit.")
    sent_at: datetime = Field(default_factory=utcnow, description="Client clock.")
    reply_to: ReplyTo | None = Field(None, description="Where to answer, if anyone waits.")


class CreateSandbox(RequestBase):
    """Ask for a new sandbox."""

    type: Literal["CreateSandbox"] = "CreateSandbox"
    image: Name = Field("dsec/busybox:latest", description="Image in the node's layer store.")
    cpus: float = Field(1.0, gt=0, le=64, description="CPU cores.")
    memory_mb: int = Field(512, ge=16, le=262_144, description="Memory limit, MiB.")
    disk_mb: int = Field(256, ge=1, le=65_536, description="Writable workspace size, MiB.")
    pids_limit: int = Field(256, ge=8, le=65_536, description="Most processes at once.")
    ttl_s: int = Field(3600, ge=1, le=7 * 86_400, description="Destroyed after this long.")
    network: bool = Field(False, description="Allow network egress.")
    env: dict[str, str] = Field(default_factory=dict, description="Default environment.")
    labels: dict[str, str] = Field(default_factory=dict, description="Free-form labels.")
    restore_trajectory: Name | None = Field(
        None, description="Rebuild this trajectory's state: replay its commands, in order."
    )


class Exec(RequestBase):
    """Run one command in a sandbox."""

    type: Literal["Exec"] = "Exec"
    command: str | list[str] = Field(description="Shell string, or argv list.")
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment.")
    cwd: SandboxPath | None = Field(None, description="Working directory (default /workspace).")
    timeout_s: float = Field(
        60.0, gt=0, le=86_400, description="Kills the command, not the sandbox."
    )
    max_output_bytes: int = Field(1 << 20, ge=0, le=16 << 20, description="Cap per stream.")
    stdin_b64: str = Field("", description="Standard input, base64.")
    trajectory_id: Name | None = Field(None, description="Trajectory this step belongs to.")
    step: int | None = Field(None, ge=0, description="Step number within the trajectory.")


class WriteFile(RequestBase):
    """Write a file inside a sandbox."""

    type: Literal["WriteFile"] = "WriteFile"
    path: SandboxPath = Field(description="Absolute path inside the sandbox.")
    data_b64: str = Field(description="Content, base64.")
    mode: int = Field(0o644, ge=0, le=0o7777, description="Permission bits.")


class ReadFile(RequestBase):
    """Read a file from a sandbox."""

    type: Literal["ReadFile"] = "ReadFile"
    path: SandboxPath = Field(description="Absolute path inside the sandbox.")
    max_bytes: int = Field(1 << 20, ge=0, le=16 << 20, description="Read at most this much.")


class DestroySandbox(RequestBase):
    """Throw a sandbox away."""

    type: Literal["DestroySandbox"] = "DestroySandbox"


Request = Annotated[
    CreateSandbox | Exec | WriteFile | ReadFile | DestroySandbox,
    Field(discriminator="type"),
]
REQUEST_ADAPTER: TypeAdapter[Request] = TypeAdapter(Request)
REQUEST_TYPES = frozenset({"CreateSandbox", "Exec", "WriteFile", "ReadFile", "DestroySandbox"})
