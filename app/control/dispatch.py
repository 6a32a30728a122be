"""The scheduler's decisions, without I/O: requests and events in, an outbox out.

:class:`Dispatcher` validates requests, places creates on nodes and routes the rest
to the node that holds the sandbox, on the state its :class:`LogFollower` base keeps
from the events (``app/control/follower.py``: heartbeats, endings, lost nodes).
Everything it decides lands in an :class:`Outbox` that the scheduler process
(``app/control/scheduler.py``) sends: events first, then replies and node tasks.
Every event it emits has an id derived from the request (or the sandbox), so
deciding the same thing twice appends nothing twice.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from app.control.creates import Pending, Waiting, placement_events, why_refused
from app.control.follower import LogFollower
from app.control.leases import lease_request
from app.control.life_book import Unstarted
from app.control.outbox import Outbox
from app.domain.base import RejectReason, utcnow
from app.domain.codec import DeadLetterReason, DecodeError
from app.domain.direct import DirectRules, SandboxKey, admit_direct
from app.domain.gate import Admitted, Refusal, Sender
from app.domain.hub_access import may_use
from app.domain.lease import Lease, LeaseAction
from app.domain.placement import Allocation, NodeCapacity, NodeView
from app.domain.proof import HEADER_KEY, KEY_ID, Role, header, sandbox_key
from app.domain.records import Record
from app.domain.replies import Done
from app.domain.requests import (
    GROUP_LABEL,
    LEASE_LABEL,
    CreateGroup,
    CreateSandbox,
    DestroyGroup,
    DestroySandbox,
    Exec,
    RenewLease,
    ThawSandbox,
    expand_group,
    member_envelope,
)
from app.domain.trust import may_act_on

log = logging.getLogger(__name__)

NAME = "scheduler"


@dataclass(frozen=True)
class LiveSandbox:
    """A sandbox the log shows alive, as a restarted scheduler recovers it."""

    sandbox_id: str
    node_id: str | None
    cpus: float
    memory_mb: int
    tenant: str
    job_id: str
    labels: dict[str, str]
    frozen: bool = False
    #: The create request behind it (a redelivered create is then recognised).
    request_id: uuid.UUID | None = None
    #: When it was requested, and whether its start is in the log: a life not started
    #: has a create deadline (app/control/life_book.py).
    requested_at: datetime | None = None
    started: bool = True
    #: Since when it is frozen (the log's last freeze): its lease's grace runs from then.
    frozen_at: datetime | None = None


class Dispatcher(LogFollower):
    """The scheduler's rules: what it does with each request, on the state
    :class:`LogFollower` keeps."""

    def recover(
        self,
        nodes: Iterable[tuple[str, NodeCapacity]],
        live: Iterable[LiveSandbox],
        lost: Iterable[tuple[str, NodeCapacity, datetime | None]] = (),
    ) -> None:
        """Take up where a previous scheduler left off, from what the log says.

        Nodes count as alive but unconfirmed: no placement on one until it is heard
        from again, and a fresh grace before it can be declared lost (the scheduler
        was away, not the node). Live sandboxes hold their allocations, their groups
        and their leases. A lease's clock restarts: a trainer that is still there
        renews it; one that is gone lets it lapse one TTL later. A lease with a
        frozen sandbox is recovered lapsed since its freeze, so a renewal thaws it.
        Lives not started keep their create deadline; lives on nodes already ``lost``
        (with their last heartbeat) end at the next :meth:`check_lives`, whichever
        scheduler placed them.
        """
        now = utcnow()
        clock = time.monotonic()
        for node_id, node in nodes:
            view = NodeView.declared(node_id, node, now, confirmed=False)
            view.queue = self.settings.node_queue(node_id)
            self.placement.upsert_node(view)
        for node_id, node, heard in lost:
            view = NodeView.declared(node_id, node, heard or now, confirmed=False)
            view.alive = False
            self.placement.upsert_node(view)
        holding: set[str] = set()
        for box in live:
            group = box.labels.get(GROUP_LABEL)
            if group:
                self._join_group(box.tenant, group, box.sandbox_id)
            if box.node_id:
                self.placement.assign(
                    box.sandbox_id, box.node_id, box.cpus, box.memory_mb, box.tenant, box.job_id
                )
                holding.add(box.node_id)
            if box.request_id is not None:
                self.created_by[box.sandbox_id] = box.request_id
            if not box.started:
                self.book.placed(
                    Unstarted(box.sandbox_id, box.tenant, box.job_id, box.node_id,
                              box.requested_at)
                )  # fmt: skip
            lease_id = box.labels.get(LEASE_LABEL)
            if lease_id:
                since = box.frozen_at if box.frozen else None
                self.leases.recovered(
                    box.sandbox_id, box.tenant, lease_id, box.frozen, clock, since, now
                )
        # Lives on a node already lost end at the next check, whoever placed them.
        for node_id in sorted(holding):
            held = self.placement.nodes.get(node_id)
            if held is not None and not held.alive:
                self.book.node_lost(node_id, clock, at_once=True)

    def retry_pending(self, out: Outbox) -> None:
        """Try again, oldest first, the creates that wait for room."""
        still: list[Pending] = []
        for pending in self.pending:
            with self._isolated(out, None, "a waiting create"):
                if not self._admit(out, pending):
                    still.append(pending)
        self._set_pending(still)

    def _set_pending(self, pending: list[Pending]) -> None:
        """The creates that wait for room now."""
        self.pending = pending
        self.quotas.waiting_now(pending)

    def drop_pending(self, partitions: Collection[int]) -> None:
        """Forget the creates waiting for room that were read from ``partitions`` (this
        scheduler gave them away: their stored offsets make the next owner read them
        again)."""
        self._set_pending([p for p in self.pending if p.partition not in partitions])

    # --- creates ------------------------------------------------------------------

    def _admit(self, out: Outbox, pending: Pending) -> bool:
        """Place every member, or none; False if they must keep waiting."""
        members = pending.members
        tenant = members[0].tenant
        over = self.quotas.sandboxes(pending, self.placement.tenant_sandboxes(tenant))
        placed: list[Allocation] = []
        reason: RejectReason | None = None
        if over is not None:
            reason = RejectReason.QUOTA
        else:
            for m in members:
                got = self.placement.place(
                    m.sandbox_id, m.image, m.cpus, m.memory_mb, m.tenant, m.job_id,
                    pids=m.pids_limit,
                )  # fmt: skip
                if isinstance(got, RejectReason):
                    reason = got
                    break
                placed.append(got)
        if reason is not None:
            for allocation in placed:  # all or nothing
                self.placement.release(allocation.sandbox_id)
            if reason != RejectReason.INVALID and time.monotonic() < pending.deadline_s:
                return False
            largest = self.placement.largest_sandbox() if reason == RejectReason.INVALID else None
            detail = why_refused(reason, members[0], len(members), pending.group, largest, over)
            self._refuse_all(out, pending, reason, detail)
            return True
        for m, allocation in zip(members, placed, strict=True):
            self._schedule(out, m, allocation, pending.sender)
            if pending.group is not None:
                self._join_group(tenant, pending.group, m.sandbox_id)
        return True

    def _refuse_all(self, out: Outbox, pending: Pending, reason: RejectReason, detail: str) -> None:
        """Refuse every member of a create (each answered under its own request id)."""
        for m in pending.members:
            self.send.refuse(out, Admitted(m, pending.sender), reason, detail)

    def _schedule(
        self, out: Outbox, request: CreateSandbox, placed: Allocation, sender: Sender
    ) -> None:
        """Requested + Scheduled, and the node task, for one placed sandbox."""
        self.awaiting_start[request.sandbox_id] = Waiting(
            request.request_id, request.reply_to, sender
        )
        self.created_by[request.sandbox_id] = request.request_id
        labels = request.labels
        if request.lease_id is not None:
            self.leases.join(request.sandbox_id, request.tenant, request.lease_id, time.monotonic())
            # In the log, so a restarted scheduler knows the lease (and SQL the cost).
            labels = {**labels, LEASE_LABEL: request.lease_id}
        requested, scheduled = placement_events(request, placed.node_id, labels)
        for event in (requested, scheduled):
            self.send.emit(out, event)
        self.book.placed(
            Unstarted(request.sandbox_id, request.tenant, request.job_id, placed.node_id,
                      requested.occurred_at)
        )  # fmt: skip
        node = self.placement.nodes[placed.node_id]
        restore: list[str | list[str]] | None = None
        if request.restore_trajectory and self.trajectory is not None:
            # The node rebuilds the sandbox's state before it says it is ready; the
            # trajectory is looked up among the tenant's own.
            steps = self.trajectory.steps(request.tenant, request.restore_trajectory)
            restore = [s.command for s in steps]
        self.send.task(out, node, request, sender, restore)
        self.tally.handled(request.type, "scheduled")

    def _create(self, out: Outbox, admitted: Admitted, record: Record) -> None:
        request = admitted.request
        assert isinstance(request, CreateSandbox | CreateGroup)
        members = expand_group(request) if isinstance(request, CreateGroup) else [request]
        sender = admitted.sender.principal
        if not sender.is_operator and not may_use(
            sender.subject, request.image, self.image_readers
        ):
            # Nodes pull with a login that reads every image: the owner's check is here.
            told = f"image {request.image} is another tenant's: a sandbox starts from its own"
            reason = RejectReason.FORBIDDEN
            self.send.refuse(out, admitted, reason, told, told=(reason, told))
            return
        if self.image_deleted(request.image):
            told = f"image {request.image} was deleted from the hub: push it again to use it"
            reason = RejectReason.INVALID
            self.send.refuse(out, admitted, reason, told, told=(reason, told))
            return
        for m in members:
            holder = self.created_by.get(m.sandbox_id)
            allocation = self.placement.allocations.get(m.sandbox_id)
            if holder == m.request_id and (allocation is None or allocation.tenant == m.tenant):
                return  # a redelivered create: already placed, its tasks already sent
            in_use = self._in_use(m.sandbox_id)
            if in_use is not None:
                # The log says how (for the operator); the requester learns that the id
                # is taken, never whose it is or how it ended.
                told = f"sandbox id {m.sandbox_id} is taken: ids are never reused, choose another"
                reason = RejectReason.ID_IN_USE
                self.send.refuse(out, admitted, reason, in_use, told=(reason, told))
                return
        pending = Pending(
            members,
            admitted.sender,
            record.partition,
            record.offset,
            time.monotonic() + request.queue_s,
            request.sandbox_id if isinstance(request, CreateGroup) else None,
        )
        over = self.quotas.create(pending, request.lease_id)
        if over is None and not self._admit(out, pending):
            # No room now: it waits, within the tenant's quota of waiting creates.
            over = self.quotas.wait(pending)
            if over is None:
                self.pending.append(pending)
                self.quotas.waits(pending)
        if over is not None:
            self._refuse_all(out, pending, RejectReason.QUOTA, over)

    def _in_use(self, sandbox_id: str) -> str | None:
        """How ``sandbox_id`` is in use (live, waiting for room, or ended: ids are never
        reused, every life is billed under its own), or None if it is free."""
        if sandbox_id in self.created_by:
            return f"sandbox id {sandbox_id} is in use"
        if self.quotas.is_waiting(sandbox_id):
            return f"sandbox id {sandbox_id} is in use (a create waits for room)"
        ended = self.ended.get(sandbox_id)
        if ended is not None:
            return f"sandbox id {sandbox_id} was used before (ended: {ended[0]})"
        return None

    # --- requests -----------------------------------------------------------------

    def handle(self, out: Outbox, record: Record) -> None:
        """One request record: through the gate, then by type. Never raises."""
        with self._isolated(out, record, "a request"):
            self._handle(out, record)

    def _handle(self, out: Outbox, record: Record) -> None:
        verdict = self.gate.admit(record, utcnow())
        if isinstance(verdict, Refusal):
            if verdict.decode_error is not None:
                out.dead.append((record, verdict.decode_error))
            elif verdict.reason == RejectReason.UNAUTHENTICATED and verdict.sender is None:
                # Its proof failed: kept with its bytes, like anything a consumer refused.
                unproven = DecodeError(DeadLetterReason.UNAUTHENTICATED, verdict.detail)
                out.dead.append((record, unproven))
            self.send.reject(out, verdict)
            return
        request = verdict.request
        if isinstance(request, CreateSandbox | CreateGroup):
            self._create(out, verdict, record)
            return
        if isinstance(request, DestroyGroup):
            self._destroy_group(out, verdict)
            return
        if isinstance(request, RenewLease):
            self._renew(out, verdict)
            return
        self._route(out, verdict)

    def _route(self, out: Outbox, admitted: Admitted) -> None:
        """A request about one live sandbox: its owner's (or an operator's) only."""
        request, sender = admitted.request, admitted.sender
        allocation = self.placement.allocations.get(request.sandbox_id)
        ended = self.ended.get(request.sandbox_id)
        owner = allocation.tenant if allocation is not None else ended[1] if ended else None
        # "Not there" and "not yours" are one answer, in the same words: a tenant learns
        # nothing of sandboxes that are not its own. The log tells them apart.
        told = f"{sender.principal.subject} has no live sandbox {request.sandbox_id}"
        if owner is not None and not may_act_on(sender.principal, owner):
            self.send.refuse(out, admitted, RejectReason.FORBIDDEN,
                             f"sandbox {request.sandbox_id} is another tenant's",
                             told=(RejectReason.UNKNOWN_SANDBOX, told))  # fmt: skip
            return
        if allocation is None and ended is not None:
            self.send.refuse(out, admitted, RejectReason.SANDBOX_NOT_RUNNING,
                             f"sandbox {request.sandbox_id} has ended ({ended[0]})")  # fmt: skip
            return
        node = self.placement.node_of(request.sandbox_id)
        if node is None or allocation is None:
            self.send.refuse(out, admitted, RejectReason.UNKNOWN_SANDBOX, told)
            return
        # What the node records is the owner's: an operator acts on the owner's bill.
        request = request.model_copy(update={"tenant": allocation.tenant})
        admitted = Admitted(request, sender)
        lease = self.leases.lapsed(request.sandbox_id)
        if lease is not None and not isinstance(request, DestroySandbox | ThawSandbox):
            self.send.refuse(
                out, admitted, RejectReason.SANDBOX_NOT_RUNNING,
                f"sandbox {request.sandbox_id} is frozen: lease {lease.lease_id} lapsed",
            )  # fmt: skip
            return
        if isinstance(request, Exec) and (
            self._replay(out, admitted) or not self._takes_command(out, admitted)
        ):
            return
        if isinstance(request, DestroySandbox):
            self.book.ending(request.sandbox_id, time.monotonic())
        self.send.task(out, node, request, sender)
        self.tally.handled(request.type, "routed")

    def _takes_command(self, out: Outbox, admitted: Admitted) -> bool:
        """Whether an Exec's command may be held against its owner's quotas (refused
        if not)."""
        request = admitted.request
        assert isinstance(request, Exec)
        over = self.quotas.command(request, admitted.sender.principal, time.monotonic())
        if over is not None:
            self.send.refuse(out, admitted, RejectReason.QUOTA, over)
        return over is None

    def tell_revoked(self, out: Outbox, key_ids: Collection[str]) -> None:
        """Tell every node alive that ``key_ids`` are revoked: commands proven under
        the sandbox keys derived from them stop working on the direct route
        (app/domain/direct.py) as they stop here."""
        if not key_ids:
            return
        for node in self.placement.nodes.values():
            if node.alive:
                self.send.revocations(out, node, sorted(key_ids))

    def answer_for_lost(self, out: Outbox, record: Record) -> None:
        """A trainer's direct command (app/domain/direct.py) read on the inbox of a node
        declared lost, which nobody else reads now: its trainer is told here that the
        sandbox ended, as a command routed here would be. Answered only when it is
        proven under the sandbox key of the sandbox's owner, fresh and well addressed,
        under that key (anything else is left unanswered, as the node would)."""
        with self._isolated(out, record, "a lost node's command"):
            sandbox_id = record.key.decode(errors="replace") if record.key else ""
            ended = self.ended.get(sandbox_id)
            key_id = header(record.headers, HEADER_KEY)
            info = self.keys.lookup(key_id) if key_id and KEY_ID.match(key_id) else None
            if ended is None or info is None or info.revoked:
                return
            who = info.principal
            if who.role != Role.TENANT or who.subject != ended[1]:
                return
            key = SandboxKey(who.key_id, sandbox_key(info.secret, sandbox_id), who.subject,
                             who.actor)  # fmt: skip
            rules = DirectRules(
                timedelta(seconds=self.settings.request_max_age_s),
                self.settings.max_message_bytes, self.settings.replies_topic,
                self.gate.partitions.replies,
            )  # fmt: skip
            verdict = admit_direct(record, key, (), utcnow(), rules)
            request = verdict if isinstance(verdict, Exec) else verdict.request
            if request is None:
                return
            self.send.refuse(
                out, Admitted(request, Sender(who, key.secret)), RejectReason.SANDBOX_NOT_RUNNING,
                f"sandbox {sandbox_id} has ended ({ended[0]})",
            )  # fmt: skip

    # --- leases and groups ----------------------------------------------------------

    def _renew(self, out: Outbox, admitted: Admitted) -> None:
        request = admitted.request
        assert isinstance(request, RenewLease)
        over = self.quotas.lease(admitted.sender.principal, request.tenant, request.sandbox_id)
        if over is not None:
            self.send.refuse(out, admitted, RejectReason.QUOTA, over)
            return
        lease, action = self.leases.renew(
            request.tenant, request.sandbox_id, request.ttl_s, request.grace_s, time.monotonic()
        )
        if action == LeaseAction.THAW:
            log.info("scheduler: lease %s renewed after a lapse: thawing", lease.lease_id)
            self._lease_tasks(out, lease, LeaseAction.THAW)
        done = Done(request_id=request.request_id, sandbox_id=request.sandbox_id)
        self.send.reply(out, admitted.sender, request.reply_to, done)

    def _lease_tasks(self, out: Outbox, lease: Lease, action: LeaseAction) -> None:
        """Freeze, thaw or destroy every live sandbox of a lease."""
        for sandbox_id in sorted(lease.sandboxes):
            node = self.placement.node_of(sandbox_id)
            allocation = self.placement.allocations.get(sandbox_id)
            if node is None or allocation is None:
                continue
            task = lease_request(lease, action, sandbox_id, allocation.tenant, allocation.job_id)
            if action == LeaseAction.DESTROY:
                self.book.ending(sandbox_id, time.monotonic())
            self.send.task(out, node, task)

    def check_leases(self, out: Outbox) -> None:
        """Freeze the sandboxes of lapsed leases; destroy them after the grace period."""
        for lease, action in self.leases.due(time.monotonic()):
            log.warning(
                "scheduler: lease %s: %s %d sandboxes", lease.lease_id, action, len(lease.sandboxes)
            )
            self._lease_tasks(out, lease, action)

    def _destroy_group(self, out: Outbox, admitted: Admitted) -> None:
        """Route a destroy to every member; members already gone are answered here.
        Group ids are the tenant's own: another tenant's id names nothing here."""
        request = admitted.request
        self.quotas.group_destroyed(request.tenant, request.sandbox_id)
        for member in self.groups.pop((request.tenant, request.sandbox_id), []):
            destroy = DestroySandbox(**member_envelope(request, member))
            node = self.placement.node_of(member)
            if node is not None:
                self.book.ending(member, time.monotonic())
                self.send.task(out, node, destroy, admitted.sender)
            else:
                done = Done(request_id=destroy.request_id, sandbox_id=member, detail="already gone")
                self.send.reply(out, admitted.sender, request.reply_to, done)

    def _replay(self, out: Outbox, admitted: Admitted) -> bool:
        """Answer a completed trajectory step from the log; False if it must run."""
        request = admitted.request
        assert isinstance(request, Exec)
        if request.trajectory_id is None or request.step is None or self.trajectory is None:
            return False
        recorded = self.trajectory.lookup(request.tenant, request.trajectory_id, request.step)
        if recorded is None:
            return False
        event, reply = recorded.replay(request)
        self.send.emit(out, event)
        self.send.reply(out, admitted.sender, request.reply_to, reply)
        self.tally.handled(request.type, "replayed")
        return True
