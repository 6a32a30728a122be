"""What the image hub reports happened to it (Distribution's notifications), read
into the rows of its audit trail (pure).

The registry posts envelopes of events as they happen (``push`` of a blob or a
manifest, ``delete``; pulls are not reported to us); each names the repository, the
digest, the size and the token's subject (a key id). Anything that does not parse is
dropped with a count, never half-read: the registry retries what was not answered,
and a report it sends again is the same event id.
"""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from app.domain.hub_access import job_of, owner_of

#: Actions the audit keeps.
KEPT = frozenset({"push", "delete"})


class _Reference(BaseModel):
    model_config = ConfigDict(extra="ignore")

    digest: str = Field(min_length=1, max_length=200)
    size: int = Field(0, ge=0)


class _Target(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    media_type: str = Field("", alias="mediaType")
    size: int = Field(0, ge=0)
    digest: str = Field(min_length=1, max_length=200)
    repository: str = Field(min_length=1, max_length=255)
    tag: str | None = Field(None, max_length=128)
    #: A manifest's blobs (its configuration and layers).
    references: list[_Reference] = Field(default_factory=list)


class _Actor(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field("", max_length=200)


class _Event(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str = Field(min_length=1, max_length=200)
    timestamp: datetime
    action: str
    target: _Target
    actor: _Actor = Field(default_factory=_Actor)


class HubEvent(BaseModel):
    """One row of the hub's audit trail."""

    model_config = ConfigDict(frozen=True)

    event_id: str
    at: datetime
    action: str
    actor_key: str
    tenant: str | None
    #: The job a snapshot's storage is billed to (None: a tenant's own push).
    job: str | None
    repository: str
    tag: str | None
    digest: str
    media_type: str
    size: int
    #: What a manifest push references (None: a blob, or a deletion).
    refs: list[dict[str, str | int]] | None = None


def read_envelope(body: object) -> tuple[list[HubEvent], int]:
    """The events of a notification envelope worth keeping, and how many were dropped
    as malformed (pulls and mounts are not counted: they are not kept by design)."""
    if not isinstance(body, dict) or not isinstance(body.get("events"), list):
        return [], 1
    kept: list[HubEvent] = []
    dropped = 0
    for raw in body["events"]:
        try:
            event = _Event.model_validate(raw)
        except ValidationError:
            dropped += 1
            continue
        if event.action not in KEPT:
            continue
        target = event.target
        kept.append(
            HubEvent(
                event_id=event.id,
                at=event.timestamp,
                action=event.action,
                actor_key=event.actor.name or "-",
                tenant=owner_of(target.repository),
                job=job_of(event.actor.name),
                repository=target.repository,
                tag=target.tag,
                digest=target.digest,
                media_type=target.media_type or "application/octet-stream",
                size=target.size,
                refs=_refs(event.action, target),
            )
        )
    return kept, dropped


def _refs(action: str, target: _Target) -> list[dict[str, str | int]] | None:
    """A manifest push's references as the audit keeps them; None for anything else
    (a manifest is what names a tag or references blobs)."""
    if action != "push" or not (target.references or target.tag is not None):
        return None
    return [{"digest": r.digest, "size": r.size} for r in target.references]
