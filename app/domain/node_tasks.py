"""What the scheduler hands a node: the task for each request, sealed so that a node
runs only what the scheduler sent it, even if someone else can write to Redis or to
its inbox topic. Pure: Celery carries it (:mod:`app.taskqueue`), Kafka carries the
inbox's share (:data:`VIA_INBOX`).

A task's arguments are a :class:`TaskEnvelope` (the request's own JSON, which the node
validates again, and what the node needs to answer it), the id of the node key it is
proven with, and the proof. The proof covers the task's name with the envelope, so a
sealed task sent again under another name is refused; the reply key inside is
encrypted for the node (AES-256-GCM under a key derived from the node's), so whoever
reads Redis or the inbox topic learns nothing it could answer a trainer with.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
from dataclasses import dataclass
from enum import StrEnum

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from pydantic import Field

from app.domain.base import Message
from app.domain.codec import DecodeError, check_shape
from app.domain.egress import EgressSecret
from app.domain.proof import Purpose, check_mac, mac
from app.domain.requests import (
    CreateSandbox,
    DestroySandbox,
    Exec,
    ExposePort,
    FreezeSandbox,
    KillCommand,
    ReadFile,
    RequestBase,
    SnapshotSandbox,
    ThawSandbox,
    WriteFile,
)


class NodeTask(StrEnum):
    """Names of the tasks a node worker runs."""

    CREATE = "dsec.node.create"
    EXEC = "dsec.node.exec"
    KILL_COMMAND = "dsec.node.kill_command"
    WRITE_FILE = "dsec.node.write_file"
    READ_FILE = "dsec.node.read_file"
    DESTROY = "dsec.node.destroy"
    FREEZE = "dsec.node.freeze"
    THAW = "dsec.node.thaw"
    SNAPSHOT = "dsec.node.snapshot"
    EXPOSE = "dsec.node.expose"
    #: Not a request's: the credentials revoked, whose sandbox keys stop working
    #: (app/domain/direct.py); comes on the inbox, sealed as a task is.
    REVOKE_KEYS = "dsec.node.revoke_keys"


@dataclass(frozen=True)
class NodeWork:
    """A request kind a node carries out, declared once (:data:`NODE_WORK`)."""

    #: The task that carries it (its name is on the wire: Celery's and the inbox's).
    task: NodeTask
    #: What the node validates the task's request as.
    request: type[RequestBase]
    #: What the node does, in a line (the Celery task's description in Flower).
    summary: str
    #: True: the task comes on the node's inbox topic rather than through Celery. The
    #: data plane, thousands per second per node, where Celery's per-task work (Redis
    #: round trips, task events for Flower) cost more than the command itself.
    via_inbox: bool = False

    @property
    def request_type(self) -> str:
        """The ``type`` of the requests this work carries out."""
        found: str = self.request.model_fields["type"].default
        return found


#: Every request kind a node carries out. The scheduler's routing
#: (:data:`TASK_FOR_REQUEST`), the node's Celery tasks and its inbox
#: (:data:`VIA_INBOX`) all derive from this table; the node's handler for each is in
#: ``workers/tasks.py`` (``HANDLERS``), checked against it by the unit tests.
NODE_WORK: tuple[NodeWork, ...] = (
    NodeWork(NodeTask.CREATE, CreateSandbox,
             "Create and start a sandbox (replaying a trajectory's commands, if given)."),
    NodeWork(NodeTask.EXEC, Exec,
             "Claim a command and start it in its sandbox; it runs off the task.",
             via_inbox=True),
    NodeWork(NodeTask.KILL_COMMAND, KillCommand,
             "Kill a command running (or waiting its turn) in a sandbox.", via_inbox=True),
    NodeWork(NodeTask.WRITE_FILE, WriteFile, "Write a file into a sandbox."),
    NodeWork(NodeTask.READ_FILE, ReadFile, "Read a file from a sandbox."),
    NodeWork(NodeTask.DESTROY, DestroySandbox, "Destroy a sandbox."),
    NodeWork(NodeTask.FREEZE, FreezeSandbox,
             "Freeze a sandbox (its trainer's lease lapsed, or it was asked)."),
    NodeWork(NodeTask.THAW, ThawSandbox, "Thaw a frozen sandbox."),
    NodeWork(NodeTask.SNAPSHOT, SnapshotSandbox,
             "Keep a sandbox's files as an image of its tenant, in the hub."),
    NodeWork(NodeTask.EXPOSE, ExposePort,
             "Open a sandbox's port at a URL with a signed, expiring token."),
)  # fmt: skip

#: Each task's declaration.
WORK_OF_TASK = {work.task: work for work in NODE_WORK}
#: Which task carries out each request type.
TASK_FOR_REQUEST = {work.request_type: work.task for work in NODE_WORK}
#: Tasks the scheduler hands a node on its inbox topic rather than through Celery;
#: creates, destroys, freezes and file transfers stay Celery tasks.
VIA_INBOX = frozenset(work.task for work in NODE_WORK if work.via_inbox)
#: What a node's inbox takes: the data plane's tasks and the revocations.
INBOX_TASKS = VIA_INBOX | {NodeTask.REVOKE_KEYS}


def inbox_record(task: NodeTask, args: list[str]) -> bytes:
    """A sealed task as the value of a record on a node's inbox topic."""
    return json.dumps({"task": task.value, "args": args}, separators=(",", ":")).encode()


def read_inbox_record(value: bytes) -> tuple[NodeTask, list[str]] | str:
    """The task and its sealed arguments from an inbox record; else why not."""
    try:
        # Trainers write to the inbox too (the direct route): a record without their
        # header is anybody's until its seal is checked, and parsing may cost more.
        check_shape(value)
    except DecodeError as exc:
        return f"not an inbox record: {exc}"
    try:
        doc = json.loads(value)
        task = NodeTask(doc["task"])
        args = doc["args"]
    except (ValueError, TypeError, KeyError, RecursionError) as exc:
        return f"not an inbox record: {str(exc)[:200]}"
    if task not in INBOX_TASKS:
        return f"{task.value} does not come on the inbox"
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        return "inbox record arguments are not a list of strings"
    return task, args


class TaskEnvelope(Message):
    """What the scheduler hands a node with a request."""

    request: str = Field(description="The request's JSON, its tenant and actor set.")
    reply_key_sealed: str | None = Field(
        None,
        description=(
            "The key the node proves its replies with, encrypted for the node"
            " (:func:`seal_secret`; None: nobody waits)."
        ),
    )
    restore: list[str | list[str]] | None = Field(
        None, description="A trajectory's commands to replay into a new sandbox first."
    )
    sandbox_key_sealed: str | None = Field(
        None,
        description=(
            "A create's: the sandbox's direct-route key (app/domain/direct.py), encrypted"
            " for the node; None: its commands come through the scheduler only."
        ),
    )
    hub_login: str | None = Field(
        None,
        description=(
            "A snapshot's hub login (app/domain/hub_access.py, tickets): the user in clear,"
            " then its password sealed for the node, space-separated."
        ),
    )
    sandbox_key_id: str | None = Field(
        None, description="The credential the sandbox key is derived from."
    )
    egress_secrets_sealed: str | None = Field(
        None,
        description=(
            "A create's: the tenant's egress secrets its allowlist reaches (a JSON list"
            " of destination, header, value), encrypted for the node."
        ),
    )
    image_digest: str | None = Field(
        None,
        pattern=r"^sha256:[0-9a-f]{64}$",
        description=(
            "A create of a tenant's image: the manifest its name was first pushed with;"
            " the node runs that content, whatever the tag was moved to since."
        ),
    )


def _cipher(secret: bytes) -> AESGCM:
    """The node's sealing key: HMAC-SHA256(node key, "dsec-seal-v1")."""
    return AESGCM(hmac.digest(secret, b"dsec-seal-v1", hashlib.sha256))


def seal_secret(secret: bytes, plain: bytes) -> str:
    """``plain`` encrypted for the holder of the node key ``secret``: base64 of a
    random 12-byte nonce and the AES-256-GCM ciphertext with its tag."""
    nonce = os.urandom(12)
    return base64.b64encode(nonce + _cipher(secret).encrypt(nonce, plain, None)).decode()


def open_secret(secret: bytes, sealed: str) -> bytes | None:
    """What :func:`seal_secret` sealed for this node key; None if it was not."""
    try:
        raw = base64.b64decode(sealed, validate=True)
        return _cipher(secret).decrypt(raw[:12], raw[12:], None)
    except (ValueError, InvalidTag):
        return None


def _signed(task: NodeTask, body: str) -> bytes:
    return task.value.encode() + b"\n" + body.encode()


def seal(task: NodeTask, envelope: TaskEnvelope, key_id: str, secret: bytes) -> list[str]:
    """A task's arguments: the envelope, the node key's id, and the proof of both the
    task's name and the envelope."""
    body = envelope.model_dump_json()
    return [body, key_id, mac(secret, Purpose.TASK, _signed(task, body))]


@dataclass(frozen=True)
class Opened:
    """A task the scheduler sealed for this node: its envelope and the reply key."""

    envelope: TaskEnvelope
    reply_key: bytes | None
    #: A create's direct-route key (None: none was handed over).
    sandbox_key: bytes | None = None
    #: A snapshot's hub login, user and password (None: none was handed over).
    hub_login: tuple[str, str] | None = None
    #: A create's egress secrets (app/domain/egress.py), opened.
    secrets: tuple[EgressSecret, ...] = ()


def unseal(task: NodeTask, args: list[str], key_id: str, secret: bytes) -> Opened | str:
    """The envelope and its reply key if the proof holds for ``task`` under this
    node's key; else why not."""
    if len(args) != 3 or not all(isinstance(a, str) for a in args):
        return "not a sealed task (expected [envelope, key id, proof])"
    body, their_key, proof = args
    if their_key != key_id:
        return f"proven for key {their_key[:40]!r}, this node holds {key_id}"
    if not check_mac(secret, Purpose.TASK, _signed(task, body), proof):
        return f"the task does not match its proof as {task.value}"
    try:
        envelope = TaskEnvelope.model_validate(json.loads(body))
    except (ValueError, RecursionError) as exc:
        return f"unreadable envelope: {str(exc)[:200]}"
    key = sandbox = None
    if envelope.reply_key_sealed is not None:
        key = open_secret(secret, envelope.reply_key_sealed)
        if key is None:
            return "the reply key is not sealed for this node"
    if envelope.sandbox_key_sealed is not None:
        sandbox = open_secret(secret, envelope.sandbox_key_sealed)
        if sandbox is None:
            return "the sandbox key is not sealed for this node"
    login = None
    if envelope.hub_login is not None:
        user, _, sealed = envelope.hub_login.partition(" ")
        password = open_secret(secret, sealed) if sealed else None
        if password is None:
            return "the hub login is not sealed for this node"
        login = (user, password.decode(errors="replace"))
    secrets: tuple[EgressSecret, ...] = ()
    if envelope.egress_secrets_sealed is not None:
        opened = open_egress_secrets(secret, envelope.egress_secrets_sealed)
        if isinstance(opened, str):
            return opened
        secrets = opened
    return Opened(envelope, key, sandbox, login, secrets)


def seal_egress_secrets(secret: bytes, secrets: list[EgressSecret]) -> str | None:
    """A create's egress secrets sealed for the node key ``secret`` (None: none)."""
    if not secrets:
        return None
    return seal_secret(secret, json.dumps([s.plain() for s in secrets]).encode())


def open_egress_secrets(secret: bytes, sealed: str) -> tuple[EgressSecret, ...] | str:
    """What :func:`seal_egress_secrets` sealed for this node key; else why not (never
    what they hold)."""
    opened = open_secret(secret, sealed)
    if opened is None:
        return "the egress secrets are not sealed for this node"
    try:
        return tuple(EgressSecret.model_validate(s) for s in json.loads(opened))
    except (ValueError, TypeError, RecursionError):
        return "the egress secrets are unreadable"


def revocation(key_ids: list[str], key_id: str, secret: bytes) -> bytes:
    """An inbox record telling a node that ``key_ids`` are revoked, sealed with its key
    (the envelope's ``request`` is their JSON list)."""
    envelope = TaskEnvelope(request=json.dumps(sorted(key_ids)))
    return inbox_record(NodeTask.REVOKE_KEYS, seal(NodeTask.REVOKE_KEYS, envelope, key_id, secret))


def revoked_keys(opened: Opened) -> list[str] | str:
    """The key ids a sealed revocation names; else why not."""
    try:
        found = json.loads(opened.envelope.request)
    except (ValueError, RecursionError) as exc:
        return f"unreadable revocation: {str(exc)[:200]}"
    if not isinstance(found, list) or not all(isinstance(k, str) for k in found):
        return "a revocation is a list of key ids"
    return found
