"""Proofs carried by messages: who sent one, and that nobody changed it since.

Every message on the bus carries an HMAC-SHA256 of its exact bytes in Kafka record
headers, under a key only its sender (and the platform) can know:

- a request, under the key of a tenant's (or an operator's) credential;
- an event, under the key of the node or the scheduler that states the fact;
- a reply, under a key derived from the requester's key and the request id, so only
  the platform and that requester can make it, and a reply cannot be moved to
  another request;
- a node task, under the key of the node it is for.

The platform stores no secret of a credential: a credential's key is derived from a
master key kept in a file only root reads (``derive_secret``), and the database
holds key ids, owners and revocations. A database reader cannot forge anything.

HMAC and not signatures: verifying costs ~1.5 us here against ~60 us for Ed25519,
and the projector checks every event (tens of thousands a second). The derivation
above is what keeps the platform's stores free of secrets.

docs/protocol.md ("Signing a request") is the reference for clients in other
languages; tests check its worked example byte for byte.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum

#: Record header naming the key a message is proven with.
HEADER_KEY = "dsec-key"
#: Record header carrying the proof: lowercase hex HMAC-SHA256.
HEADER_MAC = "dsec-mac"
#: Key ids: what a credential is known by (in headers, the log and the database).
KEY_ID = re.compile(r"^k-[a-z0-9][a-z0-9-]{2,62}$")
#: Tenant and node names: also parts of topic names and Redis keys.
SUBJECT = re.compile(r"^[a-z0-9][a-z0-9_.-]{1,62}$")
#: The scheduler's key id: derived from the master key like every other, never stored.
SCHEDULER_KEY_ID = "k-scheduler"

Headers = Sequence[tuple[str, bytes]]


class Purpose(StrEnum):
    """What a proof is for; part of what is signed, so one kind of message can never
    pass for another."""

    REQUEST = "request"
    EVENT = "event"
    REPLY = "reply"
    TASK = "task"
    #: A request sent straight to the node that holds its sandbox (app/domain/direct.py).
    DIRECT = "direct"


class Role(StrEnum):
    """What a credential may do."""

    TENANT = "tenant"
    OPERATOR = "operator"
    NODE = "node"
    SCHEDULER = "scheduler"


class ProofFailure(StrEnum):
    """Why a proof did not hold."""

    MISSING = "missing"
    UNKNOWN_KEY = "unknown_key"
    REVOKED = "revoked"
    BAD_MAC = "bad_mac"
    WRONG_ROLE = "wrong_role"


class ProofError(ValueError):
    """A message whose proof does not hold; ``failure`` says how."""

    def __init__(self, failure: ProofFailure, detail: str, key: KeyInfo | None = None) -> None:
        super().__init__(f"{failure.value}: {detail}")
        self.failure = failure
        self.detail = detail
        #: The key the message named, when it exists (a bad MAC under a known key).
        self.key = key


@dataclass(frozen=True)
class Principal:
    """Who a proven message comes from."""

    key_id: str
    role: Role
    #: The tenant (tenants, operators) or node id (nodes) the credential belongs to.
    subject: str

    @property
    def actor(self) -> str:
        """How the log names this sender: owner and key, and the role if it is not a
        tenant's (``team-a/k-3f9a…``, ``operator:ops/k-77c1…``)."""
        if self.role == Role.TENANT:
            return f"{self.subject}/{self.key_id}"
        return f"{self.role.value}:{self.subject}/{self.key_id}"

    @property
    def is_operator(self) -> bool:
        """May act on every tenant's sandboxes."""
        return self.role == Role.OPERATOR


@dataclass(frozen=True)
class KeyInfo:
    """A credential as a verifier sees it: who it is, its key, and whether it holds."""

    principal: Principal
    secret: bytes
    revoked: bool = False


def derive_secret(master: bytes, key_id: str, role: Role, subject: str) -> bytes:
    """A credential's key: HMAC-SHA256(master, "dsec-key-v2" NUL key_id NUL role NUL
    subject). The role and the subject are bound into the key: a row of the credentials
    table changed to give a key another role or owner derives another key, which its
    holder does not have, so what the database says never raises what a key may do."""
    text = "\x00".join(("dsec-key-v2", key_id, role.value, subject))
    return hmac.digest(master, text.encode(), "sha256")


def kafka_password(master: bytes, principal: str) -> str:
    """A Kafka principal's SASL password: hex of HMAC-SHA256(master, "dsec-kafka-v1"
    NUL principal). Derived like the keys, so the broker's credentials can be made
    again from the master key and nothing stores them."""
    return hmac.digest(master, b"dsec-kafka-v1\x00" + principal.encode(), "sha256").hex()


def reply_key(secret: bytes, request_id: uuid.UUID) -> bytes:
    """The key replies to one request are proven with:
    HMAC-SHA256(requester's key, "dsec-reply-v1" NUL request id as canonical text)."""
    return hmac.digest(secret, b"dsec-reply-v1\x00" + str(request_id).encode(), "sha256")


def sandbox_key(secret: bytes, sandbox_id: str) -> bytes:
    """The key of one sandbox's direct route (app/domain/direct.py):
    HMAC-SHA256(creating credential's key, "dsec-sandbox-v1" NUL sandbox id). Its
    trainer derives it; the scheduler hands it to the sandbox's node, sealed."""
    return hmac.digest(secret, b"dsec-sandbox-v1\x00" + sandbox_id.encode(), "sha256")


def mac(secret: bytes, purpose: Purpose, value: bytes) -> str:
    """The proof of ``value``: lowercase hex of
    HMAC-SHA256(key, "dsec-<purpose>-v1" LF value)."""
    signer = hmac.new(secret, b"dsec-" + purpose.value.encode() + b"-v1\n", hashlib.sha256)
    signer.update(value)
    return signer.hexdigest()


def headers(
    purpose: Purpose, key_id: str | None, secret: bytes, value: bytes
) -> list[tuple[str, bytes]]:
    """The record headers that prove ``value`` (no key id for replies: their key is
    the request's)."""
    out = [(HEADER_MAC, mac(secret, purpose, value).encode())]
    if key_id is not None:
        out.insert(0, (HEADER_KEY, key_id.encode()))
    return out


def header(found: Iterable[tuple[str, bytes]] | None, name: str) -> str | None:
    """One header's value as text (the first of that name), or None."""
    for key, value in found or ():
        if key == name:
            try:
                return value.decode("ascii") if value is not None else None
            except UnicodeDecodeError:
                return None
    return None


def check_mac(secret: bytes, purpose: Purpose, value: bytes, found: str | None) -> bool:
    """``found`` is the proof of ``value`` under ``secret`` (constant-time compare)."""
    if found is None or len(found) != 64:
        return False
    return hmac.compare_digest(mac(secret, purpose, value), found)


class KeyLookup:
    """Where a verifier finds keys by id (the platform's keyring, or :class:`InMemoryKeys`)."""

    def lookup(self, key_id: str) -> KeyInfo | None:  # pragma: no cover - interface
        """The key named ``key_id``, or None if there is no such credential."""
        raise NotImplementedError

    def current(self, role: Role, subject: str) -> KeyInfo | None:  # pragma: no cover
        """The newest live key of ``subject`` in ``role`` (a node's, to seal its tasks)."""
        raise NotImplementedError

    def ticket_key(self) -> bytes:  # pragma: no cover - interface
        """The key snapshot logins to the image hub are proven with (the scheduler
        makes them, the hub's token service checks them: app/domain/hub_access.py)."""
        raise NotImplementedError


def derive_ticket_key(master: bytes) -> bytes:
    """The hub ticket key, from the master key."""
    return hmac.new(master, b"dsec hub tickets", hashlib.sha256).digest()


class InMemoryKeys(KeyLookup):
    """Keys held in a dict, all derived from one master key (tests, benchmarks)."""

    def __init__(self, master: bytes) -> None:
        self.master = master
        self.keys: dict[str, KeyInfo] = {}
        self.add(SCHEDULER_KEY_ID, Role.SCHEDULER, "scheduler")

    def ticket_key(self) -> bytes:
        return derive_ticket_key(self.master)

    def add(self, key_id: str, role: Role, subject: str) -> KeyInfo:
        """A new key (its secret derived as the platform derives it)."""
        info = KeyInfo(
            Principal(key_id, role, subject), derive_secret(self.master, key_id, role, subject)
        )
        self.keys[key_id] = info
        return info

    def revoke(self, key_id: str) -> None:
        """Mark a key revoked."""
        info = self.keys[key_id]
        self.keys[key_id] = KeyInfo(info.principal, info.secret, revoked=True)

    def lookup(self, key_id: str) -> KeyInfo | None:
        return self.keys.get(key_id)

    def current(self, role: Role, subject: str) -> KeyInfo | None:
        found = [
            k for k in self.keys.values()
            if k.principal.role == role and k.principal.subject == subject and not k.revoked
        ]  # fmt: skip
        return found[-1] if found else None


def verify(
    purpose: Purpose,
    value: bytes,
    found: Headers | None,
    keys: KeyLookup,
    roles: frozenset[Role],
) -> Principal:
    """The sender of a message proven under a key of one of ``roles``; raises
    :class:`ProofError` otherwise."""
    key_id = header(found, HEADER_KEY)
    proof = header(found, HEADER_MAC)
    if key_id is None or proof is None:
        raise ProofError(ProofFailure.MISSING, f"no {HEADER_KEY}/{HEADER_MAC} headers")
    if not KEY_ID.match(key_id):
        raise ProofError(ProofFailure.UNKNOWN_KEY, f"malformed key id {key_id[:80]!r}")
    info = keys.lookup(key_id)
    if info is None:
        raise ProofError(ProofFailure.UNKNOWN_KEY, f"no credential {key_id}")
    if not check_mac(info.secret, purpose, value, proof):
        raise ProofError(
            ProofFailure.BAD_MAC, f"the {purpose.value} does not match its proof", info
        )
    if info.revoked:
        raise ProofError(ProofFailure.REVOKED, f"credential {key_id} is revoked", info)
    if info.principal.role not in roles:
        raise ProofError(
            ProofFailure.WRONG_ROLE,
            f"a {info.principal.role.value} credential cannot send a {purpose.value}",
            info,
        )
    return info.principal
