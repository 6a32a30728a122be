"""Creates as the dispatcher handles them, without I/O: a create (or a whole rollout
group) waiting for room, a trainer waiting for its sandbox to start, the events that
place a sandbox, and why a create was refused, in words a trainer can act on."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from app.domain.base import RejectReason, utcnow
from app.domain.events import (
    RequestedPayload,
    SandboxRequested,
    SandboxScheduled,
    ScheduledPayload,
)
from app.domain.gate import Sender
from app.domain.placement import SandboxMax
from app.domain.requests import CreateSandbox, ReplyTo


@dataclass
class Pending:
    """Creates waiting for room: one sandbox, or a whole rollout group."""

    members: list[CreateSandbox]
    sender: Sender
    partition: int
    offset: int
    deadline_s: float
    group: str | None = None


@dataclass(frozen=True)
class Waiting:
    """A trainer waiting for a sandbox to start."""

    request_id: uuid.UUID
    reply_to: ReplyTo | None
    sender: Sender


def placement_events(
    request: CreateSandbox, node_id: str, labels: dict[str, str]
) -> tuple[SandboxRequested, SandboxScheduled]:
    """Requested and Scheduled for one placed sandbox, their ids derived from the
    request's, so deciding twice appends once. ``labels`` are the request's with what
    the log must keep (its lease). A request stamped in the future is logged as of now."""
    common = {"sandbox_id": request.sandbox_id, "tenant": request.tenant, "job_id": request.job_id}
    requested = SandboxRequested(
        event_id=request.event_of("requested"),
        occurred_at=request.sent_at if request.sent_at <= utcnow() else utcnow(),
        payload=RequestedPayload(
            request_id=request.request_id,
            actor=request.actor,
            image=request.image,
            cpus=request.cpus,
            memory_mb=request.memory_mb,
            disk_mb=request.disk_mb,
            ttl_s=request.ttl_s,
            network=request.network is not False,
            egress=request.egress,
            labels=labels,
        ),
        **common,
    )
    scheduled = SandboxScheduled(
        event_id=request.event_of("scheduled"),
        node_id=node_id,
        payload=ScheduledPayload(request_id=request.request_id, node_id=node_id),
        **common,
    )
    return requested, scheduled


def why_refused(
    reason: RejectReason,
    request: CreateSandbox,
    n: int,
    group: str | None,
    largest: SandboxMax | None = None,
    over_quota: str | None = None,
) -> str:
    """Why a create (or ``n`` of a group) was refused, and what would have fitted."""
    what = f"group {group} ({n} sandboxes)" if group else "the sandbox"
    waited = f"after waiting {request.queue_s:g}s"
    if reason == RejectReason.INVALID:
        most = (
            f"the most any node allows one sandbox is {largest.cpus:g} CPU, "
            f"{largest.memory_mb} MiB, {largest.pids} processes"
            if largest is not None
            else "no node declares its limits"
        )
        return (
            f"no node can give one sandbox {request.cpus:g} CPU, {request.memory_mb} MiB "
            f"and {request.pids_limit} processes: {most}"
        )
    if reason == RejectReason.NO_NODES:
        return f"no live node {waited}"
    if reason == RejectReason.QUOTA:
        over = over_quota or f"tenant {request.tenant} is at its sandbox quota"
        return f"{over}; {what} refused {waited}"
    return (
        f"no room for {what} of {request.cpus:g} CPU and {request.memory_mb} MiB each "
        f"{waited}; all or nothing, nothing was started"
    )
