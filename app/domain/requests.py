"""Requests (commands) a trainer sends on the requests topic, keyed by sandbox id."""

from __future__ import annotations

import binascii
import json
import re
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BeforeValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationInfo,
    model_validator,
)

from app.domain.base import SCHEMA_VERSION, Message, event_id, new_id, tags, utcnow
from app.domain.egress import NetworkPolicy

SandboxId = Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9_.-]{2,62}$")]
Name = Annotated[str, Field(min_length=1, max_length=128)]
#: Set by the platform from a request's proof; empty as a trainer sends it.
Owner = Annotated[str, Field(max_length=200)]
#: Absolute path inside a sandbox; traversal is refused again by the in-sandbox agent.
SandboxPath = Annotated[str, Field(pattern=r"^/", max_length=4096)]
#: Labels end up in events and projections: a few short ones (64, and room for the
#: platform's own group and lease labels on what it derives from a request).
Labels = Annotated[
    dict[
        Annotated[str, Field(min_length=1, max_length=128)],
        Annotated[str, Field(max_length=1024)],
    ],
    Field(max_length=66, fail_fast=True),
]
#: An environment variable's name (no "="), and a value Linux takes (MAX_ARG_STRLEN).
EnvName = Annotated[str, Field(pattern=r"^[^=]+$", max_length=1024)]
Env = Annotated[
    dict[EnvName, Annotated[str, Field(max_length=128 << 10)]],
    Field(max_length=1024, fail_fast=True),
]


def _strict_base64(value: str) -> str:
    try:
        binascii.a2b_base64(value, strict_mode=True)
    except binascii.Error as exc:
        raise ValueError(f"not base64: {exc}") from None
    return value


#: Bytes as base64 text, refused at the door if it does not decode.
Base64 = Annotated[str, AfterValidator(_strict_base64)]

#: The largest command, as JSON text: every command that runs is logged whole in its
#: CommandCompleted (and replayed from there), which must fit one message. Linux takes
#: no single argument longer than this either (MAX_ARG_STRLEN), so a shell string
#: beyond it could not run; larger scripts go in with WriteFile.
COMMAND_MAX_BYTES = 128 << 10


def _bounded_command(command: str | list[str]) -> str | list[str]:
    size = len(json.dumps(command, ensure_ascii=False).encode())
    if size > COMMAND_MAX_BYTES:
        raise ValueError(
            f"the command is {size} bytes as JSON, more than {COMMAND_MAX_BYTES}: "
            "write a long script to a file with WriteFile and run that"
        )
    return command


Command = Annotated[
    str | Annotated[list[str], Field(fail_fast=True)], AfterValidator(_bounded_command)
]


#: A UUID as text in its canonical form: lower-case hex, hyphenated 8-4-4-4-12.
CANONICAL_UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def _canonical(value: object) -> object:
    # Replies carry a request id in this form and reply keys are derived from it: an
    # id spelt otherwise (upper case, braces, no hyphens) would be answered under a
    # text its sender does not know, so it is refused instead.
    if isinstance(value, str) and not CANONICAL_UUID.match(value):
        raise ValueError(
            "a request id is a UUID in canonical form: lower-case hex, hyphenated 8-4-4-4-12"
        )
    return value


#: A request id (or the id of another request) as a trainer sends it.
RequestId = Annotated[
    uuid.UUID,
    BeforeValidator(_canonical),
    Field(json_schema_extra={"pattern": CANONICAL_UUID.pattern}),
]
#: The validation context of a request read off the bus (app/domain/codec.py).
WIRE = "wire"
#: What a request read off the bus must carry itself (see RequestBase).
STAMPED = ("request_id", "sent_at")


def _stamps_required(schema: dict[str, Any]) -> None:
    """The published schema says what the bus requires: see RequestBase."""
    required = {*schema.get("required", ()), *STAMPED}
    schema["required"] = [name for name in schema["properties"] if name in required]


class ReplyTo(Message):
    """Where a trainer waits for the answer."""

    topic: str = Field(max_length=249, description="Replies topic: the tenant's own.")
    partition: int = Field(ge=0, le=65_535, description="Partition the trainer reads.")


class RequestBase(Message):
    """Fields every request carries.

    ``request_id`` and ``sent_at`` are required on the bus, and signed with the rest:
    filled in by the platform, every copy of the same signed bytes would be a new
    request (never a replay) of unknown age. A request made in Python (the SDK, the
    platform's own) is stamped when it is made.
    """

    model_config = ConfigDict(json_schema_extra=_stamps_required)

    type: str = Field(description="Request type (the discriminator).")
    request_id: RequestId = Field(
        default_factory=new_id,
        description="Idempotency key, chosen by the sender: a UUID in canonical form.",
    )
    version: Literal[1] = Field(SCHEMA_VERSION, description="Schema version.")
    sandbox_id: SandboxId = Field(description="Target sandbox; also the Kafka key.")
    tenant: Owner = Field(
        "",
        description=(
            "Leave empty: the platform sets it from the request's proof (the sandbox's owner"
            " on what it forwards to a node). A value naming another tenant is refused."
        ),
    )
    job_id: Name = Field("default", description="The trainer's job, for audit and billing.")
    actor: Owner = Field(
        "",
        description=(
            "Leave empty: the platform sets it to the authenticated sender (tenant and key)."
        ),
    )
    sent_at: AwareDatetime = Field(
        default_factory=utcnow, description="Client clock, with its time zone (UTC: Z)."
    )
    reply_to: ReplyTo | None = Field(None, description="Where to answer, if anyone waits.")

    @property
    def scope(self) -> str:
        """The request as the platform keys what it does for it (claims, in-flight
        records): its id with the sender that proved it, since ids are the sender's to
        choose and two senders' equal ids are two requests."""
        return f"{self.actor}/{self.request_id}"

    def event_of(self, purpose: str) -> uuid.UUID:
        """The id of this request's event ``purpose`` (see :func:`event_id`)."""
        return event_id(self.request_id, self.actor, purpose)

    @model_validator(mode="before")
    @classmethod
    def _stamped_by_sender(cls, data: Any, info: ValidationInfo) -> Any:
        if info.context == WIRE and isinstance(data, dict):
            missing = [name for name in STAMPED if name not in data]
            if missing:
                raise ValueError(f"{' and '.join(missing)} missing: a request carries its own")
        return data


class SandboxShape(Message):
    """What a sandbox is made of (shared by single and group creates)."""

    image: Name = Field("dsec/busybox:latest", description="Image in the node's layer store.")
    cpus: float = Field(1.0, gt=0, le=64, description="CPU cores.")
    memory_mb: int = Field(512, ge=16, le=262_144, description="Memory limit, MiB.")
    disk_mb: int = Field(256, ge=1, le=65_536, description="Writable workspace size, MiB.")
    pids_limit: int = Field(256, ge=8, le=65_536, description="Most processes at once.")
    ttl_s: int = Field(3600, ge=1, le=7 * 86_400, description="Destroyed after this long.")
    network: bool | NetworkPolicy = Field(
        False,
        description=(
            "Network: false (none), true (egress anywhere but the node's own and"
            " link-local addresses) or an allowlist, denied by default (NetworkPolicy)."
        ),
    )
    env: Env = Field(default_factory=dict, description="Default environment.")
    labels: Labels = Field(default_factory=dict, description="Free-form labels (64 at most).")
    queue_s: float = Field(
        30.0, ge=0, le=3600, description="Wait this long for room (nodes, quota); 0: now or never."
    )
    lease_id: Name | None = Field(
        None, description="Tie the sandbox to this trainer lease (frozen when it lapses)."
    )

    @property
    def egress(self) -> NetworkPolicy | None:
        """The allowlist this sandbox's network keeps to; None: no allowlist."""
        return self.network if isinstance(self.network, NetworkPolicy) else None


class CreateSandbox(RequestBase, SandboxShape):
    """Ask for a new sandbox."""

    type: Literal["CreateSandbox"] = "CreateSandbox"
    restore_trajectory: Name | None = Field(
        None, description="Rebuild this trajectory's state: replay its commands, in order."
    )


class CreateGroup(RequestBase, SandboxShape):
    """Ask for a rollout group: all members are placed, or none is.

    ``sandbox_id`` names the group (and keys the message). Each member is answered as
    its own create, under the request id ``uuid5(request_id, member)``.
    """

    type: Literal["CreateGroup"] = "CreateGroup"
    members: list[SandboxId] = Field(
        min_length=1, max_length=4096, fail_fast=True, description="Member ids."
    )


class DestroyGroup(RequestBase):
    """Throw a rollout group away; each member answers under ``uuid5(request_id, member)``."""

    type: Literal["DestroyGroup"] = "DestroyGroup"


class Exec(RequestBase):
    """Run one command in a sandbox."""

    type: Literal["Exec"] = "Exec"
    command: Command = Field(description="Shell string, or argv list (128 KiB at most).")
    env: Env = Field(default_factory=dict, description="Extra environment.")
    cwd: SandboxPath | None = Field(None, description="Working directory (default /workspace).")
    timeout_s: float = Field(
        60.0, gt=0, le=86_400, description="Kills the command, not the sandbox."
    )
    max_output_bytes: int = Field(1 << 20, ge=0, le=16 << 20, description="Cap per stream.")
    stdin_b64: Base64 = Field("", description="Standard input, base64.")
    trajectory_id: Name | None = Field(None, description="Trajectory this step belongs to.")
    step: int | None = Field(None, ge=0, description="Step number within the trajectory.")
    stream_output: bool = Field(
        False,
        description="Send OutputChunk replies while the command runs, before its ExecOutput.",
    )


class KillCommand(RequestBase):
    """Kill a command running in a sandbox (its process group gets SIGKILL).

    The command's own reply then comes as usual, with ``killed`` set and the output
    streamed until then; this request is answered ``killed``, or ``not running`` if the
    command had already ended (or never ran in this sandbox).
    """

    type: Literal["KillCommand"] = "KillCommand"
    command_id: RequestId = Field(description="The request id of the Exec to kill.")


class WriteFile(RequestBase):
    """Write a file inside a sandbox."""

    type: Literal["WriteFile"] = "WriteFile"
    path: SandboxPath = Field(description="Absolute path inside the sandbox.")
    data_b64: Base64 = Field(description="Content, base64.")
    mode: int = Field(0o644, ge=0, le=0o7777, description="Permission bits.")


class ReadFile(RequestBase):
    """Read a file from a sandbox."""

    type: Literal["ReadFile"] = "ReadFile"
    path: SandboxPath = Field(description="Absolute path inside the sandbox.")
    max_bytes: int = Field(1 << 20, ge=0, le=16 << 20, description="Read at most this much.")


class DestroySandbox(RequestBase):
    """Throw a sandbox away."""

    type: Literal["DestroySandbox"] = "DestroySandbox"
    reason: Literal["destroyed", "lease_lapsed"] = Field(
        "destroyed", description="Recorded as the SandboxStopped reason."
    )


class FreezeSandbox(RequestBase):
    """Stop every process in a sandbox, keeping its state (SIGSTOP)."""

    type: Literal["FreezeSandbox"] = "FreezeSandbox"
    reason: str = Field("requested", max_length=64, description="Why (e.g. lease_lapsed).")


class ThawSandbox(RequestBase):
    """Let a frozen sandbox's processes run again (SIGCONT)."""

    type: Literal["ThawSandbox"] = "ThawSandbox"


class SnapshotSandbox(RequestBase):
    """Keep a sandbox's files as an image of its tenant: its image with what its
    /workspace holds now, pushed to the hub as ``tenants/<tenant>/<name>:<tag>``
    (answered ``done`` with that name, which creates then start sandboxes from)."""

    type: Literal["SnapshotSandbox"] = "SnapshotSandbox"
    name: str = Field(
        pattern=r"^[a-z0-9]+(?:[._-][a-z0-9]+)*(?:/[a-z0-9]+(?:[._-][a-z0-9]+)*)*$",
        max_length=100,
        description="Image name within the tenant's namespace (lower case, / between parts).",
    )
    tag: str = Field(
        "latest", pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$", description="Image tag."
    )


class ExposePort(RequestBase):
    """Open a port of the sandbox to HTTP and WebSocket clients: answered ``done``
    with a URL carrying a signed token, which works until ``ttl_s`` has passed or the
    sandbox ends (docs/isolation.md)."""

    type: Literal["ExposePort"] = "ExposePort"
    port: int = Field(ge=1, le=65535, description="The port a server in the sandbox listens on.")
    ttl_s: int = Field(3600, ge=1, le=7 * 86_400, description="The URL works this long.")


class RenewLease(RequestBase):
    """A trainer is alive: ``sandbox_id`` names its lease (and keys the message)."""

    type: Literal["RenewLease"] = "RenewLease"
    ttl_s: float = Field(30.0, ge=1, le=3600, description="Lapses this long after now.")
    grace_s: float = Field(
        300.0, ge=0, le=86_400, description="Frozen this long after a lapse, then destroyed."
    )


Request = Annotated[
    CreateSandbox
    | CreateGroup
    | DestroyGroup
    | Exec
    | KillCommand
    | WriteFile
    | ReadFile
    | DestroySandbox
    | FreezeSandbox
    | ThawSandbox
    | SnapshotSandbox
    | ExposePort
    | RenewLease,
    Field(discriminator="type"),
]
REQUEST_ADAPTER: TypeAdapter[Request] = TypeAdapter(Request)
REQUEST_TYPES = tags(Request, "type")
#: Label carried by every member of a rollout group.
GROUP_LABEL = "dsec.group"
#: Label the scheduler puts on a leased sandbox's SandboxRequested: its lease id.
LEASE_LABEL = "dsec.lease"


def member_request_id(group_request_id: uuid.UUID, member: str) -> uuid.UUID:
    """The request id under which a group member is created or destroyed."""
    return uuid.uuid5(group_request_id, member)


def member_envelope(group: RequestBase, member: str) -> dict[str, Any]:
    """The envelope of the request a group request makes for one member: its own id
    (derived, so a retry makes the same), the group's owner, actor and reply topic."""
    return {
        "request_id": member_request_id(group.request_id, member),
        "sandbox_id": member,
        "tenant": group.tenant,
        "job_id": group.job_id,
        "actor": group.actor,
        "sent_at": group.sent_at,
        "reply_to": group.reply_to,
    }


def expand_group(group: CreateGroup) -> list[CreateSandbox]:
    """The member creates of a group request."""
    shape = group.model_dump(include=set(SandboxShape.model_fields))
    shape["labels"] = {**group.labels, GROUP_LABEL: group.sandbox_id}
    return [CreateSandbox(**member_envelope(group, member), **shape) for member in group.members]
