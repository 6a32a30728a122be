"""A batch of events folded per row, in memory: what it does to each sandbox, node
and tenant/job (:func:`fold`). Pure; :mod:`app.db.projections` writes the result.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from app.domain.base import NodeState
from app.domain.events import (
    CommandCompleted,
    Event,
    NodeHeartbeat,
    NodeLost,
    NodeRegistered,
    SandboxFailed,
    SandboxRejected,
    SandboxRequested,
    SandboxScheduled,
    SandboxStarted,
    SandboxStopped,
)
from app.domain.sandbox_state import ENDED, SandboxState, advance


@dataclass
class SandboxFold:
    """What a batch says about one sandbox."""

    tenant: str
    job_id: str
    state: SandboxState | None = None
    columns: dict[str, Any] = field(default_factory=dict)
    #: Commands after a lifecycle event of this batch (they go with its row).
    commands: int = 0
    last_position: int = 0
    #: Commands before any lifecycle event of this batch: they count on a row an
    #: earlier batch made, and on none if there is none (a life whose start the log
    #: does not hold), so that a command counts exactly when a lifecycle event
    #: precedes it in the log, however the log is cut into batches.
    early_commands: int = 0
    early_position: int = 0


@dataclass
class UsageFold:
    """What a batch adds to one tenant/job's totals."""

    started: int = 0
    commands: int = 0
    last_position: int = 0
    ended: list[str] = field(default_factory=list)


@dataclass
class Fold:
    """A batch folded per row."""

    sandboxes: dict[str, SandboxFold] = field(default_factory=dict)
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    usage: dict[tuple[str, str], UsageFold] = field(default_factory=dict)


#: The events :func:`_lifecycle` reads.
_LIFECYCLE_TYPES = frozenset(
    cls.model_fields["type"].default
    for cls in (SandboxRequested, SandboxScheduled, SandboxStarted, SandboxStopped,
                SandboxRejected, SandboxFailed)
)  # fmt: skip

_COMMAND, _STARTED, _STOPPED = (
    cls.model_fields["type"].default for cls in (CommandCompleted, SandboxStarted, SandboxStopped)
)


def _lifecycle(event: Event) -> tuple[SandboxState, dict[str, Any]] | None:
    """The state an event leads a sandbox to and the columns it sets."""
    at = event.occurred_at
    match event:
        case SandboxRequested(payload=p):
            return SandboxState.REQUESTED, {
                "actor": p.actor, "image": p.image, "cpus": p.cpus, "memory_mb": p.memory_mb,
                "disk_mb": p.disk_mb, "ttl_s": p.ttl_s, "network": p.network,
                "egress": p.egress.allow if p.egress else None, "labels": p.labels,
                "requested_at": at,
            }  # fmt: skip
        case SandboxScheduled(payload=p):
            return SandboxState.SCHEDULED, {"node_id": p.node_id, "scheduled_at": at}
        case SandboxStarted():
            return SandboxState.RUNNING, {"node_id": event.node_id, "started_at": at}
        case SandboxStopped(payload=p):
            return SandboxState.STOPPED, {
                "ended_at": at, "end_reason": p.reason.value, "detail": p.detail,
            }  # fmt: skip
        case SandboxRejected(payload=p) if p.request_type == "CreateSandbox":
            return SandboxState.REJECTED, {
                "ended_at": at, "end_reason": p.reason.value, "detail": p.detail,
            }  # fmt: skip
        case SandboxFailed(payload=p) if p.request_type == "CreateSandbox":
            return SandboxState.FAILED, {
                "ended_at": at, "end_reason": p.reason.value, "detail": p.detail,
            }  # fmt: skip
    return None


def fold(items: Sequence[tuple[Event, int]]) -> Fold:
    """Fold events (with their positions, ascending) into per-row changes. Pure."""
    out = Fold()
    for event, position in items:
        tenant_job = (event.tenant, event.job_id)
        if event.sandbox_id is not None:
            box = out.sandboxes.setdefault(
                event.sandbox_id, SandboxFold(event.tenant, event.job_id)
            )
            change = _lifecycle(event) if event.type in _LIFECYCLE_TYPES else None
            # A sandbox's first ending is its ending: a later Stopped (the node's, after
            # the scheduler declared it lost) or a late Started stays in the audit trail
            # but leaves the row, and what was charged, as they were. A refused create
            # of a sandbox that lives (a duplicate) moves only its position; a create of
            # a refused id lives anew (its row's columns start over). The upsert below
            # holds to the same rules across batches, so batching never shows.
            if change is not None and box.state not in ENDED:
                state, columns = change
                refusal = state == SandboxState.REJECTED
                if not refusal or box.state in (None, SandboxState.REJECTED):
                    if box.state == SandboxState.REJECTED and not refusal:
                        box.columns = {}
                        box.tenant, box.job_id = event.tenant, event.job_id
                    box.columns.update({k: v for k, v in columns.items() if v is not None})
                box.state = advance(box.state, state)
                # Only events that change the row move its position: an event that
                # leaves no trace (a refused exec) must not, or batching would show.
                box.last_position = position
        # Dispatch on the type name: most events are commands, and a chain of class
        # patterns tested each of them against every lifecycle class first.
        kind = event.type
        if kind == _COMMAND:
            box = out.sandboxes[event.sandbox_id or ""]
            if box.state is None:
                box.early_commands += 1
                box.early_position = position
            else:
                box.commands += 1
                if box.state not in ENDED:
                    box.last_position = position
            u = out.usage.setdefault(tenant_job, UsageFold())
            u.commands += 1
            u.last_position = position
        elif kind == _STARTED:
            u = out.usage.setdefault(tenant_job, UsageFold())
            u.started += 1
            u.last_position = position
        elif kind == _STOPPED:
            u = out.usage.setdefault(tenant_job, UsageFold())
            u.ended.append(event.sandbox_id or "")
            u.last_position = position
        elif isinstance(event, NodeRegistered | NodeHeartbeat):
            p = event.payload
            row = out.nodes.setdefault(event.node_id or "", {})
            row.update(
                state=NodeState.ALIVE, queue=p.queue, capacity_sandboxes=p.capacity_sandboxes,
                capacity_cpus=p.capacity_cpus, capacity_memory_mb=p.capacity_memory_mb,
                running=p.running, images=p.images, last_heartbeat_at=event.occurred_at,
                last_position=position,
            )  # fmt: skip
            if isinstance(event, NodeRegistered):
                row["registered_at"] = event.occurred_at
        elif isinstance(event, NodeLost):
            row = out.nodes.setdefault(event.node_id or "", {})
            row.update(state=NodeState.LOST, lost_at=event.occurred_at, last_position=position)
    return out
