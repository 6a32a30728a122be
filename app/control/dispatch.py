"""The scheduler's decisions, without I/O: requests and events in, an outbox out.

:class:`Dispatcher` validates requests, places creates on nodes, routes the rest to
the node that holds the sandbox, follows node heartbeats and sandbox endings, and
declares silent nodes lost. Everything it decides lands in an :class:`Outbox` that
the scheduler process (``app/control/scheduler.py``) sends: events first, then replies and
node tasks. Every event it emits has an id derived from the request (or the
sandbox), so deciding the same thing twice appends nothing twice.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Collection, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta

from app.config import Settings
from app.control.creates import Pending, Waiting, placement_events, why_refused
from app.control.leases import Leases, lease_request
from app.control.life_book import LifeBook, Unstarted
from app.control.node_health import NodeHealth
from app.control.outbox import Courier, NoTally, Outbox, Tally
from app.control.quotas import QuotaLookup, SettingsQuotas, TenantQuotas
from app.domain.base import RejectReason, StopReason, derived_id, utcnow
from app.domain.codec import DeadLetterReason, DecodeError, decode_event
from app.domain.events import (
    CommandCompleted,
    LastState,
    NodeHeartbeat,
    NodeLost,
    NodeRegistered,
    SandboxFailed,
    SandboxFrozen,
    SandboxRequested,
    SandboxScheduled,
    SandboxStarted,
    SandboxStopped,
    SandboxThawed,
    StoppedPayload,
)
from app.domain.gate import Admitted, Gate, GateRules, Refusal, Sender
from app.domain.lease import Lease, LeaseAction, LeaseState
from app.domain.lives import CONTROL_NS, RECONCILER, Terms, declared_end
from app.domain.partition_counts import PartitionCounts
from app.domain.placement import Allocation, NodeCapacity, NodeView, Placement
from app.domain.proof import KeyLookup, Principal, ProofError, Purpose, Role, verify
from app.domain.records import Record
from app.domain.replies import Done, ErrorReply
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
from app.domain.trajectory import TrajectoryLog
from app.domain.trust import EVENT_SENDERS, event_refusal, may_act_on

log = logging.getLogger(__name__)

NAME = "scheduler"
#: Silence after which a node is declared lost (heartbeats come every 5 s).
HEARTBEAT_TIMEOUT = timedelta(seconds=20)
#: Ended sandboxes remembered to give a precise reason to late requests.
ENDED_MEMORY = 100_000
#: Namespace of ids of the facts the scheduler establishes on its own.
_NS = CONTROL_NS


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


class Dispatcher:
    """The scheduler's state and rules."""

    def __init__(
        self,
        settings: Settings,
        keys: KeyLookup,
        partitions: PartitionCounts,
        heartbeat_timeout: timedelta = HEARTBEAT_TIMEOUT,
        trajectory: TrajectoryLog | None = None,
        tally: Tally | None = None,
        quotas: QuotaLookup | None = None,
    ) -> None:
        self.settings = settings
        self.keys = keys
        self.trajectory = trajectory
        self.tally: Tally = tally or NoTally()
        self.gate = Gate(
            GateRules(
                max_age=timedelta(seconds=settings.request_max_age_s),
                max_message_bytes=settings.max_message_bytes,
                topic_prefix=settings.topic_prefix,
            ),
            keys,
            partitions,
        )
        self.placement = Placement()
        self.pending: list[Pending] = []
        # Rollout groups by (owner, group id): group ids are the tenant's own.
        self.groups: dict[tuple[str, str], list[str]] = {}
        # Creates sent to a node whose Started has not come back: if the node is
        # lost first, the waiting trainer is told here.
        self.awaiting_start: dict[str, Waiting] = {}
        # The create request each live sandbox came from (redeliveries are no-ops).
        self.created_by: dict[str, uuid.UUID] = {}
        # Lives scheduled (here or by another scheduler) whose start has not come back
        # (a node that does not list them yet has not lost them; past their deadline
        # they end create_lost), lives being destroyed, lives left on lost nodes.
        self.book = LifeBook(Terms.of(settings))
        # Requested events of other schedulers, until their Scheduled comes (the same
        # partition, right after): what a placement it learns from the log needs.
        self._requested: OrderedDict[str, SandboxRequested] = OrderedDict()
        #: Set while a starting scheduler reads the events its recovered state does
        #: not include yet: old heartbeats neither confirm nodes nor reconcile them.
        self.replaying = False
        # Trainer leases: their sandboxes carry LEASE_LABEL in the log, so a restarted
        # scheduler finds them again (:meth:`recover`). With several schedulers, only
        # the one that reads a lease's renewals keeps its clock (app/control/scheduler.py
        # sets ``leases.keeps``).
        self.leases = Leases(settings.lease_ttl_s, settings.lease_grace_s)
        #: Each tenant's limits (the scheduler's include the stored ones) and holdings.
        self.quotas = TenantQuotas(quotas or SettingsQuotas(settings), self.leases)
        self.health = NodeHealth(heartbeat_timeout, _NS)
        self.send = Courier(settings, keys, self.health, self.tally)
        # Ended sandboxes: why, and whose they were.
        self.ended: OrderedDict[str, tuple[str, str]] = OrderedDict()

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

    def _join_group(self, tenant: str, group: str, sandbox_id: str) -> None:
        """``sandbox_id`` is a member of ``tenant``'s group (held while one lives)."""
        members = self.groups.setdefault((tenant, group), [])
        if sandbox_id not in members:
            members.append(sandbox_id)
        self.quotas.joined_group(tenant, group, sandbox_id)

    def log_samples(self, out: Outbox) -> None:
        """Log the samples of refusals nobody answers for (app/control/samples.py)
        whose window has closed; the scheduler calls it every round."""
        self.send.log_samples(out)

    @contextmanager
    def _isolated(self, out: Outbox, record: Record | None, what: str) -> Iterator[None]:
        """Run the handling of one record (or one waiting create) on its own: if it
        raises (a bug), what it put in the outbox is taken back, the record goes to
        the dead letters with the error, and the rest of the batch goes on as if it
        were not there. What it changed in memory before raising stays: no rollback
        of the scheduler's state is attempted, only nothing half-decided is sent."""
        mark = out.mark()
        try:
            yield
        except Exception as exc:
            out.undo(mark)
            where = f" at {record.topic}[{record.partition}]@{record.offset}" if record else ""
            log.exception("scheduler: %s%s failed; the rest of its batch goes on", what, where)
            if record is not None:
                failed = f"{type(exc).__name__}: {exc}"
                out.dead.append((record, DecodeError(DeadLetterReason.INTERNAL, failed)))
            self.tally.refused(DeadLetterReason.INTERNAL.value)

    # --- events -----------------------------------------------------------------

    def _proven_event(self, record: Record) -> tuple[Principal, object] | None:
        """The event and its proven sender, or None if either fails (the projector
        dead-letters what fails; here it simply carries no news)."""
        raw = record.value or b""
        try:
            sender = verify(Purpose.EVENT, raw, record.headers, self.keys, EVENT_SENDERS)
            event = decode_event(raw, self.settings.max_message_bytes)
        except (ProofError, DecodeError) as exc:
            log.warning("scheduler: ignoring an event at %s: %s", record.offset, exc)
            self.tally.unproven("event")
            return None
        refusal = event_refusal(sender, event)
        if refusal is not None:
            log.warning("scheduler: ignoring an event at %s: %s", record.offset, refusal)
            self.tally.unproven("event")
            return None
        return sender, event

    def observe(self, out: Outbox, record: Record) -> None:
        """Follow one event: nodes come and go, sandboxes end. Never raises."""
        with self._isolated(out, record, "an event"):
            self._observe(out, record)

    def _observe(self, out: Outbox, record: Record) -> None:
        proven = self._proven_event(record)
        if proven is None:
            return
        sender, event = proven
        match event:
            case NodeRegistered() | NodeHeartbeat() if self.replaying:
                pass
            case NodeRegistered(payload=p) | NodeHeartbeat(payload=p):
                assert event.node_id is not None
                if not self.health.heard(event.node_id, event.occurred_at, sender.key_id):
                    return  # an older heartbeat, replayed: its list is out of date
                # The scheduler's clock, not the node's: skew must not kill nodes.
                view = NodeView.declared(event.node_id, p, utcnow())
                # A node's tasks go to its own queue, whatever it declares.
                view.queue = self.settings.node_queue(event.node_id)
                self.placement.upsert_node(view)
                self.book.node_back(event.node_id)
                if p.sandboxes is not None:
                    self._reconcile(out, event.node_id, set(p.sandboxes), event.occurred_at)
            case NodeLost():
                assert event.node_id is not None
                self.placement.mark_lost(event.node_id)
                self.book.node_lost(event.node_id, time.monotonic())
            case SandboxRequested() if event.sandbox_id not in self.created_by:
                self._requested[event.sandbox_id or ""] = event
                while len(self._requested) > ENDED_MEMORY:
                    self._requested.popitem(last=False)
            case SandboxScheduled(payload=p):
                self._learn_placement(event.sandbox_id or "", p.node_id)
            case SandboxStarted() if self._placed_here(sender, event.sandbox_id):
                self.awaiting_start.pop(event.sandbox_id or "", None)
                self.book.started(event.sandbox_id or "")
                self._alive(event.node_id, event.sandbox_id, event.occurred_at)
            case CommandCompleted(payload=p) if self._placed_here(sender, event.sandbox_id):
                self._alive(event.node_id, event.sandbox_id, event.occurred_at)
                self.quotas.command_ended(event.tenant, p.request_id)
            case SandboxStopped(payload=p) if self._placed_here(sender, event.sandbox_id):
                self._ended_elsewhere(out, sender, event.sandbox_id or "", p.reason.value,
                                      p.detail)  # fmt: skip
            case SandboxFailed(payload=p) if (
                p.request_type == "CreateSandbox" and self._placed_here(sender, event.sandbox_id)
            ):
                self._ended_elsewhere(out, sender, event.sandbox_id or "", p.reason.value,
                                      p.detail)  # fmt: skip
            case SandboxFailed(payload=p) if p.request_type == "Exec":
                self.quotas.command_ended(event.tenant, p.request_id)
            case SandboxFrozen() | SandboxThawed() if self._placed_here(sender, event.sandbox_id):
                self.leases.follow(
                    event.sandbox_id or "", isinstance(event, SandboxFrozen), time.monotonic()
                )
            case _:
                pass

    def _learn_placement(self, sandbox_id: str, node_id: str) -> None:
        """A placement another scheduler made (or this one, read back: nothing new).
        Every scheduler counts every placement against its node's room, and knows the
        sandbox well enough to take over its partition at any time."""
        requested = self._requested.pop(sandbox_id, None)
        if sandbox_id in self.placement.allocations or sandbox_id in self.created_by:
            return
        if requested is None or sandbox_id in self.ended:
            return  # its Requested was before this scheduler's memory: recovered already
        p = requested.payload
        self.placement.assign(
            sandbox_id, node_id, p.cpus, p.memory_mb, requested.tenant, requested.job_id
        )
        self.created_by[sandbox_id] = p.request_id
        self.book.placed(
            Unstarted(sandbox_id, requested.tenant, requested.job_id, node_id,
                      requested.occurred_at)
        )  # fmt: skip
        group = p.labels.get(GROUP_LABEL)
        if group:
            self._join_group(requested.tenant, group, sandbox_id)
        lease_id = p.labels.get(LEASE_LABEL)
        if lease_id:
            self.leases.join(sandbox_id, requested.tenant, lease_id, time.monotonic())

    def _ended_elsewhere(
        self, out: Outbox, sender: Principal, sandbox_id: str, reason: str, detail: str | None
    ) -> None:
        """A sandbox ended. If another scheduler ended it (a node it declared lost, a
        container it found vanished) before it started, the trainer waiting here for
        the start hears it from here."""
        waiting = self.awaiting_start.get(sandbox_id)
        self._forget(sandbox_id, reason)
        if waiting is not None and sender.role == Role.SCHEDULER:
            reply = ErrorReply(
                request_id=waiting.request_id,
                sandbox_id=sandbox_id,
                reason=reason,
                detail=detail or f"sandbox ended ({reason})",
            )
            self.send.reply(out, waiting.sender, waiting.reply_to, reply)

    def drop_pending(self, partitions: Collection[int]) -> None:
        """Forget the creates waiting for room that were read from ``partitions`` (this
        scheduler gave them away: their stored offsets make the next owner read them
        again)."""
        self._set_pending([p for p in self.pending if p.partition not in partitions])

    def _alive(self, node_id: str | None, sandbox_id: str | None, at: datetime) -> None:
        """The node spoke for the sandbox as of ``at`` (its clock, the one its start is
        billed by)."""
        if node_id is not None and sandbox_id is not None:
            self.health.saw(node_id, sandbox_id, at)

    def _placed_here(self, sender: Principal, sandbox_id: str | None) -> bool:
        """A node speaks only for the sandboxes placed on it (the scheduler for all)."""
        if sender.role != Role.NODE:
            return True
        allocation = self.placement.allocations.get(sandbox_id or "")
        return allocation is None or allocation.node_id == sender.subject

    def _forget(self, sandbox_id: str, reason: str) -> None:
        """A sandbox ended: free its room, its lease, its group slot, its commands."""
        self.awaiting_start.pop(sandbox_id, None)
        self.book.forget(sandbox_id)
        self._requested.pop(sandbox_id, None)
        self.leases.leave(sandbox_id)
        self.quotas.sandbox_ended(sandbox_id)
        allocation = self.placement.release(sandbox_id)
        self.created_by.pop(sandbox_id, None)
        owner = allocation.tenant if allocation is not None else ""
        self._ended(sandbox_id, reason, owner)

    def unknown_ids(self, sandbox_ids: Iterable[str]) -> list[str]:
        """The ids among ``sandbox_ids`` this scheduler knows nothing of: neither live
        nor ended in its memory (whose history the log may still hold)."""
        return [i for i in sandbox_ids if i not in self.created_by and i not in self.ended]

    def note_ended(self, sandbox_id: str, reason: str, owner: str) -> None:
        """A sandbox the log shows ended before this scheduler's memory: its id is
        never given to another sandbox (every life is billed under its own id)."""
        self._ended(sandbox_id, reason, owner)

    def _ended(self, sandbox_id: str, reason: str, owner: str) -> None:
        if owner == "" and sandbox_id in self.ended:
            return  # keep the owner an earlier ending recorded
        self.ended[sandbox_id] = (reason, owner)
        while len(self.ended) > ENDED_MEMORY:
            self.ended.popitem(last=False)

    def _stop(
        self,
        out: Outbox,
        allocation: Allocation,
        reason: StopReason,
        detail: str,
        at: datetime | None = None,
    ) -> None:
        """End a sandbox the node cannot speak for any more, as of ``at`` (default now)."""
        node = self.placement.nodes.get(allocation.node_id)
        lease = self.leases.of(allocation.sandbox_id)
        last_state = LastState(
            observed_by="scheduler",
            frozen=lease.state == LeaseState.LAPSED if lease is not None else None,
            last_heartbeat_at=node.last_seen if node is not None else None,
        )
        waiting = self.awaiting_start.get(allocation.sandbox_id)
        self._forget(allocation.sandbox_id, reason.value)
        event = SandboxStopped(
            event_id=derived_id(_NS, f"{allocation.sandbox_id}:{reason.value}"),
            sandbox_id=allocation.sandbox_id,
            node_id=allocation.node_id,
            tenant=allocation.tenant,
            job_id=allocation.job_id,
            occurred_at=at or utcnow(),
            payload=StoppedPayload(reason=reason, detail=detail, last_state=last_state),
        )
        self.send.emit(out, event)
        if waiting is not None:
            reply = ErrorReply(
                request_id=waiting.request_id,
                sandbox_id=allocation.sandbox_id,
                reason=reason.value,
                detail=detail,
            )
            self.send.reply(out, waiting.sender, waiting.reply_to, reply)

    def _reconcile(self, out: Outbox, node_id: str, reported: set[str], at: datetime) -> None:
        placed = self.placement.placed_on(node_id)
        quiet = self.book.quiet(placed, time.monotonic())
        verdict = self.health.reconcile(node_id, placed, reported, quiet, at)
        for sandbox_id in sorted(verdict.vanished):
            allocation = self.placement.allocations.get(sandbox_id)
            if allocation is not None:
                # Its end is stamped when the node last listed it, not when two
                # heartbeats later the scheduler was sure: a node that rebooted does
                # not bill its tenants for the time it was down.
                seen = self.health.last_listed(node_id, sandbox_id)
                detail = f"container vanished from {node_id}" + (
                    f" (last listed {seen:%Y-%m-%dT%H:%M:%S}Z)" if seen is not None else ""
                )
                self._stop(out, allocation, StopReason.FAILED, detail, at=seen)
        node = self.placement.nodes.get(node_id)
        for sandbox_id in sorted(verdict.orphans):
            if node is None:
                break
            log.warning("scheduler: orphan %s on %s: destroying it", sandbox_id, node_id)
            request = DestroySandbox(sandbox_id=sandbox_id, tenant="system", actor=RECONCILER)
            self.send.task(out, node, request)
            self.health.orphan_handled(node_id, sandbox_id)

    def check_nodes(self, out: Outbox, bus_since: datetime | None = None) -> None:
        """Declare nodes lost that missed their heartbeats (counted from ``bus_since``:
        since when the bus has been reachable); end their sandboxes."""
        nodes = list(self.placement.nodes.values())
        for node, detail in self.health.silent(nodes, utcnow(), bus_since):
            log.warning("scheduler: node %s lost: %s", node.node_id, detail)
            lost = self.health.lost(node.node_id, detail)
            self.send.emit(out, lost)
            for sandbox_id in self.placement.mark_lost(node.node_id):
                allocation = self.placement.allocations[sandbox_id]
                # Known alive until the node last spoke for it: billed until then.
                seen = self.health.last_alive(node.node_id, sandbox_id)
                self._stop(
                    out, allocation, StopReason.NODE_LOST, f"{node.node_id}: {detail}", at=seen
                )

    def check_lives(self, out: Outbox) -> None:
        """End the lives whose deadline this scheduler keeps (app/domain/lives.py) and
        that passed it: those left on a node declared lost (by another scheduler, or
        before this one started), and those placed and never started by the time their
        create could still start (``create_lost``, their room given back)."""
        for node_id in self.book.lost_nodes_due(time.monotonic()):
            node = self.placement.nodes.get(node_id)
            if node is None or node.alive:
                continue
            for sandbox_id in sorted(self.placement.placed_on(node_id)):
                seen = self.health.last_alive(node_id, sandbox_id) or node.last_seen
                detail = f"{node_id}: declared lost"
                self._stop(out, self.placement.allocations[sandbox_id], StopReason.NODE_LOST,
                           detail, at=seen)  # fmt: skip
        for entry in self.book.lost_creates(utcnow()):
            detail = (
                f"placed on {entry.node_id}, never started: its create was lost"
                if entry.node_id else "requested, never placed: its create was lost"
            )  # fmt: skip
            log.warning("scheduler: %s %s", entry.sandbox_id, detail)
            allocation = self.placement.allocations.get(entry.sandbox_id)
            if allocation is not None:
                self._stop(out, allocation, StopReason.CREATE_LOST, detail)
                continue
            self.send.emit(out, declared_end(entry.life(), StopReason.CREATE_LOST, detail,
                                             utcnow()))  # fmt: skip
            self._forget(entry.sandbox_id, StopReason.CREATE_LOST.value)

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
        event, reply = recorded.answer(request)
        self.send.emit(out, event)
        self.send.reply(out, admitted.sender, request.reply_to, reply)
        self.tally.handled(request.type, "replayed")
        return True
