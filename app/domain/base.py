"""Shared pieces of every message: strict models, ids, clocks, enums of reasons."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict

#: Longest detail a refusal, a failure or a dead letter carries: it is stored and sent
#: on, and a sender must not make it as large as it likes.
MAX_DETAIL = 2000
#: Version of the message schemas this code writes.
SCHEMA_VERSION: Literal[1] = 1
#: The versions it reads: the wire protocol a platform serves and an SDK speaks. A
#: platform refuses a request of another version with ``unsupported_version``.
PROTOCOL_VERSIONS: tuple[int, ...] = (SCHEMA_VERSION,)


class Message(BaseModel):
    """Base of every message on the bus: immutable, unknown fields rejected, no
    infinities or NaN (JSON has none, and Postgres' jsonb refuses them)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


def new_id() -> uuid.UUID:
    """A fresh random id (event ids, request ids)."""
    return uuid.uuid4()


def derived_id(parent: uuid.UUID, purpose: str) -> uuid.UUID:
    """A deterministic id for a fact derived from ``parent``.

    Re-processing the same request after a crash yields the same event id, so the
    log's ``event_id`` uniqueness turns a redelivery into a no-op.
    """
    return uuid.uuid5(parent, purpose)


def event_id(request_id: uuid.UUID, actor: str, purpose: str) -> uuid.UUID:
    """The id of the event ``purpose`` of request ``request_id`` sent by ``actor``:
    request ids are the sender's to choose, so two senders' equal ids must never
    name one event (the log would keep one of them)."""
    return derived_id(request_id, f"{purpose}:{actor}")


def utcnow() -> datetime:
    """Timezone-aware now, UTC."""
    return datetime.now(UTC)


def new_sandbox_id() -> str:
    """A sandbox id: short, URL- and container-name-safe."""
    return "sb-" + uuid.uuid4().hex[:20]


class NodeState(StrEnum):
    """A node as the log tells it (the ``nodes`` projection's ``state``)."""

    #: Its heartbeats arrive.
    ALIVE = "alive"
    #: Declared lost (no heartbeat within the timeout); its sandboxes ended node_lost.
    LOST = "lost"


class StopReason(StrEnum):
    """Why a sandbox ended."""

    DESTROYED = "destroyed"
    TTL = "ttl"
    OOM = "oom"
    FAILED = "failed"
    NODE_LOST = "node_lost"
    LEASE_LAPSED = "lease_lapsed"
    #: Placed, and never started by the time its create could still start: the node
    #: never answered (its task was lost with its worker and Redis).
    CREATE_LOST = "create_lost"


class RejectReason(StrEnum):
    """Why a request was refused before it reached a node."""

    INVALID = "invalid"
    CAPACITY = "capacity"
    QUOTA = "quota"
    NO_NODES = "no_nodes"
    UNKNOWN_SANDBOX = "unknown_sandbox"
    SANDBOX_NOT_RUNNING = "sandbox_not_running"
    #: A replay: the request id was already handled elsewhere on the bus.
    DUPLICATE = "duplicate"
    #: A create names a sandbox id that is taken (live, waiting or ended: never reused).
    ID_IN_USE = "id_in_use"
    UNAUTHENTICATED = "unauthenticated"
    FORBIDDEN = "forbidden"
    #: The request's protocol version is not one this platform serves.
    UNSUPPORTED_VERSION = "unsupported_version"


class FailReason(StrEnum):
    """Why a node could not do what it was asked."""

    IMAGE_NOT_FOUND = "image_not_found"
    RUNTIME_ERROR = "runtime_error"
    AGENT_UNAVAILABLE = "agent_unavailable"
    SANDBOX_NOT_RUNNING = "sandbox_not_running"
    TIMEOUT = "timeout"
    REFUSED = "refused"
    INTERNAL = "internal"
    INCOMPATIBLE = "incompatible"
    NO_SPACE = "no_space"
    INTERRUPTED = "interrupted"


def fields_by_tag(union: Any, field: str) -> dict[str, frozenset[str]]:
    """Each member of an annotated union of models, by its discriminator value
    (``field``'s default), with the names of its fields: the message kinds a decoder
    knows, listed once, by the union itself."""
    members = get_args(get_args(union)[0])
    return {str(m.model_fields[field].default): frozenset(m.model_fields) for m in members}


def tags(union: Any, field: str) -> frozenset[str]:
    """The discriminator values of an annotated union of models (see above)."""
    return frozenset(fields_by_tag(union, field))
