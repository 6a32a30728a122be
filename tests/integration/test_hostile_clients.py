"""Hostile clients, round 3 (issue 23), on the running stack: a tenant with a valid
credential of its own ("mallory"), a plain Kafka client, or one holding only the
victim's key id, try what worked before; each is refused, and the victim ("carol")
keeps being answered while it happens.

The unit tests (tests/unit/test_hostile_requests.py, test_quotas.py,
test_hostile_properties.py) hold the rules; these hold the stack to them: the
broker's real partition counts, the scheduler's loop, the log and the CLI.
"""

from __future__ import annotations

import base64
import json
import os
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kafka import KafkaConsumer
from sqlalchemy import text
from typer.testing import CliRunner

from app import bus
from app.cli.main import cli
from app.config import Settings
from app.consuming import key_partition
from app.domain.base import utcnow
from app.domain.codec import encode
from app.domain.proof import Purpose, headers
from app.domain.requests import CreateSandbox, DestroySandbox, RenewLease, ReplyTo
from app.errors import SandboxIdInUse, SandboxNotFound, SandboxRejectedError
from app.sdk import Client, Sandbox
from app.sdk.client import exec_request
from tests.conftest import scalar, tenant_client, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def carol(stack: Settings) -> Iterator[Client]:
    with tenant_client(stack, "carol", "hostile") as c:
        yield c


@pytest.fixture(scope="module")
def mallory(stack: Settings) -> Iterator[Client]:
    with tenant_client(stack, "mallory", "hostile") as c:
        yield c


@pytest.fixture
def box(carol: Client) -> Iterator[Sandbox]:
    with carol.create(memory_mb=64, ttl_s=600) as sandbox:
        yield sandbox


def _send(
    settings: Settings,
    key: str,
    value: bytes,
    proof: list[tuple[str, bytes]],
    topic: str | None = None,
) -> None:
    """Bytes on the requests topic (or ``topic``), as any Kafka client writes them
    (keyed, placed by the default partitioner)."""
    publisher = bus.Publisher(settings)
    try:
        publisher.publish(topic or settings.topic_requests, key, value, wait=True, headers=proof)
    finally:
        publisher.close()


def _signed(client: Client, value: bytes) -> list[tuple[str, bytes]]:
    cred = client.credential
    return headers(Purpose.REQUEST, cred.key_id, cred.secret, value)


def _busy(box: Sandbox, stop: threading.Event, seen: list[float]) -> threading.Thread:
    """Carol's commands, one after the other, while an attack goes on: each answered."""

    def run() -> None:
        while not stop.is_set():
            started = utcnow()
            answered = box.exec("echo ok", timeout_s=10).stdout == b"ok\n"
            # A wrong answer counts as one that never came (the test waits for ten).
            seen.append((utcnow() - started).total_seconds() if answered else float("inf"))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _refusal(db: Any, where: str, what: str, timeout_s: float = 40.0, **params: Any) -> Any:
    """The payload of the newest SandboxRejected ``where`` holds for (waits for it; a
    sampled refusal may take the 10 s of its window to be logged)."""
    query = text(
        f"SELECT payload FROM events WHERE type = 'SandboxRejected' AND {where}"
        " ORDER BY position DESC"
    )
    with db() as conn:
        row = wait_for(lambda: conn.execute(query, params).first(), timeout_s=timeout_s, what=what)
    return row.payload


def _reply_partitions(settings: Settings, tenant: str) -> int:
    consumer = KafkaConsumer(**bus.client_options(settings))
    try:
        return len(consumer.partitions_for_topic(settings.replies_topic(tenant)) or ())
    finally:
        consumer.close()


# --- 1. a reply partition the topic does not have ----------------------------------


def test_a_reply_partition_beyond_the_topic_stalls_nobody(
    stack: Settings, mallory: Client, box: Sandbox, db: Any
) -> None:
    # Given mallory's replies topic as the broker made it (4 partitions on the
    # embedded broker, whatever DSEC_REPLY_PARTITIONS says)
    real = _reply_partitions(stack, "mallory")
    stop, seen = threading.Event(), []
    busy = _busy(box, stop, seen)
    # When mallory names a partition beyond it, signed, and a plain client does the same
    # under carol's key id with a wrong MAC
    beyond = ReplyTo(topic=stack.replies_topic("mallory"), partition=real + 3)
    renew = RenewLease(sandbox_id=f"lease-{uuid.uuid4().hex[:8]}", reply_to=beyond)
    mallory.publish(renew)
    theirs = RenewLease(
        sandbox_id="lease-x", reply_to=ReplyTo(topic=stack.replies_topic("carol"), partition=9)
    )
    forged = [("dsec-key", b"k-unknown00"), ("dsec-mac", b"0" * 64)]
    for _ in range(20):
        _send(stack, theirs.sandbox_id, encode(theirs), forged)
    # Then carol's commands are answered all along, and mallory's is refused invalid
    wait_for(lambda: len(seen) >= 10, timeout_s=60, what="carol's commands answered")
    stop.set()
    busy.join(timeout=30)
    refused = _refusal(db, "tenant = 'mallory' AND payload->>'request_id' = :r",
                       "mallory's refusal", r=str(renew.request_id))  # fmt: skip
    assert refused["reason"] == "invalid"
    assert max(seen) < 5.0


# --- 2 and 3. what a request must carry -----------------------------------------------


def test_a_naive_sent_at_is_refused_and_the_batch_goes_on(
    stack: Settings, mallory: Client, carol: Client, box: Sandbox, db: Any
) -> None:
    with mallory.create(memory_mb=64, ttl_s=120) as own:
        body = json.loads(encode(exec_request(mallory.request_fields(own.id), "true", timeout_s=5)))
        body["sent_at"] = utcnow().replace(tzinfo=None).isoformat()
        raw = json.dumps(body).encode()
        # carol's command and mallory's naive one in the same moment
        _send(stack, own.id, raw, _signed(mallory, raw))
        assert box.exec("echo after").stdout == b"after\n"
    refused = _refusal(db, "payload->>'request_id' = :r", "the naive request's refusal",
                       r=body["request_id"])  # fmt: skip
    assert refused["reason"] == "invalid" and "timezone" in refused["detail"]


def test_the_same_bytes_without_id_and_time_never_run(
    stack: Settings, mallory: Client, db: Any
) -> None:
    with mallory.create(memory_mb=64, ttl_s=120) as own:
        marker = uuid.uuid4().hex
        bare = {"type": "Exec", "sandbox_id": own.id, "command": f"echo {marker} >> /workspace/n"}
        raw = json.dumps(bare).encode()
        for _ in range(3):
            _send(stack, own.id, raw, _signed(mallory, raw))
        assert own.exec("cat /workspace/n 2>/dev/null; true").stdout == b""


def test_an_upper_case_request_id_is_refused(stack: Settings, mallory: Client, db: Any) -> None:
    with mallory.create(memory_mb=64, ttl_s=120) as own:
        body = json.loads(encode(exec_request(mallory.request_fields(own.id), "true", timeout_s=5)))
        body["request_id"] = body["request_id"].upper()
        raw = json.dumps(body).encode()
        _send(stack, own.id, raw, _signed(mallory, raw))
        _refusal(db, "tenant = 'mallory' AND payload->>'detail' LIKE '%canonical form%'",
                 "the refusal of an upper-case request id")  # fmt: skip


# --- 4 and 5. nothing unproven settles a proven request, or hides who tried ------------


def test_an_altered_copy_does_not_settle_the_victims_running_command(
    stack: Settings, carol: Client, box: Sandbox
) -> None:
    # Given carol's command running, and its record captured off the bus (on the
    # node's inbox, where the SDK sends it straight)
    consumer = bus.make_consumer(stack)
    parts = bus.partitions(consumer, stack.topic_requests)
    parts += bus.partitions(consumer, stack.node_topic(box.node_id))
    consumer.assign(parts)
    for tp, end in bus.high_watermarks(stack, parts).items():
        consumer.seek(tp, end)
    running = box.start("sleep 4; echo done", timeout_s=60)
    captured = None
    for _ in range(100):
        for records in consumer.poll(timeout_ms=100).values():
            for one in records:
                if str(running.id).encode() in (one.value or b""):
                    captured = one
        if captured is not None:
            break
    consumer.close()
    assert captured is not None
    # When an outsider sends it altered, and a record with only its key id and request
    # id, under carol's key id
    body = json.loads(captured.value)
    altered = json.dumps({**body, "command": "rm -rf /workspace"}).encode()
    bare = json.dumps({"request_id": body["request_id"], "reply_to": body["reply_to"]}).encode()
    for value in (altered, bare):
        _send(stack, box.id, value, list(captured.headers), captured.topic)
    # Then carol's command finishes as it would have: nothing answered it before
    result = running.wait(timeout_s=30)
    assert result.ok and result.stdout == b"done\n"


def test_a_forbidden_attempt_is_attributed_whatever_came_first(
    stack: Settings, mallory: Client, box: Sandbox, db: Any
) -> None:
    # Given an unauthenticated record with the request id mallory will use, sent first
    attempt = DestroySandbox(**mallory.request_fields(box.id))
    _send(stack, box.id, encode(attempt), [])
    # When mallory tries to destroy carol's sandbox under that id
    with pytest.raises(SandboxNotFound):
        mallory.call(attempt, timeout_s=20)
    # Then the audit names mallory
    runner = CliRunner()
    rows = wait_for(
        lambda: [
            r
            for r in json.loads(
                runner.invoke(cli, ["audit", "--denied", "--sandbox", box.id, "--json"]).stdout
            )
            if (r["actor"] or "").startswith("mallory/")
        ],
        what="mallory's attempt in dsec audit --denied",
    )
    assert rows[0]["outcome"] == "forbidden"


# --- 7. a copy on another partition -------------------------------------------------


def test_a_renewal_copied_onto_another_partition_is_not_acted_on(
    stack: Settings, carol: Client, db: Any
) -> None:
    # Given carol's renewal of a new lease, answered
    since = utcnow()
    lease = f"lease-{uuid.uuid4().hex[:8]}"
    renew = RenewLease(**carol.request_fields(lease))
    carol.call(renew, timeout_s=20)
    # When its signed bytes are written again onto another partition than its key's
    # (another scheduler's, with several)
    raw = encode(renew)
    consumer = bus.make_consumer(stack)
    count = len(bus.partitions(consumer, stack.topic_requests))
    consumer.close()
    elsewhere = (key_partition(lease, count) + 1) % count
    publisher = bus.Publisher(stack)
    try:
        publisher.publish(stack.topic_requests, lease, raw, partition=elsewhere, wait=True,
                          headers=_signed(carol, raw))  # fmt: skip
    finally:
        publisher.close()
    # Then it is refused invalid (logged as a sample under carol's key), not acted on
    where = "tenant = 'carol' AND payload->>'detail' LIKE '%murmur2%' AND occurred_at >= :s"
    refused = _refusal(db, where, "the misplaced copy's refusal (a sample)", s=since)
    assert refused["reason"] == "invalid" and refused["folded"] >= 1


# --- 9. quotas --------------------------------------------------------------------------


def test_leases_past_the_quota_are_refused_and_the_cli_sets_it(
    stack: Settings, mallory: Client
) -> None:
    runner = CliRunner()
    assert runner.invoke(cli, ["tenant", "quota", "mallory", "--leases", "3"]).exit_code == 0
    try:
        shown = json.loads(runner.invoke(cli, ["tenant", "quota", "mallory", "--json"]).stdout)
        assert {"resource": "leases", "limit": 3, "from": "tenant"} in shown
        time.sleep(6)  # every scheduler reads them within 5 s
        refused = []
        for i in range(6):
            renew = RenewLease(**mallory.request_fields(f"lease-q{i}-{uuid.uuid4().hex[:6]}"))
            try:
                mallory.call(renew, timeout_s=20)
            except SandboxRejectedError as exc:
                refused.append(exc)
        assert len(refused) >= 3 and {e.reason for e in refused} == {"quota"}
        assert "its quota is 3" in refused[0].detail
    finally:
        runner.invoke(cli, ["tenant", "quota", "mallory", "--leases", "default"])


# --- 10. junk is sampled ------------------------------------------------------------------


def test_made_up_keys_make_samples_not_rows(stack: Settings, db: Any) -> None:
    since = utcnow()
    publisher = bus.Publisher(stack)
    try:
        for i in range(2000):
            value = encode(CreateSandbox(sandbox_id=f"sb-junk-{i}"))
            mac = os.urandom(32).hex().encode()
            forged = [("dsec-key", f"k-madeup-{i:06d}".encode()), ("dsec-mac", mac)]
            publisher.publish(stack.topic_requests, f"sb-junk-{i}", value, headers=forged)
        publisher.flush()
    finally:
        publisher.close()
    refused = (
        "FROM events WHERE type = 'SandboxRejected' AND tenant = 'unauthenticated'"
        " AND occurred_at >= :s"
    )
    with db() as conn:
        wait_for(
            lambda: scalar(conn, f"SELECT coalesce(sum((payload->>'folded')::int), 0) {refused}",
                           s=since) >= 2000,
            timeout_s=60,
            what="2,000 refusals folded into samples",
        )  # fmt: skip
        rows = scalar(conn, f"SELECT count(*) {refused}", s=since)
    assert rows <= 20  # a few windows' samples, not 2,000 rows


# --- 12. nothing about others' sandboxes ---------------------------------------------------


def test_not_found_and_not_yours_are_one_answer(
    stack: Settings, mallory: Client, box: Sandbox
) -> None:
    answers = set()
    for sandbox_id in (box.id, f"sb-never-{uuid.uuid4().hex[:8]}"):
        with pytest.raises(SandboxNotFound) as refused:
            mallory.sandbox(sandbox_id).exec("id")
        answers.add((refused.value.reason, refused.value.detail.replace(sandbox_id, "<id>")))
    assert answers == {("unknown_sandbox", "mallory has no live sandbox <id>")}


def test_a_taken_id_says_nothing_of_its_owner(mallory: Client, box: Sandbox) -> None:
    with pytest.raises(SandboxIdInUse) as refused:
        mallory.call(CreateSandbox(**mallory.request_fields(box.id), memory_mb=64), timeout_s=20)
    assert "carol" not in refused.value.detail and refused.value.reason == "id_in_use"


def _stdout(reply: Any) -> str:
    return base64.b64decode(reply.stdout_b64).decode()


def test_another_tenants_equal_request_id_runs_as_its_own_command(
    stack: Settings, carol: Client, mallory: Client, box: Sandbox, db: Any
) -> None:
    # Given carol's command under a request id (ids are the sender's to choose)
    chosen = uuid.uuid4()
    theirs = exec_request(carol.request_fields(box.id), "echo carol", timeout_s=30)
    assert _stdout(carol.call(theirs.model_copy(update={"request_id": chosen}), 60)) == "carol\n"
    # When mallory sends a command of its own on the same node under the same id
    with mallory.create(memory_mb=64, timeout_s=60) as own:
        mine = exec_request(mallory.request_fields(own.id), "echo mallory", timeout_s=30)
        answer = mallory.call(mine.model_copy(update={"request_id": chosen}), 60)
        # Then it runs and is answered as mallory's (not skipped as carol's, already run)
        assert _stdout(answer) == "mallory\n"
    # And the log keeps both commands, each its sender's
    query = (
        "SELECT tenant FROM events WHERE type = 'CommandCompleted'"
        " AND payload->>'request_id' = :r ORDER BY tenant"
    )

    def logged() -> list[str]:
        with db() as conn:
            return [r[0] for r in conn.execute(text(query), {"r": str(chosen)})]

    tenants = wait_for(lambda: len(found := logged()) == 2 and found, 30, "both commands")
    assert tenants == sorted([carol.tenant, mallory.tenant])
