"""The door every request passes: who sent it, is it fresh, is it new, may it say that.

Pure: keys come from a :class:`KeyLookup`, partition counts from a
:class:`PartitionCounts`, time from the caller. The scheduler runs
every request record through :meth:`Gate.admit` before deciding anything; what comes
out is either an :class:`Admitted` request, whose ``tenant`` and ``actor`` are the
proven sender's, or a :class:`Refusal` saying why, and whether a reply may be sent.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, NamedTuple

from app.domain.base import RejectReason
from app.domain.codec import DeadLetterReason, DecodeError, decode_request, peek
from app.domain.partition_counts import PartitionCounts
from app.domain.partitioner import key_partition
from app.domain.proof import (
    KeyLookup,
    Principal,
    ProofError,
    Purpose,
    headers,
    reply_key,
    verify,
)
from app.domain.records import Record
from app.domain.requests import ReplyTo, Request
from app.domain.trust import REQUEST_SENDERS


class Handled(NamedTuple):
    """A request id its key has used, and where it was read (a replay is read elsewhere)."""

    key_id: str
    request_id: uuid.UUID
    partition: int
    offset: int
    at: datetime


@dataclass(frozen=True)
class Sender:
    """A proven sender and the key its replies are derived from."""

    principal: Principal
    secret: bytes

    def reply_headers(self, request_id: uuid.UUID, value: bytes) -> list[tuple[str, bytes]]:
        """The proof a reply to ``request_id`` carries (see proof.reply_key)."""
        return headers(Purpose.REPLY, None, reply_key(self.secret, request_id), value)

    def reply_key(self, request_id: uuid.UUID) -> bytes:
        """The reply key handed (sealed) to the node that answers ``request_id``."""
        return reply_key(self.secret, request_id)


@dataclass(frozen=True)
class Admitted:
    """A request that may be acted on, as its proven sender."""

    request: Request
    sender: Sender


@dataclass(frozen=True)
class Refusal:
    """A request refused at the door."""

    reason: RejectReason
    detail: str
    #: The key the record is proven with (the log names it); None if its proof
    #: failed. An answer is proven under this key, so only its holder reads it.
    sender: Sender | None
    #: The request, if it decoded.
    request: Request | None
    #: What could be read of it otherwise (ids for the log).
    raw: dict[str, Any]
    #: Where the answer goes; None: nobody is answered (see Gate).
    reply_to: ReplyTo | None
    #: The decode error, if that is why: the record also goes to the dead letters.
    decode_error: DecodeError | None = None
    #: What the requester is told, where the reason and detail the log keeps would tell
    #: it about someone else's sandbox (None: the same).
    told: tuple[RejectReason, str] | None = None
    #: Refused before the request was known as its sender's own (no proof, or maybe a
    #: copy): the kind of refusal it is (its reason, and its proof's failure or key),
    #: by which the log keeps a sample instead of one row per record; None: logged.
    sample: str | None = None


@dataclass(frozen=True)
class GateRules:
    """The limits the gate applies."""

    max_age: timedelta
    max_message_bytes: int
    topic_prefix: str

    def replies_topic(self, tenant: str) -> str:
        return f"{self.topic_prefix}.replies.{tenant}"


class Gate:
    """Authentication, freshness and replay checks for request records.

    A refusal is answered only where the answer cannot settle another request: to a
    proven sender, about a request that is its own first one of that id. So a record
    whose proof fails is never answered (logged only: it may carry a victim's key id
    and request id, and an answer under the victim's key would end the victim's real
    request), nor is one that may be a copy of a proven request: read on another
    partition or under another key than it belongs, a replay, or older than the
    freshness window (a command may run for hours after its request was sent).
    """

    #: Request ids remembered per partition at most (the freshness window bounds it).
    MEMORY = 1_000_000

    def __init__(self, rules: GateRules, keys: KeyLookup, partitions: PartitionCounts) -> None:
        self.rules = rules
        self.keys = keys
        self.partitions = partitions
        # (key id, request id) -> where and when it was handled: the same pair read
        # anywhere else is a replay. Request ids are scoped by the key that proves
        # them, so nobody else's record (unproven, or another key's) can use one up:
        # a proven attempt is its prover's, whatever came before it. Old entries go
        # once they are older than the window.
        self.handled: OrderedDict[tuple[str, uuid.UUID], Handled] = OrderedDict()
        #: Ids handled since the owner last saved them (it persists these).
        self.unsaved: list[Handled] = []

    def remember(self, handled: Handled) -> None:
        """An id handled before (a restarted scheduler reloads them)."""
        self.handled[handled.key_id, handled.request_id] = handled

    def forget_before(self, cutoff: datetime) -> None:
        """Drop ids handled before ``cutoff``: requests that old are refused as stale."""
        while self.handled:
            oldest = next(iter(self.handled.values()))
            if oldest.at >= cutoff and len(self.handled) <= self.MEMORY:
                break
            self.handled.popitem(last=False)

    def admit(self, record: Record, now: datetime) -> Admitted | Refusal:
        """Check one request record."""
        raw = record.value or b""
        try:
            principal = verify(Purpose.REQUEST, raw, record.headers, self.keys, REQUEST_SENDERS)
        except ProofError as exc:
            return self._unproven(raw, exc)
        info = self.keys.lookup(principal.key_id)
        assert info is not None  # verify found it
        sender = Sender(principal, info.secret)
        try:
            request = decode_request(raw, self.rules.max_message_bytes)
        except DecodeError as exc:
            seen = peek(raw)
            reason = (
                RejectReason.UNSUPPORTED_VERSION
                if exc.reason == DeadLetterReason.UNSUPPORTED_VERSION
                else RejectReason.INVALID
            )
            # Answered: the sender signed these very bytes, so no request of its own
            # that decoded can be waiting under this id.
            return Refusal(
                reason, str(exc), sender, None, seen,
                self._reply_to(sender, seen.get("reply_to")), exc,
            )  # fmt: skip
        return self._check(record, request, sender, now)

    def _check(
        self, record: Record, request: Request, sender: Sender, now: datetime
    ) -> Admitted | Refusal:
        reply_to = self._reply_to(sender, request.reply_to)

        def refuse(
            reason: RejectReason, detail: str, answer: bool = True, copy: bool = False
        ) -> Refusal:
            sample = f"{reason.value}:{sender.principal.key_id}" if copy else None
            where = reply_to if answer else None
            return Refusal(reason, detail, sender, request, {}, where, sample=sample)

        misplaced = self._misplaced(record, request.sandbox_id)
        if misplaced is not None:
            # Not answered, nor remembered as handled: these may be a copy of someone's
            # request moved elsewhere on the bus (onto another scheduler's partition, to
            # be acted on twice), and the original, read where it belongs, stands.
            return refuse(RejectReason.INVALID, misplaced, answer=False, copy=True)
        age = now - request.sent_at
        if abs(age) > self.rules.max_age:
            return refuse(
                RejectReason.UNAUTHENTICATED,
                f"stale: sent_at is {age.total_seconds():.0f}s from the platform's clock "
                f"(at most {self.rules.max_age.total_seconds():.0f}s): check the client's "
                "clock; a captured request cannot be sent again later",
                # Answered only if sent from the future: its original was refused the
                # same way, so nothing of its sender's can be waiting on it. One from
                # the past may be a copy of a request admitted then and still running.
                answer=age < timedelta(0),
                copy=True,
            )
        principal = sender.principal
        scoped = (principal.key_id, request.request_id)
        seen = self.handled.get(scoped)
        if seen is not None and (seen.partition, seen.offset) != (record.partition, record.offset):
            # No reply: its answer is the first request's, which its sender may still
            # be waiting for; an answer here would reach it first.
            return refuse(
                RejectReason.DUPLICATE,
                f"request id {request.request_id} was already handled (partition "
                f"{seen.partition}, offset {seen.offset}): a replay",
                answer=False,
                copy=True,
            )
        if seen is None:
            first = Handled(*scoped, record.partition, record.offset, now)
            self.handled[scoped] = first
            self.unsaved.append(first)
        if request.tenant and request.tenant != principal.subject:
            return refuse(
                RejectReason.FORBIDDEN,
                f"the request says tenant {request.tenant!r} but is proven by a credential "
                f"of {principal.subject!r}",
            )
        if request.reply_to is not None:
            why = self._misdirected(sender, request.reply_to)
            if why is not None:
                # No reply: there is nowhere it may go.
                return refuse(*why, answer=False)
        admitted = request.model_copy(
            update={"tenant": principal.subject, "actor": principal.actor}
        )
        return Admitted(admitted, sender)

    def _misplaced(self, record: Record, sandbox_id: str) -> str | None:
        """Why ``record`` is not where a request about ``sandbox_id`` is sent: keyed by
        the sandbox id, on the partition Kafka's default partitioner gives that key
        (so every request about one sandbox reaches one scheduler, in order)."""
        key = record.key.decode(errors="replace") if record.key is not None else None
        if key != sandbox_id:
            return f"record key {key!r} is not the sandbox id"
        count = self.partitions.requests()
        expected = key_partition(key, count) if count > 0 else record.partition
        if record.partition != expected:
            return (
                f"read on partition {record.partition}, but its key {key!r} goes to partition "
                f"{expected} of {count} (Kafka's default partitioner, murmur2): a request is "
                "sent keyed by its sandbox id, never to a partition of the sender's choosing"
            )
        return None

    def _reply_to(self, sender: Sender, wanted: object) -> ReplyTo | None:
        """Where replies to ``sender`` may go, if ``wanted`` is somewhere they may."""
        if isinstance(wanted, dict):
            try:
                wanted = ReplyTo.model_validate(wanted)
            except ValueError:
                return None
        if not isinstance(wanted, ReplyTo) or self._misdirected(sender, wanted) is not None:
            return None
        return wanted

    def _misdirected(self, sender: Sender, wanted: ReplyTo) -> tuple[RejectReason, str] | None:
        """Why replies to ``sender`` may not go to ``wanted``; None if they may: its own
        topic, on a partition the broker says exists (a send to one that does not
        would wait on the broker, holding up everyone's answers)."""
        subject = sender.principal.subject
        own = self.rules.replies_topic(subject)
        if wanted.topic != own:
            return RejectReason.FORBIDDEN, f"replies to {subject}'s requests go to {own} only"
        count = self.partitions.replies(own)
        if count is None:
            return RejectReason.INVALID, f"the broker does not know a topic {own} (yet)"
        if wanted.partition >= count:
            return (
                RejectReason.INVALID,
                f"{own} has partitions 0-{count - 1}: there is no partition {wanted.partition}",
            )
        return None

    def _unproven(self, raw: bytes, exc: ProofError) -> Refusal:
        # Never answered, whatever key id it names (see the class).
        reason = RejectReason.UNAUTHENTICATED
        detail = f"{exc.failure.value}: {exc.detail}"
        sample = f"{reason.value}:{exc.failure.value}"
        return Refusal(reason, detail, None, None, peek(raw), None, sample=sample)
