"""Events: immutable facts on the events topic, appended to the Postgres log.

Every event is an envelope (id, type, subject, tenant, job, clock, version) around a
payload typed per event type. ``event_id`` is set by the producer and is the log's
idempotency key.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated, Literal

from pydantic import Field, TypeAdapter

from app.domain.base import (
    SCHEMA_VERSION,
    FailReason,
    Message,
    RejectReason,
    StopReason,
    new_id,
    tags,
    utcnow,
)
from app.domain.egress import NetworkPolicy


class EventBase(Message):
    """The envelope every event carries."""

    event_id: uuid.UUID = Field(default_factory=new_id, description="Producer-set unique id.")
    version: Literal[1] = Field(SCHEMA_VERSION, description="Schema version.")
    sandbox_id: str | None = Field(None, description="Subject sandbox, if any (Kafka key).")
    node_id: str | None = Field(None, description="Node concerned, if any.")
    tenant: str = Field("system", description="Who pays.")
    job_id: str = Field("default", description="The trainer's job.")
    occurred_at: datetime = Field(default_factory=utcnow, description="Producer clock.")

    @property
    def key(self) -> str:
        """Kafka key: keeps every message about one subject in order."""
        return self.sandbox_id or self.node_id or str(self.event_id)


# --- payloads --------------------------------------------------------------------


class RequestedPayload(Message):
    """What the trainer asked for."""

    request_id: uuid.UUID = Field(description="The CreateSandbox request.")
    actor: str = Field(description="Who asked.")
    image: str = Field(description="Image name.")
    cpus: float = Field(description="CPU cores.")
    memory_mb: int = Field(description="Memory limit, MiB.")
    disk_mb: int = Field(description="Workspace size, MiB.")
    ttl_s: int = Field(description="Time to live, seconds.")
    network: bool = Field(description="Egress allowed (anywhere, or by its allowlist).")
    egress: NetworkPolicy | None = Field(
        None, description="The allowlist egress keeps to; None: anywhere (or no network)."
    )
    labels: dict[str, str] = Field(default_factory=dict, fail_fast=True, description="Labels.")


class ScheduledPayload(Message):
    """Where the sandbox was placed."""

    request_id: uuid.UUID = Field(description="The CreateSandbox request.")
    node_id: str = Field(description="Chosen node.")


class RejectedPayload(Message):
    """Why a request was refused."""

    request_id: uuid.UUID | None = Field(description="The refused request, if parseable.")
    request_type: str = Field(description="Type of the refused request.")
    reason: RejectReason = Field(description="Machine-readable reason.")
    detail: str = Field(description="Human-readable explanation.")
    actor: str | None = Field(
        None, description="The authenticated sender; None if the request proved nobody."
    )
    folded: int | None = Field(
        None,
        ge=1,
        description=(
            "A sample of refusals of one kind (no proof, or maybe a copy): how many it"
            " stands for. 1: the first of its window, logged at once; more: the rest of"
            " the window, logged when it closes. None: this refusal alone."
        ),
    )


class StartedPayload(Message):
    """The sandbox runs and its agent answers."""

    request_id: uuid.UUID = Field(description="The CreateSandbox request.")
    container_id: str = Field(description="Podman container id.")
    warm: bool = Field(False, description="Claimed from a warm pool.")
    image_digest: str | None = Field(
        None,
        max_length=80,
        description=(
            "A tenant's image: the manifest it runs (its name's first push; None for the"
            " platform's images)."
        ),
    )


class FailedPayload(Message):
    """A node could not do what was asked."""

    request_id: uuid.UUID | None = Field(description="The failed request.")
    request_type: str = Field(description="Type of the failed request.")
    reason: FailReason = Field(description="Machine-readable reason.")
    detail: str = Field(description="Human-readable explanation.")


class LastState(Message):
    """How a sandbox stood when it ended, as whoever ended it saw it (a field is None
    where that one could not know: a scheduler declaring a node lost sees no cgroup)."""

    observed_by: Literal["node", "scheduler", "projector"] = Field(
        description="Who captured it (the projector: its rule for lives on lost nodes)."
    )
    cpu_s: float | None = Field(None, description="CPU time its processes used, seconds.")
    memory_peak_mb: float | None = Field(None, description="Peak memory use, MiB.")
    processes: int | None = Field(None, description="Processes alive at the end (agent too).")
    oom_kills: int | None = Field(None, description="Processes the OOM killer killed.")
    commands: int | None = Field(
        None, description="Commands this node ran in it (since its worker started)."
    )
    last_command: str | None = Field(None, description="The last of them (first 200 chars).")
    last_exit_code: int | None = Field(None, description="How the last command ended.")
    frozen: bool | None = Field(None, description="Frozen by a lapsed lease when it ended.")
    egress_refused: int | None = Field(
        None,
        description="Connections and names its egress allowlist refused (allowlisted only).",
    )
    egress_refused_sample: list[Annotated[str, Field(max_length=300)]] | None = Field(
        None,
        max_length=16,
        fail_fast=True,
        description=(
            "Some of what it was refused: names its resolver refused, and TCP"
            " destinations as address:port (allowlisted only; at most 16)."
        ),
    )
    last_heartbeat_at: datetime | None = Field(
        None, description="When its node was last heard from (node_lost)."
    )


class StoppedPayload(Message):
    """The sandbox is gone."""

    reason: StopReason = Field(description="Why it ended.")
    detail: str = Field("", description="Human-readable explanation.")
    request_id: uuid.UUID | None = Field(None, description="The Destroy request, if any.")
    actor: str | None = Field(
        None, description="Who asked for the end (the authenticated sender); None: the platform."
    )
    last_state: LastState | None = Field(None, description="How it stood when it ended.")


class CommandPayload(Message):
    """One command ran (or was answered from the trajectory log)."""

    request_id: uuid.UUID = Field(description="The Exec request.")
    actor: str = Field(description="Who asked.")
    command: str | Annotated[list[str], Field(fail_fast=True)] = Field(description="What ran.")
    exit_code: int = Field(description="Exit status; negative: killed by that signal.")
    duration_ms: float = Field(description="Wall time inside the sandbox.")
    stdout_bytes: int = Field(description="Bytes of stdout kept.")
    stderr_bytes: int = Field(description="Bytes of stderr kept.")
    stdout_head: str = Field("", description="First bytes of stdout, for the audit trail.")
    stderr_head: str = Field("", description="First bytes of stderr, for the audit trail.")
    timed_out: bool = Field(False, description="Killed by its timeout.")
    truncated: bool = Field(False, description="Output was capped.")
    killed_by: str | None = Field(
        None, description="Who killed it with a KillCommand (the authenticated sender)."
    )
    trajectory_id: str | None = Field(None, description="Trajectory, if any.")
    step: int | None = Field(None, description="Step within the trajectory.")
    stdout_b64: str | None = Field(
        None, description="Whole stdout, base64: kept for trajectory steps, to replay them."
    )
    stderr_b64: str | None = Field(None, description="Whole stderr, base64 (trajectory steps).")


class ReplayedPayload(Message):
    """A trajectory step was answered from the log instead of running again."""

    request_id: uuid.UUID = Field(description="The Exec request answered.")
    actor: str = Field(description="Who asked.")
    trajectory_id: str = Field(description="Trajectory.")
    step: int = Field(description="Step within the trajectory.")
    original_request_id: uuid.UUID = Field(description="The request that really ran it.")


class FilePayload(Message):
    """A file crossed the sandbox boundary."""

    request_id: uuid.UUID = Field(description="The WriteFile/ReadFile request.")
    actor: str = Field(description="Who asked.")
    path: str = Field(description="Path inside the sandbox.")
    size: int = Field(description="Bytes moved.")


class PortPayload(Message):
    """A port of the sandbox was opened at a URL (its token is not logged)."""

    request_id: uuid.UUID = Field(description="The ExposePort request.")
    actor: str = Field(description="Who asked.")
    port: int = Field(description="The sandbox's port.")
    expires_at: datetime = Field(description="When the URL stops working.")


class FreezePayload(Message):
    """Why a sandbox was frozen or thawed."""

    reason: str = Field(description="lease_lapsed, requested, lease_renewed ...")
    request_id: uuid.UUID | None = Field(None, description="The request behind it.")
    actor: str | None = Field(None, description="Who asked (the authenticated sender).")


class NodePayload(Message):
    """A node's declared capacity and current load."""

    capacity_sandboxes: int = Field(description="Sandboxes it accepts.")
    capacity_cpus: float = Field(description="CPUs it offers.")
    capacity_memory_mb: int = Field(description="Memory it offers, MiB.")
    running: int = Field(0, description="Sandboxes running now.")
    images: list[str] = Field(
        default_factory=list, fail_fast=True, description="Images in its layer store."
    )
    queue: str = Field(description="Celery queue the node consumes.")
    sandboxes: list[str] | None = Field(
        None,
        fail_fast=True,
        description="Sandboxes it runs (or is creating) now; None: not reported.",
    )
    max_sandbox_cpus: float | None = Field(
        None, description="Most CPUs one sandbox may have here (the host's cores)."
    )
    max_sandbox_memory_mb: int | None = Field(
        None, description="Most memory one sandbox may have here (the host's, less a reserve)."
    )
    max_sandbox_pids: int | None = Field(
        None, description="Most processes one sandbox may have here (a share of pid_max)."
    )


class NodeLostPayload(Message):
    """Why a node was declared lost."""

    detail: str = Field(description="Human-readable explanation.")


# --- events ----------------------------------------------------------------------


class SandboxRequested(EventBase):
    """A trainer asked for a sandbox and the request was valid."""

    type: Literal["SandboxRequested"] = "SandboxRequested"
    payload: RequestedPayload


class SandboxScheduled(EventBase):
    """The scheduler placed the sandbox on a node."""

    type: Literal["SandboxScheduled"] = "SandboxScheduled"
    payload: ScheduledPayload


class SandboxRejected(EventBase):
    """A request was refused before reaching a node."""

    type: Literal["SandboxRejected"] = "SandboxRejected"
    payload: RejectedPayload


class SandboxStarted(EventBase):
    """The sandbox's container runs and its agent answered."""

    type: Literal["SandboxStarted"] = "SandboxStarted"
    payload: StartedPayload


class SandboxFailed(EventBase):
    """A node failed to carry out a request about this sandbox."""

    type: Literal["SandboxFailed"] = "SandboxFailed"
    payload: FailedPayload


class SandboxStopped(EventBase):
    """The sandbox ended; its container is gone."""

    type: Literal["SandboxStopped"] = "SandboxStopped"
    payload: StoppedPayload


class SandboxFrozen(EventBase):
    """Every process of the sandbox was stopped; its state is kept."""

    type: Literal["SandboxFrozen"] = "SandboxFrozen"
    payload: FreezePayload


class SandboxThawed(EventBase):
    """A frozen sandbox runs again."""

    type: Literal["SandboxThawed"] = "SandboxThawed"
    payload: FreezePayload


class CommandCompleted(EventBase):
    """A command finished in the sandbox."""

    type: Literal["CommandCompleted"] = "CommandCompleted"
    payload: CommandPayload

    def without_outputs(self) -> CommandCompleted:
        """The same record without the step outputs replays answer with: what the log
        keeps of a command whose record would not fit one message. The command ran; its
        record must not be lost for its size (a replay then runs the step again)."""
        payload = self.payload.model_copy(
            update={"stdout_b64": None, "stderr_b64": None, "truncated": True}
        )
        return self.model_copy(update={"payload": payload})


class CommandReplayed(EventBase):
    """A trajectory step was answered from the log without running again."""

    type: Literal["CommandReplayed"] = "CommandReplayed"
    payload: ReplayedPayload


class FileWritten(EventBase):
    """A file was written into the sandbox."""

    type: Literal["FileWritten"] = "FileWritten"
    payload: FilePayload


class FileRead(EventBase):
    """A file was read out of the sandbox."""

    type: Literal["FileRead"] = "FileRead"
    payload: FilePayload


class PortExposed(EventBase):
    """A port of the sandbox was opened to HTTP and WebSocket clients."""

    type: Literal["PortExposed"] = "PortExposed"
    payload: PortPayload


class NodeRegistered(EventBase):
    """A node worker came up."""

    type: Literal["NodeRegistered"] = "NodeRegistered"
    payload: NodePayload


class NodeHeartbeat(EventBase):
    """A node is alive; its load now."""

    type: Literal["NodeHeartbeat"] = "NodeHeartbeat"
    payload: NodePayload


class NodeLost(EventBase):
    """A node missed its heartbeats."""

    type: Literal["NodeLost"] = "NodeLost"
    payload: NodeLostPayload


Event = Annotated[
    SandboxRequested
    | SandboxScheduled
    | SandboxRejected
    | SandboxStarted
    | SandboxFailed
    | SandboxStopped
    | SandboxFrozen
    | SandboxThawed
    | CommandCompleted
    | CommandReplayed
    | FileWritten
    | FileRead
    | PortExposed
    | NodeRegistered
    | NodeHeartbeat
    | NodeLost,
    Field(discriminator="type"),
]
EVENT_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)
EVENT_TYPES = tags(Event, "type")
