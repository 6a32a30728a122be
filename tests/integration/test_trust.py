"""Tenants and trust, as attacks: a second tenant, an outsider on the bus and a forged
node try to act on a tenant's sandboxes, outputs and bill; each is refused, logged
with who tried, and changes nothing.

Tenant "alice" owns the sandboxes; tenant "bob" is another team on the same stack;
the outsider has a Kafka client and no credential (or a made-up one).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from kafka import TopicPartition
from sqlalchemy import text

from app import bus
from app.config import Settings
from app.credentials import Credential
from app.db import credentials
from app.domain.base import utcnow
from app.domain.codec import encode
from app.domain.events import NodeHeartbeat, NodePayload, SandboxStopped, StoppedPayload
from app.domain.proof import Purpose, Role, headers
from app.domain.replies import ExecOutput
from app.domain.requests import (
    CreateSandbox,
    DestroyGroup,
    DestroySandbox,
    Exec,
    RenewLease,
    ReplyTo,
)
from app.errors import RequestTimeout, SandboxNotFound, SandboxRejectedError, ServiceUnavailable
from app.sdk import Client, Sandbox
from app.sdk.client import exec_request
from tests.conftest import ensure_tenant, forget_tenant, scalar, tenant_client, wait_for
from tests.forger import forging

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def alice(stack: Settings) -> Iterator[Client]:
    with tenant_client(stack, "alice", "trust") as c:
        yield c


@pytest.fixture(scope="module")
def bob(stack: Settings) -> Iterator[Client]:
    with tenant_client(stack, "bob", "trust") as c:
        yield c


@pytest.fixture
def box(alice: Client) -> Iterator[Sandbox]:
    with alice.create(memory_mb=64, ttl_s=600) as sandbox:
        sandbox.write_file("/workspace/secret", b"alice's secret")
        yield sandbox


def _rejection(db: Any, request_id: uuid.UUID) -> dict[str, Any]:
    """The SandboxRejected event of a request (waits for it)."""
    with db() as conn:
        row = wait_for(
            lambda: conn.execute(
                text(
                    "SELECT tenant, payload FROM events WHERE type = 'SandboxRejected'"
                    " AND payload->>'request_id' = :r"
                ),
                {"r": str(request_id)},
            ).first(),
            what=f"the refusal of {request_id}",
        )
    return {"tenant": row.tenant, **row.payload}


def _sample(
    db: Any, reason: str, detail: str, since: Any, timeout_s: float = 40.0
) -> dict[str, Any]:
    """The sampled SandboxRejected of refusals nobody answers for (no proof, a replay,
    a stale request) whose detail has ``detail``, logged since ``since``: the first of
    each kind's 10 s window is logged at once, so its request id may be another record's."""
    with db() as conn:
        row = wait_for(
            lambda: conn.execute(
                text(
                    "SELECT tenant, payload FROM events WHERE type = 'SandboxRejected'"
                    " AND payload->>'reason' = :r AND payload->>'detail' LIKE :d"
                    " AND payload ? 'folded' AND occurred_at >= :since"
                    " ORDER BY position DESC"
                ),
                {"r": reason, "d": f"%{detail}%", "since": since},
            ).first(),
            timeout_s=timeout_s,
            what=f"a sample of {reason} ({detail}) in the log",
        )
    return {"tenant": row.tenant, **row.payload}


def _nothing_ran(db: Any, request_id: uuid.UUID) -> bool:
    with db() as conn:
        found = scalar(
            conn,
            "SELECT count(*) FROM events WHERE payload->>'request_id' = :r"
            " AND type NOT IN ('SandboxRejected')",
            r=str(request_id),
        )
    return int(found) == 0


# --- another tenant's requests ----------------------------------------------------


@pytest.mark.parametrize("attack", ["exec", "read", "write", "destroy"])
def test_another_tenant_cannot_touch_a_sandbox(
    attack: str, box: Sandbox, bob: Client, db: Any
) -> None:
    # Given alice's sandbox, and bob holding its id
    theirs = bob.sandbox(box.id)
    requests: dict[str, Callable[[], Any]] = {
        "exec": lambda: theirs.exec("cat /workspace/secret"),
        "read": lambda: theirs.read_file("/workspace/secret"),
        "write": lambda: theirs.write_file("/workspace/secret", b"planted by bob"),
        "destroy": lambda: theirs.close(),
    }
    # When bob acts on it, Then he is refused as if it did not exist (he learns
    # nothing of others' sandboxes)
    with pytest.raises(SandboxNotFound) as refused:
        requests[attack]()
    assert refused.value.reason == "unknown_sandbox"
    assert refused.value.detail == f"bob has no live sandbox {box.id}"
    # And alice's sandbox and file are as she left them
    assert box.read_file("/workspace/secret") == b"alice's secret"
    assert box.exec("echo alive").stdout == b"alive\n"
    # And the log names bob (his tenant and key) as the one refused
    query = text(
        "SELECT tenant, actor, denied FROM audit_trail"
        " WHERE sandbox_id = :s AND type = 'SandboxRejected' ORDER BY position DESC"
    )
    with db() as conn:
        row = wait_for(
            lambda: conn.execute(query, {"s": box.id}).first(), what="the refusal in the log"
        )
    assert row is not None and row.tenant == "bob" and row.denied
    assert row.actor.startswith(f"bob/{bob.credential.key_id}")
    assert _no_command_by(db, box.id, "bob")


def _no_command_by(db: Any, sandbox_id: str, tenant: str) -> bool:
    with db() as conn:
        return not scalar(
            conn,
            "SELECT count(*) FROM events WHERE sandbox_id = :s AND type IN"
            " ('CommandCompleted', 'FileRead', 'FileWritten', 'SandboxStopped')"
            " AND payload->>'actor' LIKE :t",
            s=sandbox_id,
            t=f"{tenant}/%",
        )


def test_an_operator_may_act_and_the_log_says_so(box: Sandbox, stack: Settings, db: Any) -> None:
    ensure_tenant(stack, "operator", "operator")
    with Client(stack, tenant="operator", job_id="ops") as ops:
        assert ops.sandbox(box.id).exec("cat /workspace/secret").stdout == b"alice's secret"

    def completed() -> Any:
        # The answer can come before its event is in Postgres (the projector's way)
        with db() as conn:
            return conn.execute(
                text(
                    "SELECT tenant, payload->>'actor' FROM events WHERE sandbox_id = :s"
                    " AND type = 'CommandCompleted' AND payload->>'actor' LIKE 'operator:%'"
                    " ORDER BY position DESC LIMIT 1"
                ),
                {"s": box.id},
            ).first()

    tenant, actor = wait_for(completed, 20, "the operator's command in the log")
    # The command is on alice's bill, and the log says an operator ran it.
    assert tenant == "alice" and actor.startswith("operator:operator/")


def test_trajectories_are_the_tenants_own(alice: Client, bob: Client) -> None:
    trajectory = f"episode-{uuid.uuid4().hex[:6]}"
    with alice.create(memory_mb=64) as a, bob.create(memory_mb=64) as b:
        # Given alice's step 0 of a trajectory
        mine = a.exec("echo alice > /workspace/w; echo alice-0", trajectory_id=trajectory, step=0)
        assert not mine.replayed
        # When bob runs "the same" step 0 in his own sandbox
        his = b.exec("echo bob-0", trajectory_id=trajectory, step=0)
        # Then it runs for real: he does not read alice's recorded output
        assert not his.replayed and his.stdout == b"bob-0\n"
        # When bob answers step 1 before alice gets there
        b.exec("echo forged-1", trajectory_id=trajectory, step=1)
        # Then alice's step 1 runs for real, with her own output
        step1 = a.exec("echo alice-1", trajectory_id=trajectory, step=1)
        assert not step1.replayed and step1.stdout == b"alice-1\n"
    # And bob restoring "the trajectory" gets his own steps, not alice's
    with bob.create(memory_mb=64, restore_trajectory=trajectory) as restored:
        assert restored.exec("cat /workspace/w 2>&1 || true").stdout != b"alice\n"


def test_leases_and_groups_are_the_tenants_own(
    stack: Settings, alice: Client, bob: Client, db: Any
) -> None:
    ensure_tenant(stack, "alice")
    leased = Client(stack, tenant="alice", job_id="trust", lease=True, lease_ttl_s=30)
    try:
        box = leased.create(memory_mb=64)
        group = alice.create_group(2, memory_mb=64)
        assert leased.lease_id is not None
        # When bob renews alice's lease id with a 1 s TTL and no grace,
        # and destroys alice's group id
        bob.publish(RenewLease(sandbox_id=leased.lease_id, ttl_s=1, grace_s=0))
        bob.publish(DestroyGroup(sandbox_id=group.id, reply_to=None))
        time.sleep(4)
        # Then nothing of alice's was frozen or destroyed
        assert box.exec("echo alive").stdout == b"alive\n"
        assert [m.exec("echo up").stdout for m in group] == [b"up\n", b"up\n"]
        with db() as conn:
            assert not scalar(
                conn,
                "SELECT count(*) FROM events WHERE sandbox_id = ANY(:ids)"
                " AND type IN ('SandboxFrozen', 'SandboxStopped')",
                ids=[box.id, *(m.id for m in group)],
            )
        group.close()
        box.close()
    finally:
        leased.close()


# --- an outsider on the bus -------------------------------------------------------


def _raw_request(
    settings: Settings, request: Any, cred: Credential | None, value: bytes | None = None
) -> None:
    """Send ``request`` as a plain Kafka client would, proven with ``cred`` (or not)."""
    body = value if value is not None else encode(request)
    proof = headers(Purpose.REQUEST, cred.key_id, cred.secret, body) if cred else None
    publisher = bus.Publisher(settings)
    try:
        publisher.publish(
            settings.topic_requests, request.sandbox_id, body, wait=True, headers=proof
        )
    finally:
        publisher.close()


def test_unsigned_or_made_up_credentials_change_nothing(
    stack: Settings, box: Sandbox, db: Any
) -> None:
    made_up = Credential("k-madeup000000", os.urandom(32), Role.TENANT, "alice")
    since = utcnow()
    for cred, failure in ((None, "missing"), (made_up, "unknown_key")):
        destroy = DestroySandbox(sandbox_id=box.id)
        _raw_request(stack, destroy, cred)
        # Logged as a sample of its kind (nobody proved it: nobody is answered)
        refusal = _sample(db, "unauthenticated", f"{failure}:", since)
        assert refusal["actor"] is None and refusal["tenant"] == "unauthenticated"
        assert refusal["folded"] >= 1
    assert box.exec("echo alive").stdout == b"alive\n"


def _capture(settings: Settings, send: Callable[[], Any], match: Callable[[Any], bool]) -> Any:
    """The first record of the requests topic written by ``send()`` that ``match``es."""
    consumer = bus.make_consumer(settings)
    parts = bus.partitions(consumer, settings.topic_requests)
    consumer.assign(parts)
    for tp, end in bus.high_watermarks(settings, parts).items():
        consumer.seek(tp, end)
    send()
    try:
        for _ in range(100):
            for records in consumer.poll(timeout_ms=100).values():
                for record in records:
                    if match(record):
                        return record
        pytest.fail("the request never showed on the bus")
    finally:
        consumer.close()


def test_a_captured_request_cannot_be_replayed_or_altered(
    stack: Settings, alice: Client, box: Sandbox, db: Any
) -> None:
    # Given a write alice sent, captured off the bus by an outsider
    captured = _capture(
        stack,
        lambda: box.write_file("/workspace/state", b"v1"),
        lambda r: b"WriteFile" in (r.value or b"") and box.id.encode() in (r.value or b""),
    )
    box.write_file("/workspace/state", b"v2")
    # When the outsider sends it again, byte for byte with its proof
    publisher = bus.Publisher(stack)
    publisher.publish(
        stack.topic_requests, box.id, captured.value, wait=True, headers=captured.headers
    )
    # Then it is refused as a replay (logged as a sample under alice's key), and the
    # file keeps alice's latest content
    since = utcnow() - timedelta(seconds=5)
    replay = _sample(db, "duplicate", "a replay", since)
    assert replay["tenant"] == "alice"
    assert box.read_file("/workspace/state") == b"v2"
    # When the outsider alters it (a new id, other content) and keeps the proof
    body = json.loads(captured.value)
    body["request_id"] = str(uuid.uuid4())
    altered = json.dumps(body).encode()
    publisher.publish(stack.topic_requests, box.id, altered, wait=True, headers=captured.headers)
    publisher.close()
    # Then it is refused unauthenticated, and nothing was written
    refusal = _sample(db, "unauthenticated", "bad_mac", since)
    assert refusal["actor"] is None
    assert box.read_file("/workspace/state") == b"v2"


def test_a_stale_request_is_refused_and_answered_only_from_the_future(
    stack: Settings, alice: Client, box: Sandbox, db: Any
) -> None:
    # Given a request signed long ago (a captured one kept for later, or a bad clock)
    since = utcnow()
    old = Exec(
        sandbox_id=box.id, command="touch /workspace/late", reply_to=alice._reply_to,
        sent_at=utcnow() - timedelta(seconds=stack.request_max_age_s + 60),
    )  # fmt: skip
    # When alice's client sends it, Then it is refused without an answer (it may be a
    # copy of a request admitted then and still running), and the log says why
    with pytest.raises(RequestTimeout):
        alice.call(old, timeout_s=5)
    assert "stale" in _sample(db, "unauthenticated", "stale", since)["detail"]
    assert _nothing_ran(db, old.request_id)
    # A request stamped that far in the future is answered: its original was refused
    # the same way, so nothing of alice's can be waiting on it
    ahead = old.model_copy(
        update={"request_id": uuid.uuid4(), "sent_at": utcnow() + timedelta(seconds=400)}
    )
    with pytest.raises(SandboxRejectedError) as refused:
        alice.call(ahead, timeout_s=20)
    assert refused.value.reason == "unauthenticated" and "stale" in refused.value.detail
    assert _nothing_ran(db, ahead.request_id)


def test_replies_go_only_to_the_senders_own_topic(
    stack: Settings, alice: Client, bob: Client, box: Sandbox, db: Any
) -> None:
    # When bob asks for the answer to his request on alice's replies topic
    sneaky = Exec(
        sandbox_id=box.id, command="true",
        reply_to=ReplyTo(topic=stack.replies_topic("alice"), partition=0),
    )  # fmt: skip
    bob.publish(sneaky)
    # Then it is refused, and no reply is sent anywhere
    refusal = _rejection(db, sneaky.request_id)
    assert refusal["reason"] == "forbidden" and "replies" in refusal["detail"]


def test_a_forged_reply_never_reaches_the_trainer(
    stack: Settings, alice: Client, box: Sandbox
) -> None:
    # Given an outsider who reads alice's requests (on the requests topic and on the
    # node's inbox) and answers on her replies partition first, with exit 0 and stdout
    # of its choice
    with forging(stack, box.id, box.node_id) as forger:
        time.sleep(1.0)
        before = alice.forged_replies
        # When alice runs a failing command five times
        results = [box.exec("echo real; exit 3") for _ in range(5)]
    # Then every answer is the real one
    assert [(r.exit_code, r.stdout) for r in results] == [(3, b"real\n")] * 5
    # And the forgeries were seen and dropped
    assert forger.forged >= 1 and alice.forged_replies > before


def test_forged_platform_events_change_nothing(stack: Settings, box: Sandbox, db: Any) -> None:
    publisher = bus.Publisher(stack)

    def send(event: Any, cred: Credential | None = None) -> None:
        value = encode(event)
        proof = headers(Purpose.EVENT, cred.key_id, cred.secret, value) if cred else None
        publisher.publish(stack.topic_events, event.key, value, wait=True, headers=proof)

    # When an outsider says alice's sandbox stopped, and a ghost node registers
    stop = SandboxStopped(
        sandbox_id=box.id, node_id=stack.node_id, tenant="alice",
        payload=StoppedPayload(reason="destroyed", detail="forged"),
    )  # fmt: skip
    send(stop)
    ghost = NodeHeartbeat(
        node_id=f"ghost-{uuid.uuid4().hex[:6]}",
        payload=NodePayload(
            capacity_sandboxes=10_000, capacity_cpus=1000, capacity_memory_mb=1 << 20,
            queue="node.ghost", sandboxes=[],
        ),
    )  # fmt: skip
    send(ghost)
    # And node0's real key is used for two heartbeats of another node, and node0 is
    # said (unsigned) to run nothing, twice
    from app import credentials

    node_cred = credentials.load(credentials.node_file(stack, stack.node_id))
    send(ghost.model_copy(update={"event_id": uuid.uuid4()}), node_cred)
    for _ in range(2):
        empty = NodeHeartbeat(
            node_id=stack.node_id,
            payload=NodePayload(
                capacity_sandboxes=1, capacity_cpus=1, capacity_memory_mb=64,
                queue=f"node.{stack.node_id}", sandboxes=[],
            ),
        )  # fmt: skip
        send(empty)
    publisher.close()
    time.sleep(12)  # two real heartbeat rounds (5 s each)
    # Then none of it is in the log, and the sandbox lives
    with db() as conn:
        for event_id in (stop.event_id, ghost.event_id):
            assert not scalar(conn, "SELECT count(*) FROM events WHERE event_id = :e", e=event_id)
        assert not scalar(conn, "SELECT count(*) FROM nodes WHERE node_id = :n", n=ghost.node_id)
        state = scalar(conn, "SELECT state FROM sandboxes WHERE sandbox_id = :s", s=box.id)
    assert state == "running"
    assert box.exec("echo alive").stdout == b"alive\n"


def test_a_forged_node_task_is_refused(stack: Settings, db: Any) -> None:
    from app.domain.node_tasks import NodeTask, TaskEnvelope, seal
    from app.taskqueue import make_celery

    # Given someone who can write to the node's queue, but has no key of the node's
    sandbox_id = f"sb-forged-{uuid.uuid4().hex[:8]}"
    create = CreateSandbox(sandbox_id=sandbox_id, tenant="alice", actor="forger")
    envelope = TaskEnvelope(request=create.model_dump_json())
    from app import credentials

    node_key = credentials.load(credentials.node_file(stack, stack.node_id)).key_id
    celery = make_celery(stack)
    celery.send_task(
        NodeTask.CREATE, args=seal(NodeTask.CREATE, envelope, node_key, os.urandom(32)),
        queue=stack.node_queue(),
    )  # fmt: skip
    # Then the node creates nothing, and says so nowhere in the log
    time.sleep(5)
    with db() as conn:
        assert not scalar(conn, "SELECT count(*) FROM events WHERE sandbox_id = :s", s=sandbox_id)


def test_a_forged_or_malformed_inbox_record_runs_nothing(stack: Settings, box: Sandbox) -> None:
    from app import credentials
    from app.control import dead_letters
    from app.domain.node_tasks import NodeTask, TaskEnvelope, inbox_record, seal

    # Given someone who can write to a node's inbox topic, but has no key of the node's
    node_key = credentials.load(credentials.node_file(stack, stack.node_id)).key_id
    forged = Exec(sandbox_id=box.id, tenant="alice", actor="forger", command="touch /tmp/forged")
    forged_envelope = TaskEnvelope(request=forged.model_dump_json())
    sealed = seal(NodeTask.EXEC, forged_envelope, node_key, os.urandom(32))
    since = utcnow()
    publisher = bus.Publisher(stack)
    topic = stack.node_topic(stack.node_id)
    publisher.publish(topic, box.id, inbox_record(NodeTask.EXEC, sealed))
    # and records that are no task at all, or a task the inbox does not take
    publisher.publish(topic, box.id, b"\xff not json")
    publisher.publish(topic, box.id, inbox_record(NodeTask.DESTROY, sealed))
    publisher.flush()
    publisher.close()

    # Then nothing runs, each is dead-lettered with its reason, and the node still serves
    def letters() -> list[Any]:
        return [
            stored.letter
            for stored in dead_letters.read(stack, dead_letters.LetterFilter(since=since))
            if stored.letter.consumer in (f"node {stack.node_id}", f"inbox {stack.node_id}")
        ]

    found = wait_for(lambda: (got := letters()) and len(got) >= 3 and got, what="3 dead letters")
    assert sorted(letter.reason for letter in found) == ["invalid", "invalid", "unauthenticated"]
    assert box.exec("ls /tmp").stdout.split() == []


def test_a_revoked_credential_stops_working(stack: Settings, db: Any) -> None:
    from app.control import tenants

    def table() -> str:  # what the keyrings ask every few seconds before reading keys
        with db() as conn:
            return credentials.fingerprint(conn)

    name = f"gone-{uuid.uuid4().hex[:6]}"
    before = table()
    ensure_tenant(stack, name)
    issued = table()
    with Client(stack, tenant=name, job_id="trust", timeout_s=30) as client:
        box = client.create(memory_mb=64, ttl_s=30)  # its TTL ends it: its owner cannot
        tenants.revoke(stack, name)
        assert len({before, issued, table()}) == 3  # each change is seen as one
        time.sleep(6)  # the keyring's refresh
        since = utcnow()
        request = exec_request(client.request_fields(box.id), "echo still?", timeout_s=5)
        # The broker refuses its principal at once: the request is not even stored
        with pytest.raises(ServiceUnavailable, match="Authorization"):
            client.call(request, 5)
        # And the same signed bytes, carried by a principal that may still write (one
        # with another credential's Kafka access), are refused by the gate, and never
        # answered: a proof that fails proves nobody to answer
        value = encode(request)
        cred = client.credential
        publisher = bus.Publisher(stack)
        publisher.publish(
            stack.topic_requests, box.id, value,
            headers=headers(Purpose.REQUEST, cred.key_id, cred.secret, value), wait=True,
        )  # fmt: skip
        publisher.close()
        assert "revoked" in _sample(db, "unauthenticated", "revoked", since)["detail"]
    forget_tenant(stack, name)


def test_the_database_holds_nothing_to_sign_with(stack: Settings, db: Any) -> None:
    cred = ensure_tenant(stack, "alice")
    with db() as conn:
        rows = conn.execute(text("SELECT row_to_json(c)::text FROM credentials c")).scalars()
        dumped = "".join(rows)
    assert cred.key_id in dumped and cred.secret.hex() not in dumped


def test_denied_attempts_are_listed(stack: Settings, box: Sandbox, bob: Client) -> None:
    from typer.testing import CliRunner

    from app.cli.main import cli

    with pytest.raises(SandboxRejectedError):
        bob.sandbox(box.id).exec("true")
    rows = wait_for(
        lambda: [
            r
            for r in json.loads(
                CliRunner().invoke(cli, ["audit", "--denied", "--sandbox", box.id, "--json"]).stdout
            )
            if r["actor"] and r["actor"].startswith("bob/")
        ],
        what="bob's attempt in `dsec audit --denied`",
    )
    assert rows[0]["outcome"] == "forbidden" and rows[0]["denied"] is True


def test_a_reply_without_proof_is_not_believed(stack: Settings, alice: Client) -> None:
    # A reply for a request alice waits on, unsigned: dropped, alice keeps waiting.
    request_id = uuid.uuid4()
    future = alice.expect(request_id)
    lie = ExecOutput(
        request_id=request_id, sandbox_id="sb-x", exit_code=0, stdout_b64="", stderr_b64="",
        duration_ms=0.0,
    )  # fmt: skip
    publisher = bus.Publisher(stack)
    tp = TopicPartition(alice._reply_to.topic, alice._reply_to.partition)
    publisher.publish(tp.topic, "sb-x", lie, partition=tp.partition, wait=True)
    publisher.close()
    with pytest.raises(RequestTimeout):
        alice.wait(Exec(sandbox_id="sb-x", command="true", request_id=request_id), future, 3)
