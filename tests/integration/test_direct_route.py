"""The direct route (app/domain/direct.py), tried as an attacker would: commands written
straight to a node's inbox by another tenant's principal, under another tenant's key,
sent twice, stale, or under a key revoked since. Only the sandbox's creator's fresh
command runs, once, recorded under its owner."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import text

from app import bus, credentials
from app.config import Settings
from app.control import dead_letters, tenants
from app.credentials import Credential
from app.domain import proof
from app.domain.base import utcnow
from app.domain.codec import encode
from app.domain.proof import Role
from app.domain.requests import Exec, ReplyTo
from app.errors import SandboxError
from app.sdk import Client
from tests.conftest import ensure_tenant, forget_tenant, wait_for

pytestmark = pytest.mark.integration

CONSUMER = "inbox node0"


@pytest.fixture(scope="module")
def victim(stack: Settings) -> Iterator[Any]:
    """A tenant's sandbox, created through the SDK, which says it has a direct route."""
    with Client(stack, credential=ensure_tenant(stack, "direct-victim"), job_id="dr") as client:
        box = client.create(ttl_s=900)
        assert box.direct and box.node_id == "node0"
        yield box
        box.close()


def _send(
    stack: Settings,
    login: Credential,
    signer: Credential,
    sandbox_id: str,
    command: str,
    *,
    sent_at: Any = None,
    again: int = 1,
) -> uuid.UUID:
    """An Exec for ``sandbox_id`` proven under the sandbox key ``signer`` derives,
    written to node0's inbox through ``login``'s Kafka principal (``again`` times)."""
    request = Exec(
        sandbox_id=sandbox_id, job_id="attack", command=command, sent_at=sent_at or utcnow(),
        reply_to=ReplyTo(topic=stack.replies_topic(signer.subject), partition=0),
    )  # fmt: skip
    value = encode(request)
    key = proof.sandbox_key(signer.secret, sandbox_id)
    headers = proof.headers(proof.Purpose.DIRECT, signer.key_id, key, value)
    publisher = bus.Publisher(stack, login=login.kafka)
    try:
        for _ in range(again):
            publisher.publish(
                stack.node_topic("node0"), sandbox_id, value, headers=headers, partition=0,
                wait=True,
            )  # fmt: skip
    finally:
        publisher.close()
    return request.request_id


def _ran(box: Any, mark: str) -> int:
    """How many times a command that appends ``mark`` ran in the sandbox."""
    out = box.exec(f"grep -c {mark} /workspace/ran || true").stdout
    return int(out.strip() or 0)


def _refused(stack: Settings, since: Any, detail: str) -> bool:
    wanted = dead_letters.LetterFilter(consumer=CONSUMER, since=since)
    return any(detail in s.letter.detail for s in dead_letters.read(stack, wanted, 10))


def test_the_owners_command_goes_straight_to_the_node_and_is_logged_under_it(
    stack: Settings, victim: Any, db: Any
) -> None:
    # When the owner runs a command, which its SDK sends to the node's inbox
    result = victim.exec("echo direct; echo owner >> /workspace/ran")
    # Then it ran, and the log records it under the owner and its key
    assert result.exit_code == 0 and result.stdout == b"direct\n"
    key_id = ensure_tenant(stack, "direct-victim").key_id

    def actors() -> list[str]:
        # one query: two would race the projector between them
        query = text(
            "SELECT payload->>'actor' FROM events WHERE sandbox_id = :s"
            " AND type = 'CommandCompleted' AND payload->>'command' LIKE 'echo direct%'"
        )
        with db() as conn:
            return list(conn.execute(query, {"s": victim.id}).scalars())

    assert wait_for(actors, 20, "the command in the log") == [f"direct-victim/{key_id}"]


def test_another_tenants_key_proves_nothing_on_the_direct_route(
    stack: Settings, victim: Any
) -> None:
    # Given another tenant, with its own principal and key
    attacker = ensure_tenant(stack, "direct-attacker")
    since = utcnow()
    # When it writes commands for the victim's sandbox to the node's inbox: under the
    # sandbox key its own key derives, and under the victim's key id with that proof
    _send(stack, attacker, attacker, victim.id, "echo attacker >> /workspace/ran")
    forged = Credential(
        ensure_tenant(stack, "direct-victim").key_id, attacker.secret, Role.TENANT,
        "direct-victim", attacker.kafka,
    )  # fmt: skip
    _send(stack, attacker, forged, victim.id, "echo forged >> /workspace/ran")
    # Then neither ran (the owner's command after them is read after them), and both
    # are dead letters of the node's inbox
    assert _ran(victim, "attacker") == 0 and _ran(victim, "forged") == 0
    wait_for(lambda: _refused(stack, since, "does not match the sandbox's key"), 20, "dead letters")


def test_a_direct_command_sent_twice_or_stale_does_not_run_again(
    stack: Settings, victim: Any
) -> None:
    # Given the owner's credential (as a copy of its record would be made)
    owner = ensure_tenant(stack, "direct-victim")
    since = utcnow()
    # When one of its direct commands is written three times
    _send(stack, owner, owner, victim.id, "echo once >> /workspace/ran", again=3)
    # Then it runs once
    wait_for(lambda: _ran(victim, "once") >= 1, 10, "the command")
    time.sleep(1)
    assert _ran(victim, "once") == 1
    # And one sent longer ago than the freshness window never runs, nor is answered
    stale = utcnow() - timedelta(seconds=stack.request_max_age_s + 60)
    _send(stack, owner, owner, victim.id, "echo stale >> /workspace/ran", sent_at=stale)
    assert _ran(victim, "stale") == 0
    wait_for(lambda: _refused(stack, since, "stale"), 20, "the stale command's dead letter")


def test_a_revoked_keys_sandbox_key_stops_working_within_seconds(stack: Settings) -> None:
    # Given a tenant with two keys, the first of which created a sandbox, and another
    # tenant that holds a copy of that first key (it leaked)
    name = f"direct-rotated-{uuid.uuid4().hex[:6]}"
    first = credentials.load(tenants.issue(stack, Role.TENANT, name).path)
    second = credentials.load(tenants.rotate(stack, name, revoke_old=False).path)
    thief = ensure_tenant(stack, "direct-attacker")
    try:
        with Client(stack, credential=first, job_id="dr") as client:
            box = client.create(ttl_s=300)
            assert box.direct
        owner = Client(stack, credential=second, job_id="dr")
        held = owner.sandbox(box.id)
        # (the leaked key works for the thief, before it is revoked)
        _send(stack, thief, first, box.id, "echo before >> /workspace/ran")
        wait_for(lambda: _ran(held, "before") == 1, 10, "the leaked key's command")
        # When an operator revokes that key
        tenants.revoke(stack, first.key_id)
        since = utcnow()

        # Then within seconds the node refuses commands proven under its sandbox key,
        # even when another tenant's principal writes them
        def refused() -> bool:
            _send(stack, thief, first, box.id, "echo after >> /workspace/ran")
            return _refused(stack, since, f"credential {first.key_id} is revoked")

        wait_for(refused, 40, "the node to refuse the revoked key")
        ran = _ran(held, "after")
        _send(stack, thief, first, box.id, "echo after >> /workspace/ran")
        time.sleep(1)
        assert _ran(held, "after") == ran
        held.close()
        owner.close()
    finally:
        forget_tenant(stack, name)


def test_an_ended_sandbox_says_so_on_the_direct_route(stack: Settings) -> None:
    with Client(stack, credential=ensure_tenant(stack, "direct-victim"), job_id="dr") as client:
        box = client.create(ttl_s=300)
        assert box.direct
        box.close()
        # When its trainer sends it a command after its end, Then it is told so
        with pytest.raises(SandboxError) as raised:
            box.exec("true", timeout_s=5)
        assert raised.value.reason == "sandbox_not_running"
