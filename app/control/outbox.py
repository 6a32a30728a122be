"""What the dispatcher sends, and how: the :class:`Outbox` of one batch, and the
:class:`Courier` that fills it (events, replies proven under the trainer's key, node
tasks sealed with the node's key, refusals logged and answered). No I/O: the
scheduler process sends what the outbox holds (``app/control/scheduler.py``).
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field, fields
from typing import Protocol

from app.config import Settings
from app.control.node_health import NodeHealth
from app.control.samples import RefusalSamples
from app.domain.base import MAX_DETAIL, RejectReason, derived_id
from app.domain.codec import DecodeError, encode
from app.domain.egress import SecretLookup, no_secrets
from app.domain.events import EventBase, RejectedPayload, SandboxRejected
from app.domain.gate import Admitted, Refusal, Sender
from app.domain.hub_access import (
    TICKET_TTL_S,
    DigestLookup,
    no_digests,
    tenant_repository,
    ticket_password,
    ticket_user,
)
from app.domain.node_tasks import (
    TASK_FOR_REQUEST,
    VIA_INBOX,
    TaskEnvelope,
    inbox_record,
    revocation,
    seal,
    seal_egress_secrets,
    seal_secret,
)
from app.domain.placement import NodeView
from app.domain.proof import KeyInfo, KeyLookup, Role, sandbox_key
from app.domain.records import Record
from app.domain.replies import ErrorReply, ReplyBase
from app.domain.requests import REQUEST_TYPES, CreateSandbox, ReplyTo, RequestBase, SnapshotSandbox

log = logging.getLogger(__name__)


@dataclass
class Outbox:
    """What one batch sends: events first, then (after they are acknowledged) replies
    and tasks. Replies and tasks carry their proofs already; events are proven by the
    process that sends them (the scheduler's own key)."""

    events: list[tuple[str, bytes]] = field(default_factory=list)
    replies: list[tuple[ReplyTo, str, bytes, list[tuple[str, bytes]]]] = field(default_factory=list)
    tasks: list[tuple[str, str, list[str]]] = field(default_factory=list)
    #: (node inbox topic, key, record): the data plane, straight to the node.
    inbox: list[tuple[str, str, bytes]] = field(default_factory=list)
    dead: list[tuple[Record, DecodeError]] = field(default_factory=list)

    def mark(self) -> tuple[int, ...]:
        """Where the outbox stands now (see :meth:`undo`)."""
        return tuple(len(getattr(self, f.name)) for f in fields(self))

    def undo(self, mark: tuple[int, ...]) -> None:
        """Take back everything put in since ``mark``."""
        for f, length in zip(fields(self), mark, strict=True):
            del getattr(self, f.name)[length:]


class Tally(Protocol):
    """Where the dispatcher counts what it did (the scheduler's Prometheus metrics:
    :class:`app.metrics.SchedulerTally`); counting is all it may do."""

    def handled(self, request_type: str, outcome: str) -> None: ...
    def refused(self, reason: str) -> None: ...
    def unproven(self, kind: str) -> None: ...


class NoTally:
    """Counts nothing (unit tests, benchmarks of the rules alone)."""

    def handled(self, request_type: str, outcome: str) -> None:
        pass

    def refused(self, reason: str) -> None:
        pass

    def unproven(self, kind: str) -> None:
        pass


class Courier:
    """Puts what the dispatcher decided into an outbox, proven for whoever reads it."""

    def __init__(
        self,
        settings: Settings,
        keys: KeyLookup,
        health: NodeHealth,
        tally: Tally,
        secrets: SecretLookup = no_secrets,
        digests: DigestLookup = no_digests,
    ) -> None:
        self._settings = settings
        #: A tenant's egress secrets a sandbox's allowlist reaches.
        self._secrets = secrets
        #: What a tenant's image name means (app/control/image_digests.py).
        self._digests = digests
        self._keys = keys
        self._health = health
        self._tally = tally
        #: Refusals nobody answers for: a window's first logged at once, the rest folded.
        self.samples = RefusalSamples()

    def log_samples(self, out: Outbox) -> None:
        """Log the samples of folded refusals whose window has closed."""
        for sample in self.samples.due(time.monotonic()):
            self.emit(out, sample)

    def emit(self, out: Outbox, event: EventBase) -> None:
        """An event for the log (proven by the scheduler's key when it is sent)."""
        out.events.append((event.key, encode(event)))

    def reply(
        self, out: Outbox, sender: Sender | None, reply_to: ReplyTo | None, reply: ReplyBase
    ) -> None:
        """Answer a waiting trainer, proven under its own key (nobody else's)."""
        if reply_to is None or sender is None:
            return
        value = encode(reply)
        proof = sender.reply_headers(reply.request_id, value)
        out.replies.append((reply_to, reply.sandbox_id, value, proof))

    def task(
        self,
        out: Outbox,
        node: NodeView,
        request: RequestBase,
        sender: Sender | None = None,
        restore: list[str | list[str]] | None = None,
    ) -> None:
        """Hand ``request`` to ``node``, sealed with the node's key. A tenant's create
        also hands over the sandbox's direct-route key (app/domain/direct.py), unless
        the platform's settings keep every command on the scheduler."""
        info = self._node_key(node, request.type)
        if info is None:
            return
        reply_key = sender.reply_key(request.request_id) if sender is not None else None
        direct = direct_id = None
        if (
            isinstance(request, CreateSandbox)
            and self._settings.direct_exec
            and sender is not None
            and sender.principal.role == Role.TENANT
            and sender.principal.subject == request.tenant
        ):
            direct = seal_secret(info.secret, sandbox_key(sender.secret, request.sandbox_id))
            direct_id = sender.principal.key_id
        envelope = TaskEnvelope(
            request=request.model_dump_json(),
            reply_key_sealed=seal_secret(info.secret, reply_key) if reply_key else None,
            restore=restore,
            sandbox_key_sealed=direct,
            sandbox_key_id=direct_id,
            hub_login=self._hub_login(node, request, info.secret),
            egress_secrets_sealed=self._egress_secrets(request, sender, info.secret),
            image_digest=(
                self._digests(request.image) if isinstance(request, CreateSandbox) else None
            ),
        )
        task = TASK_FOR_REQUEST[request.type]
        args = seal(task, envelope, info.principal.key_id, info.secret)
        if task in VIA_INBOX:
            topic = self._settings.node_topic(node.node_id)
            out.inbox.append((topic, request.sandbox_id, inbox_record(task, args)))
        else:
            out.tasks.append((task, node.queue, args))

    def _egress_secrets(
        self, request: RequestBase, sender: Sender | None, secret: bytes
    ) -> str | None:
        """A create's egress secrets, sealed for its node: the tenant's own whose
        destination its allowlist reaches (app/control/egress_secrets.py)."""
        if not isinstance(request, CreateSandbox) or request.egress is None:
            return None
        return seal_egress_secrets(secret, self._secrets(request.tenant, request.egress))

    def _hub_login(self, node: NodeView, request: RequestBase, secret: bytes) -> str | None:
        """A snapshot's login to the hub, sealed for its node: push to the owner's one
        repository, for a few minutes (a node's own login only pulls)."""
        if not isinstance(request, SnapshotSandbox):
            return None
        repository = tenant_repository(request.tenant, request.name)
        if repository is None:
            return None
        expires = int(time.time()) + TICKET_TTL_S
        user = ticket_user(node.node_id, repository, expires, request.job_id)
        password = ticket_password(self._keys.ticket_key(), user)
        return f"{user} {seal_secret(secret, password.encode())}"

    def revocations(self, out: Outbox, node: NodeView, key_ids: list[str]) -> None:
        """Tell ``node`` that ``key_ids`` are revoked: the sandbox keys derived from
        them stop working there (its inbox, after the commands already sent)."""
        info = self._node_key(node, "a revocation")
        if info is not None:
            record = revocation(key_ids, info.principal.key_id, info.secret)
            out.inbox.append((self._settings.node_topic(node.node_id), "", record))

    def _node_key(self, node: NodeView, what: str) -> KeyInfo | None:
        """The key ``node`` checks what it is handed against; None (logged) if it has
        no live one."""
        key_id = self._health.key_of(node.node_id)
        info = self._keys.lookup(key_id) if key_id is not None else None
        if info is None:
            info = self._keys.current(Role.NODE, node.node_id)
        if info is None or info.revoked:
            log.error("scheduler: no live key for node %s: cannot hand it %s", node.node_id, what)
            return None
        return info

    def reject(self, out: Outbox, refusal: Refusal) -> None:
        """Log a refusal (or fold it into its kind's sample), count it, and answer it
        where the gate says an answer may go."""
        request, raw = refusal.request, refusal.raw
        request_id = request.request_id if request else _uuid_or_none(raw.get("request_id"))
        sandbox_id = request.sandbox_id if request else _str_or_none(raw.get("sandbox_id"))
        request_type = request.type if request else _str_or_none(raw.get("type")) or "unknown"
        sender = refusal.sender
        if sender is None or request_id is None:
            # Nobody's: its id is never one a proven refusal could need.
            event_id = uuid.uuid4()
        else:
            # Derived (deciding twice logs once), and scoped by the key that proves it
            # as request ids are: another key's record, or an unproven one, with the
            # same request id cannot take this refusal's place in the log.
            key_id = sender.principal.key_id
            if refusal.reason == RejectReason.DUPLICATE:
                # Its own id: the first request's refusal (if any) keeps its id.
                event_id = derived_id(request_id, f"replay:{key_id}:{refusal.detail}")
            else:
                event_id = derived_id(request_id, f"rejected:{key_id}")
        tenant = (
            request.tenant if request and request.tenant
            else sender.principal.subject if sender else "unauthenticated"
        )  # fmt: skip
        event = SandboxRejected(
            event_id=event_id,
            sandbox_id=sandbox_id,
            tenant=tenant,
            job_id=request.job_id if request else (_str_or_none(raw.get("job_id")) or "default"),
            payload=RejectedPayload(
                request_id=request_id,
                request_type=request_type[:128],
                reason=refusal.reason,
                detail=refusal.detail[:MAX_DETAIL],
                actor=sender.principal.actor if sender else None,
            ),
        )
        if refusal.sample is None:
            self.emit(out, event)
        elif (opening := self.samples.add(refusal.sample, event, time.monotonic())) is not None:
            self.emit(out, opening)
        # A type the sender made up is no metric label (each would be a new series).
        counted = request_type if request_type in REQUEST_TYPES else "unknown"
        self._tally.handled(counted, f"rejected:{refusal.reason.value}")
        self._tally.refused(refusal.reason.value)
        if sender is None:
            self._tally.unproven("request")
        if request_id is not None:
            reason, detail = refusal.told or (refusal.reason, refusal.detail)
            reply = ErrorReply(
                request_id=request_id,
                sandbox_id=sandbox_id or "",
                reason=reason.value,
                detail=detail[:MAX_DETAIL],
            )
            self.reply(out, refusal.sender, refusal.reply_to, reply)

    def refuse(
        self,
        out: Outbox,
        admitted: Admitted,
        reason: RejectReason,
        detail: str,
        told: tuple[RejectReason, str] | None = None,
    ) -> None:
        """Refuse an admitted request for a reason found after the door (the requester
        is ``told`` another reason and detail where the log's would tell it about
        someone else's sandbox)."""
        request = admitted.request
        self.reject(
            out, Refusal(reason, detail, admitted.sender, request, {}, request.reply_to, told=told)
        )


def _uuid_or_none(value: object) -> uuid.UUID | None:
    try:
        return uuid.UUID(str(value)) if value is not None else None
    except ValueError:
        return None


def _str_or_none(value: object) -> str | None:
    if not isinstance(value, str):
        return None
    # What goes into the log must be storable: no NUL, bounded.
    return value[:128].replace("\x00", "\ufffd")
