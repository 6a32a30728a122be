"""What the scheduler knows, and how the log keeps it true, without I/O.

:class:`LogFollower` holds the scheduler's state (nodes and their room, live and
ended sandboxes, groups, leases, lives waiting on a deadline) and follows the events
topic: nodes register, beat and are lost, sandboxes are placed, start, run commands
and end; silent nodes are declared lost and the lives past their deadline ended.
:class:`app.control.dispatch.Dispatcher` adds the decisions on requests.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta

from app.config import Settings
from app.control.creates import Pending, Waiting
from app.control.leases import Leases
from app.control.life_book import LifeBook, Unstarted
from app.control.node_health import NodeHealth
from app.control.outbox import Courier, NoTally, Outbox, Tally
from app.control.quotas import QuotaLookup, SettingsQuotas, TenantQuotas
from app.domain.base import StopReason, derived_id, utcnow
from app.domain.codec import DeadLetterReason, DecodeError, decode_event
from app.domain.egress import SecretLookup, no_secrets
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
from app.domain.gate import Gate, GateRules
from app.domain.hub_access import DigestLookup, no_digests
from app.domain.lease import LeaseState
from app.domain.lives import CONTROL_NS, RECONCILER, Terms, declared_end
from app.domain.partition_counts import PartitionCounts
from app.domain.placement import Allocation, NodeView, Placement
from app.domain.proof import KeyLookup, Principal, ProofError, Purpose, Role, verify
from app.domain.records import Record
from app.domain.replies import ErrorReply
from app.domain.requests import (
    GROUP_LABEL,
    LEASE_LABEL,
    DestroySandbox,
)
from app.domain.trajectory import TrajectoryLog
from app.domain.trust import EVENT_SENDERS, event_refusal

log = logging.getLogger(__name__)

#: Silence after which a node is declared lost (heartbeats come every 5 s).
HEARTBEAT_TIMEOUT = timedelta(seconds=20)
#: Ended sandboxes remembered to give a precise reason to late requests.
ENDED_MEMORY = 100_000
#: Namespace of ids of the facts the scheduler establishes on its own.
_NS = CONTROL_NS


class LogFollower:
    """The scheduler's state, kept by the events it reads."""

    def __init__(
        self,
        settings: Settings,
        keys: KeyLookup,
        partitions: PartitionCounts,
        heartbeat_timeout: timedelta = HEARTBEAT_TIMEOUT,
        trajectory: TrajectoryLog | None = None,
        tally: Tally | None = None,
        quotas: QuotaLookup | None = None,
        image_readers: Callable[[str], Collection[str]] | None = None,
        egress_secrets: SecretLookup = no_secrets,
        image_digests: DigestLookup = no_digests,
        image_deleted: Callable[[str], bool] = lambda image: False,
    ) -> None:
        self.settings = settings
        #: Whether a tenant's image name's content was deleted from the hub.
        self.image_deleted = image_deleted
        #: Who else may use a tenant's image (app/control/image_shares.py).
        self.image_readers: Callable[[str], Collection[str]] = image_readers or _nobody
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
        self.send = Courier(settings, keys, self.health, self.tally, egress_secrets, image_digests)
        # Ended sandboxes: why, and whose they were.
        self.ended: OrderedDict[str, tuple[str, str]] = OrderedDict()

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


def _nobody(repository: str) -> frozenset[str]:
    """No image is shared (tests and tools that keep no shares)."""
    return frozenset()
