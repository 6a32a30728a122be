"""Every life ends (pure): the deadline of each open state of a sandbox's life, who
keeps it, and the end that meets it.

A sandbox the log shows requested is a life the log holds open until one end closes
it; billing and capacity both rest on that end coming, and soon after the platform
can no longer serve the sandbox. So every open state has a deadline and an owner:

=======================  =====================================  ===============  ==========
state                    deadline                               owner            end
=======================  =====================================  ===============  ==========
requested, not placed    requested + request max age + grace    scheduler        create_lost
placed, not started      requested + request max age + grace    scheduler        create_lost
running                  started + TTL                          node             ttl
frozen under a lease     frozen + the lease's grace             scheduler        lease_lapsed
frozen, no lease         started + TTL                          node             ttl
on a node declared lost  the node's loss                        scheduler and    node_lost
                                                                projector
=======================  =====================================  ===============  ==========

Why a create's deadline is its request's age limit plus a grace: a node refuses a
create sent longer ago than ``request_max_age_s`` (``workers/creation.py``), so once
that age and the time a create in progress may still take have passed, no start can
come any more; a placement still open then was lost with its task (a worker and its
Redis gone together) and only holds room on its node. A life on a lost node ends as
of the node's last word on it (:func:`last_word`): its tenant pays neither for the
silence before the loss was declared nor for the time anyone took to notice.

The ends the control plane declares have ids derived from the sandbox and the reason
(:func:`end_id`), whoever declares them: the scheduler that saw a node fall silent,
another scheduler that recovered the lives of a lost node, the projector's rule for
lives nobody placed any more. The log keeps one of them.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Protocol

from app.domain.base import StopReason, derived_id
from app.domain.events import LastState, SandboxStopped, StoppedPayload

#: Namespace of the ids of the facts the control plane establishes on its own (the
#: scheduler's since its first version: ends declared before this module keep their ids).
CONTROL_NS = uuid.uuid5(uuid.NAMESPACE_URL, "dsec-scheduler")

#: The actor of the destroys the scheduler sends for orphans (containers a node runs
#: that no open life holds): the node removes them without stating an end, since the
#: log holds no open life for them to end (an orphan's life ended already, or never
#: was one).
RECONCILER = "scheduler/reconciler"


class OpenState(StrEnum):
    """Where an open life stands, as far as its deadline goes."""

    REQUESTED = "requested"
    PLACED = "placed"
    RUNNING = "running"
    FROZEN = "frozen"
    ON_LOST_NODE = "on_lost_node"


class Owner(StrEnum):
    """Who ends a life when its deadline passes."""

    SCHEDULER = "scheduler"
    NODE = "node"
    #: The scheduler that declares the loss, and the projector's rule for lives no
    #: running scheduler knows.
    SCHEDULER_AND_PROJECTOR = "scheduler+projector"


class TermsSource(Protocol):
    """Where the terms come from (the platform's settings)."""

    @property
    def request_max_age_s(self) -> float: ...
    @property
    def create_grace_s(self) -> float: ...
    @property
    def lease_grace_s(self) -> float: ...


@dataclass(frozen=True)
class Terms:
    """How long each state may last (from the settings of whoever applies them)."""

    #: A create sent longer ago than this is refused by its node (DSEC_REQUEST_MAX_AGE_S).
    request_max_age_s: float
    #: How long a create under way at that age may still take (DSEC_CREATE_GRACE_S).
    create_grace_s: float
    #: How long a lapsed lease's sandboxes stay frozen (DSEC_LEASE_GRACE_S: a lease's
    #: own grace, set by its trainer's renewals, is not in the log).
    lease_grace_s: float

    @classmethod
    def of(cls, settings: TermsSource) -> Terms:
        """The terms ``settings`` set."""
        return cls(settings.request_max_age_s, settings.create_grace_s, settings.lease_grace_s)

    @property
    def create_s(self) -> float:
        """From a create's request to the end of its chance to start."""
        return self.request_max_age_s + self.create_grace_s


@dataclass(frozen=True)
class OpenLife:
    """A life the log holds open: what dates its deadline."""

    sandbox_id: str
    tenant: str
    job_id: str
    node_id: str | None = None
    requested_at: datetime | None = None
    #: Its SandboxScheduled is in the log (it was placed on ``node_id``).
    scheduled: bool = False
    started_at: datetime | None = None
    ttl_s: int | None = None
    #: Since when it is frozen (its last freeze not thawed); None: not frozen.
    frozen_at: datetime | None = None
    #: Under a trainer's lease (its SandboxRequested carries the lease label).
    leased: bool = False
    #: When its node was declared lost; None: its node is not lost.
    node_lost_at: datetime | None = None


@dataclass(frozen=True)
class Deadline:
    """When an open life must end, who ends it, and with which reason."""

    state: OpenState
    #: None where the log holds nothing to date it (a life without its request).
    at: datetime | None
    owner: Owner
    reason: StopReason


def state_of(life: OpenLife) -> OpenState:
    """The open state whose deadline rules ``life`` (a lost node rules them all)."""
    if life.node_lost_at is not None:
        return OpenState.ON_LOST_NODE
    if life.started_at is None:
        return OpenState.PLACED if life.scheduled else OpenState.REQUESTED
    return OpenState.FROZEN if life.frozen_at is not None else OpenState.RUNNING


def _after(at: datetime | None, seconds: float | None) -> datetime | None:
    if at is None or seconds is None:
        return None
    return at + timedelta(seconds=seconds)


def deadline_of(life: OpenLife, terms: Terms) -> Deadline:
    """The deadline of the state ``life`` is in (see the module's table)."""
    state = state_of(life)
    if state == OpenState.ON_LOST_NODE:
        return Deadline(
            state, life.node_lost_at, Owner.SCHEDULER_AND_PROJECTOR, StopReason.NODE_LOST
        )
    if state in (OpenState.REQUESTED, OpenState.PLACED):
        at = _after(life.requested_at, terms.create_s)
        return Deadline(state, at, Owner.SCHEDULER, StopReason.CREATE_LOST)
    ttl_end = _after(life.started_at, life.ttl_s)
    if state == OpenState.FROZEN and life.leased:
        lapse_end = _after(life.frozen_at, terms.lease_grace_s)
        # The TTL still bounds a frozen sandbox: whichever comes first ends it.
        if lapse_end is not None and (ttl_end is None or lapse_end < ttl_end):
            return Deadline(state, lapse_end, Owner.SCHEDULER, StopReason.LEASE_LAPSED)
    return Deadline(state, ttl_end, Owner.NODE, StopReason.TTL)


def overdue(
    lives: Iterable[OpenLife], now: datetime, terms: Terms, grace: timedelta = timedelta(0)
) -> list[tuple[OpenLife, Deadline]]:
    """The lives whose deadline passed more than ``grace`` before ``now``, with it."""
    found = []
    for life in lives:
        deadline = deadline_of(life, terms)
        if deadline.at is not None and deadline.at + grace < now:
            found.append((life, deadline))
    return found


def last_word(*times: datetime | None) -> datetime | None:
    """The latest of the times a node spoke for a sandbox (its start, a command, a
    heartbeat that listed it): until then the sandbox is known alive, and billed."""
    known = [t for t in times if t is not None]
    return max(known) if known else None


def end_id(sandbox_id: str, reason: StopReason) -> uuid.UUID:
    """The id of the end the control plane declares: the same whoever declares it."""
    return derived_id(CONTROL_NS, f"{sandbox_id}:{reason.value}")


def declared_end(
    life: OpenLife,
    reason: StopReason,
    detail: str,
    at: datetime,
    last_state: LastState | None = None,
) -> SandboxStopped:
    """The end the control plane states for an open life, as of ``at``."""
    return SandboxStopped(
        event_id=end_id(life.sandbox_id, reason),
        sandbox_id=life.sandbox_id,
        node_id=life.node_id,
        tenant=life.tenant,
        job_id=life.job_id,
        occurred_at=at,
        payload=StoppedPayload(
            reason=reason,
            detail=detail,
            last_state=last_state or LastState(observed_by="scheduler"),
        ),
    )
