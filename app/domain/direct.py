"""The direct route: a command sent by its trainer straight to the node that holds its
sandbox, without the scheduler. Pure: the node's inbox (workers/inbox.py) asks
:func:`admit_direct` about each such record.

Why it is safe to skip the scheduler for a command. The scheduler's part in one is
to prove who sent it, check it is fresh and new, and that the sender owns the
sandbox. At create, the scheduler hands the node the sandbox's key, sealed for the
node (:func:`app.domain.proof.sandbox_key`: derived from the key of the credential
that created the sandbox, which its trainer holds and derives the same key from).
A record proven under that key comes from the creating credential's holder and is
about that sandbox only; another tenant's key, or another sandbox's, proves nothing
here. Freshness and the one run per request id are the node's own (its claim in
Redis, the same as for a command the scheduler routes); a revoked credential is
told to every node by the scheduler (:data:`app.domain.node_tasks.NodeTask.REVOKE_KEYS`).

What stays with the scheduler: trajectory steps (answered from the log), operators'
commands, and any command of a sandbox whose ready reply did not say ``direct``.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Container
from dataclasses import dataclass
from datetime import datetime, timedelta

from app.domain.codec import DeadLetterReason, DecodeError, decode_request
from app.domain.proof import HEADER_KEY, HEADER_MAC, Purpose, check_mac, header, reply_key
from app.domain.records import Record
from app.domain.requests import Exec


@dataclass(frozen=True)
class SandboxKey:
    """What a node holds for one sandbox's direct route."""

    #: The credential the key is derived from (the sandbox's creator's).
    key_id: str
    secret: bytes
    #: The sandbox's owner, and how the log names the creator: what a command sent
    #: under this key is recorded as.
    tenant: str
    actor: str

    def reply_key(self, request_id: uuid.UUID) -> bytes:
        """The key replies to a direct request are proven with (its trainer derives it
        from the same sandbox key)."""
        return reply_key(self.secret, request_id)


@dataclass(frozen=True)
class DirectRules:
    """The limits a node applies to direct records."""

    max_age: timedelta
    max_message_bytes: int
    #: A tenant's replies topic, and how many partitions the broker says it has.
    replies_topic: Callable[[str], str]
    reply_partitions: Callable[[str], int | None]


@dataclass(frozen=True)
class DirectRefusal:
    """A direct record refused."""

    detail: str
    #: Not proven, or unreadable: kept with its bytes on the dead letters, answered
    #: never (an answer could settle someone else's request).
    dead_letter: DeadLetterReason | None = None
    #: Proven and about this sandbox: answered with this failure, under its key.
    request: Exec | None = None


def admit_direct(
    record: Record,
    key: SandboxKey | None,
    revoked: Container[str],
    now: datetime,
    rules: DirectRules,
) -> Exec | DirectRefusal:
    """The command a direct record carries, as its proven sender's, or why not.
    ``key`` is what the node holds for the sandbox the record is keyed by (None: no
    such sandbox here, or none with a direct route)."""
    value = record.value or b""
    key_id, proof = header(record.headers, HEADER_KEY), header(record.headers, HEADER_MAC)
    unproven = DeadLetterReason.UNAUTHENTICATED
    if key is None:
        return DirectRefusal("no sandbox here has a direct route under that key", unproven)
    if key_id != key.key_id or not check_mac(key.secret, Purpose.DIRECT, value, proof):
        return DirectRefusal("the record does not match the sandbox's key", unproven)
    if key.key_id in revoked:
        return DirectRefusal(f"credential {key.key_id} is revoked", unproven)
    try:
        request = decode_request(value, rules.max_message_bytes)
    except DecodeError as exc:
        return DirectRefusal(str(exc), exc.reason)
    sandbox_id = record.key.decode(errors="replace") if record.key else None
    if not isinstance(request, Exec) or request.sandbox_id != sandbox_id:
        return DirectRefusal(
            "only an Exec keyed by its own sandbox id comes the direct route",
            DeadLetterReason.INVALID,
        )
    age = now - request.sent_at
    if abs(age) > rules.max_age:
        # Never answered: one from the past may be a copy of a request that ran.
        return DirectRefusal(
            f"stale: sent_at is {age.total_seconds():.0f}s from the node's clock", unproven
        )
    topic = rules.replies_topic(key.tenant)
    wanted = request.reply_to
    if wanted is not None:
        count = rules.reply_partitions(topic)
        if wanted.topic != topic or count is None or wanted.partition >= count:
            return DirectRefusal(f"replies go to an existing partition of {topic} only", unproven)
    admitted = request.model_copy(update={"tenant": key.tenant, "actor": key.actor})
    if request.tenant and request.tenant != key.tenant:
        return DirectRefusal(f"the request says tenant {request.tenant!r}", None, admitted)
    if request.trajectory_id is not None or request.step is not None:
        # Steps are answered from the log when they ran before: the scheduler's.
        return DirectRefusal("trajectory steps go through the scheduler", None, admitted)
    return admitted
