"""Quotas as the dispatcher applies them (pure): each tenant's limits, what it holds
now as this scheduler counts it, and why a request that would go past is refused.

What is counted where: live sandboxes by the placement (every scheduler sees every
placement in the log); leases by the scheduler that keeps their clock (the one that
reads their renewals); creates waiting for room by the scheduler they wait in; and
here (:class:`Holdings`) what lives and dies with sandboxes: groups, the trajectories
live sandboxes write, and the commands a scheduler routed. With several schedulers,
leases, waiting creates and commands are each scheduler's count: a tenant may hold up
to the quota on each (its requests spread over them by key).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter
from collections.abc import Iterable
from typing import Protocol

from app.config import Settings
from app.control.creates import Pending
from app.control.leases import Leases
from app.domain.proof import Principal
from app.domain.quotas import Quota, Resource, exceeds
from app.domain.requests import Exec

log = logging.getLogger(__name__)

#: A command is forgotten this long after its own timeout if no end of it was heard
#: (a node that died with it; the node's own answer normally ends it).
COMMAND_GRACE_S = 60.0

#: (tenant, resource, name): one thing a tenant holds.
Thing = tuple[str, Resource, str]


class QuotaLookup(Protocol):
    """Where the dispatcher finds a tenant's quota."""

    def of(self, tenant: str) -> Quota:
        """The limits ``tenant`` is held to now."""
        ...


def default_quota(settings: Settings, tenant: str) -> Quota:
    """The settings' limits for ``tenant`` (before any stored override)."""
    sandboxes = settings.tenant_quotas.get(tenant, settings.default_tenant_quota)
    return Quota(
        sandboxes=sandboxes or None,  # 0 there means no quota, as it always has
        leases=settings.quota_leases,
        groups=settings.quota_groups,
        pending_creates=settings.quota_pending_creates,
        commands=settings.quota_commands,
        trajectories=settings.quota_trajectories,
        images=settings.quota_images,
        image_mb=settings.quota_image_mb,
    )


class SettingsQuotas:
    """Every tenant held to the settings alone (unit tests, benchmarks)."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._known: dict[str, Quota] = {}

    def of(self, tenant: str) -> Quota:
        found = self._known.get(tenant)
        if found is None:
            found = self._known[tenant] = default_quota(self._settings, tenant)
        return found


class QuotaGuard:
    """Whether a request may take more of a resource for a tenant, and if not, why."""

    #: An operator going past the same quota is logged once in this long at most.
    ANNOUNCE_S = 60.0

    def __init__(self, lookup: QuotaLookup) -> None:
        self.lookup = lookup
        self._announced: dict[tuple[str, str, Resource], float] = {}

    def refusal(
        self,
        sender: Principal,
        tenant: str,
        resource: Resource,
        held: int,
        adding: int = 1,
        now_s: float | None = None,
    ) -> str | None:
        """Why ``sender`` may not take ``adding`` more ``resource`` for ``tenant``,
        which holds ``held``; None if it may. An operator is not held to quotas: its
        going past one is logged (once a minute per quota at most)."""
        limit = self.lookup.of(tenant).limit(resource)
        if not exceeds(limit, held, adding):
            return None
        what = resource.value.replace("_", " ")
        if sender.is_operator:
            now_s = time.monotonic() if now_s is None else now_s
            key = (sender.actor, tenant, resource)
            if now_s - self._announced.get(key, float("-inf")) >= self.ANNOUNCE_S:
                self._announced[key] = now_s
                log.info(
                    "quota: %s goes past %s's %s quota (%s held, %s allowed): an operator "
                    "is not held to it", sender.actor, tenant, what, held, limit,
                )  # fmt: skip
            return None
        option = resource.value.replace("_", "-")
        return (
            f"tenant {tenant} holds {held} {what} and its quota is {limit} "
            f"(an operator sets it: dsec tenant quota {tenant} --{option} N)"
        )


class Holdings:
    """What tenants hold that lives and dies with sandboxes: a thing (a group, a
    trajectory, a command) is held while a live sandbox ties it, until it is let go
    (a group destroyed, a command finished), or, for one with a deadline, until then.
    Taking and letting go are idempotent (things are named)."""

    def __init__(self) -> None:
        self._ties: dict[Thing, set[str]] = {}
        self._of: dict[str, set[Thing]] = {}
        self._count: Counter[tuple[str, Resource]] = Counter()
        self._until: dict[tuple[str, Resource], dict[str, float]] = {}

    def tie(
        self,
        tenant: str,
        resource: Resource,
        name: str,
        sandbox_id: str,
        until_s: float | None = None,
    ) -> None:
        """``sandbox_id`` holds ``name`` for ``tenant`` (until ``until_s`` at most)."""
        thing = (tenant, resource, name)
        ties = self._ties.get(thing)
        if ties is None:
            ties = self._ties[thing] = set()
            self._count[tenant, resource] += 1
        ties.add(sandbox_id)
        self._of.setdefault(sandbox_id, set()).add(thing)
        if until_s is not None:
            self._until.setdefault((tenant, resource), {})[name] = until_s

    def holds(self, tenant: str, resource: Resource, name: str) -> bool:
        return (tenant, resource, name) in self._ties

    def count(self, tenant: str, resource: Resource) -> int:
        return self._count[tenant, resource]

    def let_go(self, tenant: str, resource: Resource, name: str) -> None:
        """``tenant`` no longer holds ``name`` (whatever still ties it)."""
        thing = (tenant, resource, name)
        ties = self._ties.pop(thing, None)
        if ties is None:
            return
        self._count[tenant, resource] -= 1
        if not self._count[tenant, resource]:
            del self._count[tenant, resource]
        for sandbox_id in ties:
            held = self._of.get(sandbox_id)
            if held is not None:
                held.discard(thing)
                if not held:
                    del self._of[sandbox_id]
        deadlines = self._until.get((tenant, resource))
        if deadlines is not None:
            deadlines.pop(name, None)
            if not deadlines:
                del self._until[tenant, resource]

    def ended(self, sandbox_id: str) -> None:
        """The sandbox ended: what only it held is let go."""
        for thing in self._of.pop(sandbox_id, set()):
            ties = self._ties.get(thing)
            if ties is not None:
                ties.discard(sandbox_id)
                if not ties:
                    self.let_go(*thing)

    def expire(self, tenant: str, resource: Resource, now_s: float) -> None:
        """Let go what ``tenant`` held of ``resource`` past its deadline."""
        deadlines = self._until.get((tenant, resource), {})
        for name in [n for n, until in deadlines.items() if until <= now_s]:
            self.let_go(tenant, resource, name)


class TenantQuotas:
    """The dispatcher's quota keeping: each tenant's limits, what it holds, and the
    checks a request passes before it may create or hold more. Each check returns why
    the request may not (a ``quota`` refusal's detail), or None if it may."""

    def __init__(self, lookup: QuotaLookup, leases: Leases) -> None:
        self.guard = QuotaGuard(lookup)
        self.holdings = Holdings()
        self._leases = leases
        # What waits for room, per tenant: sandboxes (PENDING_CREATES) and groups
        # (GROUPS), and the sandbox ids (never given twice).
        self._waiting: Counter[tuple[str, Resource]] = Counter()
        self._waiting_ids: set[str] = set()

    # --- creates waiting for room ---------------------------------------------------

    def waiting_now(self, pending: Iterable[Pending]) -> None:
        """These creates, and no others, wait for room now."""
        self._waiting.clear()
        self._waiting_ids.clear()
        for one in pending:
            self.waits(one)

    def waits(self, pending: Pending) -> None:
        """One more create waits for room."""
        tenant = pending.members[0].tenant
        self._waiting[tenant, Resource.PENDING_CREATES] += len(pending.members)
        self._waiting[tenant, Resource.GROUPS] += pending.group is not None
        self._waiting_ids.update(m.sandbox_id for m in pending.members)

    def is_waiting(self, sandbox_id: str) -> bool:
        return sandbox_id in self._waiting_ids

    # --- checks -------------------------------------------------------------------

    def sandboxes(self, pending: Pending, live: int) -> str | None:
        """A create's members, for a tenant with ``live`` sandboxes."""
        tenant = pending.members[0].tenant
        principal = pending.sender.principal
        return self.guard.refusal(principal, tenant, Resource.SANDBOXES, live, len(pending.members))

    def create(self, pending: Pending, lease_id: str | None) -> str | None:
        """The group a create makes, and the lease it makes (if they are new)."""
        tenant, principal = pending.members[0].tenant, pending.sender.principal
        if pending.group is not None:
            held = self.holdings.count(tenant, Resource.GROUPS)
            held += self._waiting[tenant, Resource.GROUPS]
            over = self.guard.refusal(principal, tenant, Resource.GROUPS, held)
            if over is not None:
                return over
        return self.lease(principal, tenant, lease_id) if lease_id is not None else None

    def wait(self, pending: Pending) -> str | None:
        """A create that found no room, to wait for it."""
        tenant, n = pending.members[0].tenant, len(pending.members)
        held = self._waiting[tenant, Resource.PENDING_CREATES]
        return self.guard.refusal(pending.sender.principal, tenant, Resource.PENDING_CREATES,
                                  held, n)  # fmt: skip

    def lease(self, principal: Principal, tenant: str, lease_id: str) -> str | None:
        """A renewal (or a create) naming a lease: a new one counts."""
        if self._leases.holds(tenant, lease_id):
            return None
        return self.guard.refusal(principal, tenant, Resource.LEASES, self._leases.count(tenant))

    def command(self, request: Exec, principal: Principal, now_s: float) -> str | None:
        """An Exec about to be routed: its command, and the trajectory it writes, held
        against its sandbox owner's quotas (held from now on if it may)."""
        owner, commands = request.tenant, Resource.COMMANDS
        over = self.guard.refusal(principal, owner, commands, self.holdings.count(owner, commands))
        if over is not None:
            # Commands whose end was never heard (their node died) may be past their
            # deadline: forgotten, then counted again.
            self.holdings.expire(owner, commands, now_s)
            held = self.holdings.count(owner, commands)
            over = self.guard.refusal(principal, owner, commands, held)
        trajectory, writes = request.trajectory_id, Resource.TRAJECTORIES
        if over is None and trajectory and not self.holdings.holds(owner, writes, trajectory):
            over = self.guard.refusal(principal, owner, writes, self.holdings.count(owner, writes))
        if over is not None:
            return over
        until_s = now_s + request.timeout_s + COMMAND_GRACE_S
        self.holdings.tie(owner, commands, str(request.request_id), request.sandbox_id, until_s)
        if trajectory:
            self.holdings.tie(owner, writes, trajectory, request.sandbox_id)
        return None

    # --- what ends ----------------------------------------------------------------

    def joined_group(self, tenant: str, group: str, sandbox_id: str) -> None:
        self.holdings.tie(tenant, Resource.GROUPS, group, sandbox_id)

    def group_destroyed(self, tenant: str, group: str) -> None:
        self.holdings.let_go(tenant, Resource.GROUPS, group)

    def command_ended(self, tenant: str, request_id: uuid.UUID | None) -> None:
        self.holdings.let_go(tenant, Resource.COMMANDS, str(request_id))

    def sandbox_ended(self, sandbox_id: str) -> None:
        self.holdings.ended(sandbox_id)
