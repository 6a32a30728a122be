"""What the log admits beyond a proof, as attacks and races (issue 23, items 6 and 11):
a registered node's valid key speaks only for the sandboxes placed on that node, and
a life ends once in the log whoever races to end it.

A rogue node here is a node credential issued as `dsec node` issues one; it never
runs a worker, it only signs what a compromised node host could send.
"""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from app import bus, credentials
from app.config import Settings
from app.control import dead_letters, tenants
from app.credentials import Credential
from app.domain.base import StopReason, utcnow
from app.domain.codec import encode
from app.domain.events import (
    CommandCompleted,
    CommandPayload,
    EventBase,
    SandboxStarted,
    SandboxStopped,
    StartedPayload,
    StoppedPayload,
)
from app.domain.proof import Purpose, Role, headers
from app.sdk import Client, Sandbox
from tests.conftest import scalar, tenant_client, wait_for

pytestmark = pytest.mark.integration

ROGUE = "node-rogue"


@pytest.fixture(scope="module")
def alice(stack: Settings) -> Iterator[Client]:
    with tenant_client(stack, "alice", "scope") as c:
        yield c


@pytest.fixture(scope="module")
def rogue(stack: Settings) -> Credential:
    """A registered node's valid credential (the node never runs)."""
    tenants.ensure(stack, Role.NODE, ROGUE)
    return credentials.load(credentials.node_file(stack, ROGUE))


def _send(settings: Settings, event: EventBase, cred: Credential) -> None:
    publisher = bus.Publisher(settings)
    value = encode(event)
    proof = headers(Purpose.EVENT, cred.key_id, cred.secret, value)
    publisher.publish(settings.topic_events, event.key, value, wait=True, headers=proof)
    publisher.close()


def _letter(settings: Settings, event: EventBase, reason: str) -> Any:
    """The projector's dead letter of ``event`` with ``reason``, once it is there."""
    wanted = dead_letters.LetterFilter(reason=reason, consumer="projector")

    def found() -> Any:
        for stored in dead_letters.read(settings, wanted, timeout_s=10):
            original = base64.b64decode(stored.letter.original_b64)
            if str(event.event_id).encode() in original:
                return stored.letter
        return None

    return wait_for(found, 60, f"a {reason} dead letter of {type(event).__name__}")


def _logged(db: Any, event: EventBase) -> int:
    with db() as conn:
        return int(
            scalar(conn, "SELECT count(*) FROM events WHERE event_id = :e", e=event.event_id)
        )


def test_a_node_cannot_end_start_or_bill_what_was_not_placed_on_it(
    stack: Settings, alice: Client, rogue: Credential, db: Any
) -> None:
    with alice.create(memory_mb=64, ttl_s=600) as box:
        # When a registered node's valid key ends alice's sandbox, placed on another node
        stop = SandboxStopped(
            sandbox_id=box.id, node_id=ROGUE, tenant="alice",
            payload=StoppedPayload(reason=StopReason.DESTROYED, detail="forged by a node"),
        )  # fmt: skip
        _send(stack, stop, rogue)
        # And adds a command to her bill
        command = CommandCompleted(
            sandbox_id=box.id, node_id=ROGUE, tenant="alice", job_id="scope",
            payload=CommandPayload(
                request_id=uuid.uuid4(), actor="alice/k", command="mine", exit_code=0,
                duration_ms=1, stdout_bytes=0, stderr_bytes=0,
            ),
        )  # fmt: skip
        _send(stack, command, rogue)
        # And starts a sandbox nobody requested, billed to alice
        ghost = SandboxStarted(
            sandbox_id=f"sb-ghost-{uuid.uuid4().hex[:8]}", node_id=ROGUE, tenant="alice",
            occurred_at=utcnow() - timedelta(hours=1),
            payload=StartedPayload(request_id=uuid.uuid4(), container_id="ghost"),
        )  # fmt: skip
        _send(stack, ghost, rogue)

        # Then each is a dead letter `forbidden`, not a fact
        for event in (stop, command, ghost):
            letter = _letter(stack, event, "forbidden")
            said = f"{ROGUE} stated {type(event).__name__} about sandbox {event.sandbox_id}"
            assert said in letter.detail
            assert _logged(db, event) == 0
        # And the sandbox lives, its bill without the forged command or the ghost
        with db() as conn:
            assert scalar(conn, "SELECT state FROM sandboxes WHERE sandbox_id = :s", s=box.id) == (
                "running"
            )
            assert not scalar(
                conn, "SELECT count(*) FROM lives WHERE sandbox_id = :s", s=ghost.sandbox_id
            )
            assert not scalar(
                conn, "SELECT count(*) FROM commands WHERE request_id = :r",
                r=command.payload.request_id,
            )  # fmt: skip
        assert box.exec("echo alive").stdout == b"alive\n"


def test_a_life_ends_once_in_the_log_whoever_races_to_end_it(
    stack: Settings, alice: Client, db: Any
) -> None:
    # Given a sandbox destroyed by its tenant (its node stated the end)
    box: Sandbox = alice.create(memory_mb=64, ttl_s=600)
    box.close()
    with db() as conn:
        wait_for(
            lambda: scalar(conn, "SELECT state FROM sandboxes WHERE sandbox_id = :s", s=box.id)
            == "stopped",
            30, "the destroy in the log",
        )  # fmt: skip
    # When its own node states a second end (the reconciler's race, replayed by hand)
    node = credentials.load(credentials.node_file(stack, stack.node_id))
    again = SandboxStopped(
        sandbox_id=box.id, node_id=stack.node_id, tenant="alice", job_id="scope",
        payload=StoppedPayload(reason=StopReason.FAILED, detail="container vanished"),
    )  # fmt: skip
    _send(stack, again, node)
    # Then it is set aside with its reason, and the log holds one end
    _letter(stack, again, "already_ended")
    time.sleep(1)
    with db() as conn:
        ends = scalar(
            conn,
            "SELECT count(*) FROM events WHERE sandbox_id = :s AND type = 'SandboxStopped'",
            s=box.id,
        )
        reason = scalar(conn, "SELECT end_reason FROM lives WHERE sandbox_id = :s", s=box.id)
    assert (ends, reason) == (1, "destroyed")
