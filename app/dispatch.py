"""The scheduler's decisions, without I/O: requests and events in, an outbox out.

:class:`Dispatcher` validates requests, places creates on nodes, routes the rest to
the node that holds the sandbox, follows node heartbeats and sandbox endings, and
declares silent nodes lost. Everything it decides lands in an :class:`Outbox` that
the scheduler process (``app/scheduler.py``) sends: events first, then replies and
node tasks. Every event it emits has an id derived from the request (or the
sandbox), so deciding the same thing twice appends nothing twice.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta

from kafka.consumer.fetcher import ConsumerRecord

from app import metrics
from app.codec import DecodeError, decode_event, decode_request, encode, peek
from app.config import Settings
from app.domain.base import RejectReason, StopReason, derived_id, new_id, utcnow
from app.domain.events import (
    LastState,
    NodeHeartbeat,
    NodeLost,
    NodeLostPayload,
    NodeRegistered,
    RejectedPayload,
    RequestedPayload,
    SandboxFailed,
    SandboxRejected,
    SandboxRequested,
    SandboxScheduled,
    SandboxStarted,
    SandboxStopped,
    ScheduledPayload,
    StoppedPayload,
)
from app.domain.lease import Lease, LeaseAction, LeaseState
from app.domain.placement import Allocation, NodeCapacity, NodeView, Placement
from app.domain.reconcile import NodeLedger
from app.domain.replies import Done, ErrorReply
from app.domain.requests import (
    GROUP_LABEL,
    LEASE_LABEL,
    CreateGroup,
    CreateSandbox,
    DestroyGroup,
    DestroySandbox,
    Exec,
    FreezeSandbox,
    RenewLease,
    ReplyTo,
    Request,
    RequestBase,
    ThawSandbox,
    expand_group,
    member_envelope,
)
from app.domain.trajectory import TrajectoryLog, replay_answer
from app.taskqueue import TASK_FOR_REQUEST

log = logging.getLogger(__name__)

NAME = "scheduler"
#: Silence after which a node is declared lost (heartbeats come every 5 s).
HEARTBEAT_TIMEOUT = timedelta(seconds=20)
#: Ended sandboxes remembered to give a precise reason to late requests.
ENDED_MEMORY = 100_000
#: Namespace of ids of the facts the scheduler establishes on its own.
_NS = uuid.uuid5(uuid.NAMESPACE_URL, "dsec-scheduler")


@dataclass
class Pending:
    """Creates waiting for room: one sandbox, or a whole rollout group."""

    members: list[CreateSandbox]
    partition: int
    offset: int
    deadline_s: float
    group: str | None = None


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


@dataclass
class Outbox:
    """What one batch sends: events first, then (after they are acknowledged) tasks."""

    events: list[tuple[str, bytes]] = field(default_factory=list)
    replies: list[tuple[ReplyTo, str, bytes]] = field(default_factory=list)
    tasks: list[tuple[str, str, list[str]]] = field(default_factory=list)
    dead: list[tuple[ConsumerRecord, DecodeError]] = field(default_factory=list)


class Dispatcher:
    """The scheduler's state and rules."""

    def __init__(
        self,
        settings: Settings,
        heartbeat_timeout: timedelta = HEARTBEAT_TIMEOUT,
        trajectory: TrajectoryLog | None = None,
    ) -> None:
        self.settings = settings
        self.trajectory = trajectory
        self.placement = Placement()
        self.pending: list[Pending] = []
        self.groups: dict[str, list[str]] = {}
        # Creates sent to a node whose Started has not come back: if the node is
        # lost first, the waiting trainer is told here.
        self.awaiting_start: dict[str, tuple[uuid.UUID, ReplyTo | None]] = {}
        # Trainer leases: their sandboxes carry LEASE_LABEL in the log, so a restarted
        # scheduler finds them again (:meth:`recover`); their clocks restart then.
        self.leases: dict[str, Lease] = {}
        self.lease_of: dict[str, str] = {}
        self.ledgers: dict[str, NodeLedger] = {}
        self.ended: OrderedDict[str, str] = OrderedDict()
        self.heartbeat_timeout = heartbeat_timeout

    def recover(
        self, nodes: Iterable[tuple[str, NodeCapacity]], live: Iterable[LiveSandbox]
    ) -> None:
        """Take up where a previous scheduler left off, from what the log says.

        Nodes count as alive but unconfirmed: no placement on one until it is heard
        from again, and a fresh grace before it can be declared lost (the scheduler
        was away, not the node). Live sandboxes hold their allocations, their groups
        and their leases. A lease's clock restarts: a trainer that is still there
        renews it; one that is gone lets it lapse one TTL later. A lease with a
        frozen sandbox is recovered lapsed, so a renewal thaws it.
        """
        now = utcnow()
        for node_id, node in nodes:
            self.placement.upsert_node(NodeView.declared(node_id, node, now, confirmed=False))
        clock = time.monotonic()
        for box in live:
            group = box.labels.get(GROUP_LABEL)
            if group:
                self.groups.setdefault(group, []).append(box.sandbox_id)
            if box.node_id:
                self.placement.assign(
                    box.sandbox_id, box.node_id, box.cpus, box.memory_mb, box.tenant, box.job_id
                )
            lease_id = box.labels.get(LEASE_LABEL)
            if lease_id:
                lease = self._lease(lease_id, clock)
                lease.sandboxes.add(box.sandbox_id)
                self.lease_of[box.sandbox_id] = lease_id
                if box.frozen:
                    lease.state, lease.lapsed_s = LeaseState.LAPSED, clock

    def _lease(self, lease_id: str, now_s: float) -> Lease:
        """The lease, created with the default terms on first sight."""
        lease = self.leases.get(lease_id)
        if lease is None:
            ttl, grace = self.settings.lease_ttl_s, self.settings.lease_grace_s
            lease = self.leases[lease_id] = Lease(lease_id, ttl, grace, now_s + ttl)
        return lease

    def retry_pending(self, out: Outbox) -> None:
        """Try again, oldest first, the creates that wait for room."""
        still: list[Pending] = []
        for pending in self.pending:
            if not self._admit(out, pending):
                still.append(pending)
        self.pending = still

    def observe(self, out: Outbox, record: ConsumerRecord) -> None:
        """Follow one event: nodes come and go, sandboxes end."""
        try:
            event = decode_event(record.value or b"", self.settings.max_message_bytes)
        except DecodeError:
            return  # the projector dead-letters it; here it simply carries no news
        match event:
            case NodeRegistered(payload=p) | NodeHeartbeat(payload=p):
                assert event.node_id is not None
                # The scheduler's clock, not the node's: skew must not kill nodes.
                self.placement.upsert_node(NodeView.declared(event.node_id, p, utcnow()))
                if p.sandboxes is not None:
                    self._reconcile(out, event.node_id, set(p.sandboxes))
            case NodeLost():
                assert event.node_id is not None
                self.placement.mark_lost(event.node_id)
            case SandboxStarted():
                self.awaiting_start.pop(event.sandbox_id or "", None)
            case SandboxStopped(payload=p):
                self.awaiting_start.pop(event.sandbox_id or "", None)
                self._unlease(event.sandbox_id or "")
                self.placement.release(event.sandbox_id or "")
                self._ended(event.sandbox_id or "", p.reason.value)
            case SandboxFailed(payload=p) if p.request_type == "CreateSandbox":
                self.awaiting_start.pop(event.sandbox_id or "", None)
                self.placement.release(event.sandbox_id or "")
                self._ended(event.sandbox_id or "", p.reason.value)
            case _:
                pass

    def _ended(self, sandbox_id: str, reason: str) -> None:
        self.ended[sandbox_id] = reason
        while len(self.ended) > ENDED_MEMORY:
            self.ended.popitem(last=False)

    def _stop(self, out: Outbox, allocation: Allocation, reason: StopReason, detail: str) -> None:
        """End a sandbox the node cannot speak for any more."""
        node = self.placement.nodes.get(allocation.node_id)
        lease = self.leases.get(self.lease_of.get(allocation.sandbox_id, ""))
        last_state = LastState(
            observed_by="scheduler",
            frozen=lease.state == LeaseState.LAPSED if lease is not None else None,
            last_heartbeat_at=node.last_seen if node is not None else None,
        )
        self._unlease(allocation.sandbox_id)
        self.placement.release(allocation.sandbox_id)
        self._ended(allocation.sandbox_id, reason.value)
        event = SandboxStopped(
            event_id=derived_id(_NS, f"{allocation.sandbox_id}:{reason.value}"),
            sandbox_id=allocation.sandbox_id,
            node_id=allocation.node_id,
            tenant=allocation.tenant,
            job_id=allocation.job_id,
            payload=StoppedPayload(reason=reason, detail=detail, last_state=last_state),
        )
        out.events.append((event.key, encode(event)))
        waiting = self.awaiting_start.pop(allocation.sandbox_id, None)
        if waiting is not None and waiting[1] is not None:
            reply = ErrorReply(
                request_id=waiting[0],
                sandbox_id=allocation.sandbox_id,
                reason=reason.value,
                detail=detail,
            )
            out.replies.append((waiting[1], allocation.sandbox_id, encode(reply)))

    def _reconcile(self, out: Outbox, node_id: str, reported: set[str]) -> None:
        ledger = self.ledgers.setdefault(node_id, NodeLedger())
        placed = self.placement.placed_on(node_id)
        verdict = ledger.observe(placed, reported, self.awaiting_start.keys() & placed)
        for sandbox_id in sorted(verdict.vanished):
            allocation = self.placement.allocations.get(sandbox_id)
            if allocation is not None:
                detail = f"container vanished from {node_id}"
                self._stop(out, allocation, StopReason.FAILED, detail)
        node = self.placement.nodes.get(node_id)
        for sandbox_id in sorted(verdict.orphans):
            if node is None:
                break
            log.warning("scheduler: orphan %s on %s: destroying it", sandbox_id, node_id)
            request = DestroySandbox(sandbox_id=sandbox_id, tenant="system", actor="reconciler")
            out.tasks.append(
                (TASK_FOR_REQUEST[request.type], node.queue, [request.model_dump_json()])
            )
            ledger.extra.pop(sandbox_id, None)

    def check_nodes(self, out: Outbox) -> None:
        """Declare nodes lost that missed their heartbeats; end their sandboxes."""
        now = utcnow()
        for node in list(self.placement.nodes.values()):
            if not node.alive or node.last_seen is None:
                continue
            if now - node.last_seen <= self.heartbeat_timeout:
                continue
            detail = f"no heartbeat for {(now - node.last_seen).total_seconds():.0f}s"
            log.warning("scheduler: node %s lost: %s", node.node_id, detail)
            lost = NodeLost(node_id=node.node_id, payload=NodeLostPayload(detail=detail))
            out.events.append((lost.key, encode(lost)))
            for sandbox_id in self.placement.mark_lost(node.node_id):
                allocation = self.placement.allocations[sandbox_id]
                self._stop(out, allocation, StopReason.NODE_LOST, f"{node.node_id}: {detail}")

    # --- requests ---------------------------------------------------------------

    def _emit(
        self, out: Outbox, event: SandboxRequested | SandboxScheduled | SandboxRejected
    ) -> None:
        out.events.append((event.key, encode(event)))

    def _reject(
        self,
        out: Outbox,
        request: Request | None,
        raw: dict[str, object],
        reason: RejectReason,
        detail: str,
    ) -> None:
        request_id = request.request_id if request else _uuid_or_none(raw.get("request_id"))
        sandbox_id = request.sandbox_id if request else _str_or_none(raw.get("sandbox_id"))
        request_type = request.type if request else str(raw.get("type", "unknown"))
        event = SandboxRejected(
            event_id=derived_id(request_id, "rejected") if request_id else uuid.uuid4(),
            sandbox_id=sandbox_id,
            tenant=request.tenant if request else str(raw.get("tenant") or "unknown")[:128],
            job_id=request.job_id if request else str(raw.get("job_id") or "default")[:128],
            payload=RejectedPayload(
                request_id=request_id, request_type=request_type, reason=reason, detail=detail
            ),
        )
        self._emit(out, event)
        metrics.REQUESTS.labels(request_type, f"rejected:{reason.value}").inc()
        reply_to = request.reply_to if request else _reply_to_or_none(raw.get("reply_to"))
        if reply_to is not None and request_id is not None:
            reply = ErrorReply(
                request_id=request_id,
                sandbox_id=sandbox_id or "",
                reason=reason.value,
                detail=detail,
            )
            out.replies.append((reply_to, sandbox_id or "", encode(reply)))

    def _quota_left(self, tenant: str) -> int | None:
        """Sandboxes the tenant may still start; None: no quota."""
        quota = self.settings.tenant_quotas.get(tenant, self.settings.default_tenant_quota)
        if not quota:
            return None
        return quota - self.placement.tenant_sandboxes(tenant)

    def _admit(self, out: Outbox, pending: Pending) -> bool:
        """Place every member, or none; False if they must keep waiting."""
        members = pending.members
        tenant = members[0].tenant
        left = self._quota_left(tenant)
        placed: list[Allocation] = []
        reason: RejectReason | None = None
        if left is not None and left < len(members):
            reason = RejectReason.QUOTA
        else:
            for m in members:
                got = self.placement.place(
                    m.sandbox_id, m.image, m.cpus, m.memory_mb, m.tenant, m.job_id
                )
                if isinstance(got, RejectReason):
                    reason = got
                    break
                placed.append(got)
        if reason is not None:
            for allocation in placed:  # all or nothing
                self.placement.release(allocation.sandbox_id)
            if time.monotonic() < pending.deadline_s:
                return False
            detail = _why(reason, members[0], len(members), pending.group)
            for m in members:
                self._reject(out, m, {}, reason, detail)
            return True
        for m, allocation in zip(members, placed, strict=True):
            self._schedule(out, m, allocation)
        if pending.group is not None:
            self.groups[pending.group] = [m.sandbox_id for m in members]
        return True

    def _schedule(self, out: Outbox, request: CreateSandbox, placed: Allocation) -> None:
        """Requested + Scheduled, and the node task, for one placed sandbox."""
        self.awaiting_start[request.sandbox_id] = (request.request_id, request.reply_to)
        labels = request.labels
        if request.lease_id is not None:
            self._lease(request.lease_id, time.monotonic()).sandboxes.add(request.sandbox_id)
            self.lease_of[request.sandbox_id] = request.lease_id
            # In the log, so a restarted scheduler knows the lease (and SQL the cost).
            labels = {**labels, LEASE_LABEL: request.lease_id}
        common = {
            "sandbox_id": request.sandbox_id,
            "tenant": request.tenant,
            "job_id": request.job_id,
        }
        self._emit(
            out,
            SandboxRequested(
                event_id=derived_id(request.request_id, "requested"),
                occurred_at=request.sent_at if request.sent_at <= utcnow() else utcnow(),
                payload=RequestedPayload(
                    request_id=request.request_id,
                    actor=request.actor,
                    image=request.image,
                    cpus=request.cpus,
                    memory_mb=request.memory_mb,
                    disk_mb=request.disk_mb,
                    ttl_s=request.ttl_s,
                    network=request.network,
                    labels=labels,
                ),
                **common,
            ),
        )
        self._emit(
            out,
            SandboxScheduled(
                event_id=derived_id(request.request_id, "scheduled"),
                node_id=placed.node_id,
                payload=ScheduledPayload(request_id=request.request_id, node_id=placed.node_id),
                **common,
            ),
        )
        node = self.placement.nodes[placed.node_id]
        args = [request.model_dump_json()]
        if request.restore_trajectory and self.trajectory is not None:
            # The node rebuilds the sandbox's state before it says it is ready.
            steps = self.trajectory.steps(request.restore_trajectory)
            args.append(json.dumps([s.command for s in steps]))
        out.tasks.append((TASK_FOR_REQUEST[request.type], node.queue, args))
        metrics.REQUESTS.labels(request.type, "scheduled").inc()

    def handle(self, out: Outbox, record: ConsumerRecord) -> None:
        """One request record."""
        raw = record.value or b""
        try:
            request = decode_request(raw, self.settings.max_message_bytes)
        except DecodeError as exc:
            out.dead.append((record, exc))
            self._reject(out, None, peek(raw), RejectReason.INVALID, str(exc))
            return
        if isinstance(request, CreateSandbox | CreateGroup):
            members = expand_group(request) if isinstance(request, CreateGroup) else [request]
            if any(m.sandbox_id in self.placement.allocations for m in members):
                return  # a redelivered create: already placed, its tasks already sent
            pending = Pending(
                members,
                record.partition,
                record.offset,
                time.monotonic() + request.queue_s,
                request.sandbox_id if isinstance(request, CreateGroup) else None,
            )
            if not self._admit(out, pending):
                self.pending.append(pending)
            return
        if isinstance(request, DestroyGroup):
            self._destroy_group(out, request)
            return
        if isinstance(request, RenewLease):
            self._renew(out, request)
            return
        lease = self.leases.get(self.lease_of.get(request.sandbox_id, ""))
        if (
            lease is not None
            and lease.state == LeaseState.LAPSED
            and not isinstance(request, DestroySandbox | ThawSandbox)
        ):
            self._reject(
                out, request, {}, RejectReason.SANDBOX_NOT_RUNNING,
                f"sandbox {request.sandbox_id} is frozen: lease {lease.lease_id} lapsed",
            )  # fmt: skip
            return
        node = self.placement.node_of(request.sandbox_id)
        if node is None:
            ended = self.ended.get(request.sandbox_id)
            if ended is not None:
                self._reject(
                    out, request, {}, RejectReason.SANDBOX_NOT_RUNNING,
                    f"sandbox {request.sandbox_id} has ended ({ended})",
                )  # fmt: skip
            else:
                self._reject(
                    out, request, {}, RejectReason.UNKNOWN_SANDBOX,
                    f"sandbox {request.sandbox_id} is not live on any node",
                )  # fmt: skip
            return
        if isinstance(request, Exec) and self._replay(out, request):
            return
        out.tasks.append((TASK_FOR_REQUEST[request.type], node.queue, [request.model_dump_json()]))
        metrics.REQUESTS.labels(request.type, "routed").inc()

    def _unlease(self, sandbox_id: str) -> None:
        lease_id = self.lease_of.pop(sandbox_id, None)
        lease = self.leases.get(lease_id or "")
        if lease is not None:
            lease.sandboxes.discard(sandbox_id)

    def _renew(self, out: Outbox, request: RenewLease) -> None:
        now = time.monotonic()
        lease = self.leases.get(request.sandbox_id)
        if lease is None:
            lease = Lease(request.sandbox_id, request.ttl_s, request.grace_s, now + request.ttl_s)
            self.leases[request.sandbox_id] = lease
        if lease.renew(now, request.ttl_s, request.grace_s) == LeaseAction.THAW:
            log.info("scheduler: lease %s renewed after a lapse: thawing", lease.lease_id)
            self._lease_tasks(out, lease, LeaseAction.THAW)
        if request.reply_to is not None:
            done = Done(request_id=request.request_id, sandbox_id=request.sandbox_id)
            out.replies.append((request.reply_to, request.sandbox_id, encode(done)))

    def _lease_tasks(self, out: Outbox, lease: Lease, action: LeaseAction) -> None:
        """Freeze, thaw or destroy every live sandbox of a lease."""
        for sandbox_id in sorted(lease.sandboxes):
            node = self.placement.node_of(sandbox_id)
            allocation = self.placement.allocations.get(sandbox_id)
            if node is None or allocation is None:
                continue
            common = {
                "request_id": new_id(),
                "sandbox_id": sandbox_id,
                "tenant": allocation.tenant,
                "job_id": allocation.job_id,
                "actor": f"lease {lease.lease_id}",
            }
            task: RequestBase
            if action == LeaseAction.FREEZE:
                task = FreezeSandbox(reason=StopReason.LEASE_LAPSED.value, **common)
            elif action == LeaseAction.THAW:
                task = ThawSandbox(**common)
            else:
                task = DestroySandbox(reason=StopReason.LEASE_LAPSED.value, **common)
            out.tasks.append((TASK_FOR_REQUEST[task.type], node.queue, [task.model_dump_json()]))

    def check_leases(self, out: Outbox) -> None:
        """Freeze the sandboxes of lapsed leases; destroy them after the grace period."""
        now = time.monotonic()
        for lease in list(self.leases.values()):
            action = lease.tick(now)
            if action is None:
                continue
            log.warning(
                "scheduler: lease %s: %s %d sandboxes", lease.lease_id, action, len(lease.sandboxes)
            )
            self._lease_tasks(out, lease, action)
            if action == LeaseAction.DESTROY:
                del self.leases[lease.lease_id]

    def _destroy_group(self, out: Outbox, request: DestroyGroup) -> None:
        """Route a destroy to every member; members already gone are answered here."""
        for member in self.groups.pop(request.sandbox_id, []):
            destroy = DestroySandbox(**member_envelope(request, member))
            node = self.placement.node_of(member)
            if node is not None:
                task = TASK_FOR_REQUEST[destroy.type]
                out.tasks.append((task, node.queue, [destroy.model_dump_json()]))
            elif request.reply_to is not None:
                done = Done(request_id=destroy.request_id, sandbox_id=member, detail="already gone")
                out.replies.append((request.reply_to, member, encode(done)))

    def _replay(self, out: Outbox, request: Exec) -> bool:
        """Answer a completed trajectory step from the log; False if it must run."""
        if request.trajectory_id is None or request.step is None or self.trajectory is None:
            return False
        recorded = self.trajectory.lookup(request.trajectory_id, request.step)
        if recorded is None:
            return False
        event, reply = replay_answer(
            request,
            recorded.request_id,
            exit_code=recorded.exit_code,
            stdout_b64=recorded.stdout_b64,
            stderr_b64=recorded.stderr_b64,
            duration_ms=recorded.duration_ms,
            timed_out=recorded.timed_out,
            stdout_truncated=recorded.truncated,
            stderr_truncated=recorded.truncated,
        )
        out.events.append((event.key, encode(event)))
        if request.reply_to is not None:
            out.replies.append((request.reply_to, request.sandbox_id, encode(reply)))
        metrics.REQUESTS.labels(request.type, "replayed").inc()
        return True


def _why(reason: RejectReason, request: CreateSandbox, n: int, group: str | None) -> str:
    what = f"group {group} ({n} sandboxes)" if group else "the sandbox"
    waited = f"after waiting {request.queue_s:g}s"
    if reason == RejectReason.NO_NODES:
        return f"no live node {waited}"
    if reason == RejectReason.QUOTA:
        return f"tenant {request.tenant} is at its sandbox quota; {what} refused {waited}"
    return (
        f"no room for {what} of {request.cpus:g} CPU and {request.memory_mb} MiB each "
        f"{waited}; all or nothing, nothing was started"
    )


def _uuid_or_none(value: object) -> uuid.UUID | None:
    try:
        return uuid.UUID(str(value)) if value is not None else None
    except ValueError:
        return None


def _str_or_none(value: object) -> str | None:
    return value[:128] if isinstance(value, str) else None


def _reply_to_or_none(value: object) -> ReplyTo | None:
    try:
        return ReplyTo.model_validate(value) if isinstance(value, dict) else None
    except ValueError:
        return None
