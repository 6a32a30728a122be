"""Bad input gets a clear error and nothing is lost; no consumer dies of it."""

from __future__ import annotations

import base64
import json
import uuid
from typing import Any

import pytest
from kafka import TopicPartition

from app import bus
from app.config import Settings
from app.control.keyring import Keyring
from app.domain.codec import encode
from app.domain.proof import Purpose, headers
from app.domain.requests import CreateSandbox, Exec, WriteFile
from app.errors import SandboxRejectedError
from tests.conftest import ensure_tenant, scalar, wait_for

pytestmark = pytest.mark.integration


def _dead_letters_after(settings: Settings, send: Any, original: bytes) -> list[dict[str, Any]]:
    """The letters that keep ``original``, among those written after ``send()``."""
    consumer = bus.make_consumer(settings)
    tp = TopicPartition(settings.topic_dead_letters, 0)
    consumer.assign([tp])
    # From the true end: the broker's end_offsets answer can be a few letters short.
    consumer.seek(tp, bus.high_watermarks(settings, [tp])[tp])
    send()
    ours: list[dict[str, Any]] = []
    for _ in range(50):
        for records in consumer.poll(timeout_ms=200).values():
            letters = [json.loads(r.value) for r in records]
            ours.extend(d for d in letters if base64.b64decode(d["original_b64"]) == original)
        if ours:
            break
    consumer.close()
    return ours


def _signed(settings: Settings, value: bytes) -> list[tuple[str, bytes]]:
    """The proof tenant "tests" gives a request: its bytes are garbage, its sender real."""
    cred = ensure_tenant(settings, "tests")
    return headers(Purpose.REQUEST, cred.key_id, cred.secret, value)


def test_malformed_request_goes_to_dead_letters(stack: Settings) -> None:
    publisher = bus.Publisher(stack)
    garbage = b"{this is not json"
    proof = _signed(stack, garbage)
    ours = _dead_letters_after(
        stack,
        lambda: publisher.publish(
            stack.topic_requests, "sb-garbage", garbage, wait=True, headers=proof
        ),
        garbage,
    )
    publisher.close()
    assert ours and ours[0]["reason"] == "malformed_json" and ours[0]["consumer"] == "scheduler"


def test_unsigned_request_goes_to_dead_letters(stack: Settings) -> None:
    publisher = bus.Publisher(stack)
    unsigned = encode(CreateSandbox(sandbox_id=f"sb-nosig-{uuid.uuid4().hex[:8]}"))
    ours = _dead_letters_after(
        stack,
        lambda: publisher.publish(stack.topic_requests, "sb-nosig", unsigned, wait=True),
        unsigned,
    )
    publisher.close()
    assert ours and ours[0]["reason"] == "unauthenticated"


def test_malformed_event_goes_to_dead_letters(stack: Settings) -> None:
    publisher = bus.Publisher(stack)
    garbage = json.dumps({"type": "SandboxExploded", "version": 1}).encode()
    proof = _platform_proof(stack, garbage)
    ours = _dead_letters_after(
        stack,
        lambda: publisher.publish(stack.topic_events, "x", garbage, wait=True, headers=proof),
        garbage,
    )
    publisher.close()
    assert ours and ours[0]["reason"] == "unknown_type" and ours[0]["consumer"] == "projector"


def _platform_proof(settings: Settings, value: bytes) -> list[tuple[str, bytes]]:
    info = Keyring.from_settings(settings).scheduler
    return headers(Purpose.EVENT, info.principal.key_id, info.secret, value)


def test_invalid_request_is_rejected_then_next_request_works(
    stack: Settings, client: Any, db: Any
) -> None:
    # Given a create asking for an impossible amount of CPU, sent by a raw Kafka client
    request = CreateSandbox(sandbox_id=f"sb-bad-{uuid.uuid4().hex[:8]}")
    body = json.loads(encode(request))
    body["cpus"] = -4
    raw = json.dumps(body).encode()
    publisher = bus.Publisher(stack)
    publisher.publish(
        stack.topic_requests, request.sandbox_id, raw, wait=True, headers=_signed(stack, raw)
    )
    publisher.close()
    # Then a Rejected event says why
    with db() as conn:
        detail = wait_for(
            lambda: scalar(
                conn,
                "SELECT payload->>'detail' FROM events"
                " WHERE sandbox_id = :s AND type = 'SandboxRejected'",
                s=request.sandbox_id,
            ),
            what="SandboxRejected in the log",
        )
    assert "cpus" in detail
    # And the next good request still works
    with client.create() as sandbox:
        assert sandbox.exec("echo ok").stdout == b"ok\n"


@pytest.mark.parametrize(
    ("kind", "fields", "named"),
    [
        (WriteFile, {"path": "/workspace/x", "data_b64": "not base64!"}, "data_b64"),
        (Exec, {"command": ["echo", "x" * (200 << 10)]}, "command"),
        (Exec, {"command": "true", "env": {"A=B": "x"}}, "env"),
        (Exec, {"command": "true", "stdin_b64": "%%%"}, "stdin_b64"),
    ],
    ids=["write-bad-base64", "command-too-large", "env-name-with-equals", "stdin-bad-base64"],
)
def test_an_impossible_request_is_answered_and_logged_never_dropped(
    client: Any, db: Any, kind: Any, fields: dict[str, Any], named: str
) -> None:
    # Given a sandbox, and a request the models would refuse, signed and sent as is
    with client.create() as box:
        bad = kind.model_construct(**client.request_fields(box.id), **fields)
        # Then its sender hears why, at once (not after a 60 s timeout)
        with pytest.raises(SandboxRejectedError) as refused:
            client.wait(bad, client.send(bad), 30)
        assert refused.value.reason == "invalid" and named in str(refused.value)
        # and the log says so
        with db() as conn:
            wait_for(
                lambda: scalar(
                    conn,
                    "SELECT count(*) FROM events WHERE type = 'SandboxRejected'"
                    " AND payload->>'request_id' = :r",
                    r=str(bad.request_id),
                ),
                what="the refusal in the log",
            )
        # and the sandbox still serves its trainer
        assert box.exec("echo ok").stdout == b"ok\n"


def test_a_sandbox_id_lives_once(client: Any, db: Any) -> None:
    # Given a sandbox
    box = client.create()
    # When its id is asked for again while it runs, then after it ended
    with pytest.raises(SandboxRejectedError) as in_use:
        client.call(CreateSandbox(**client.request_fields(box.id)), timeout_s=30)
    box.close()
    with pytest.raises(SandboxRejectedError) as ended:
        client.call(CreateSandbox(**client.request_fields(box.id)), timeout_s=30)
    # Then both are refused at once with the reason (the same words: ids are never
    # reused, and nothing says how it ended), and the log holds one life
    assert in_use.value.reason == ended.value.reason == "id_in_use"
    assert in_use.value.detail == ended.value.detail
    assert "is taken" in str(in_use.value)
    with db() as conn:
        wait_for(
            lambda: scalar(
                conn, "SELECT ended_at FROM sandbox_lives WHERE sandbox_id = :s", s=box.id
            ),
            what="the life's end",
        )
        lives = scalar(conn, "SELECT count(*) FROM sandbox_lives WHERE sandbox_id = :s", s=box.id)
        started = scalar(
            conn,
            "SELECT count(*) FROM events WHERE sandbox_id = :s AND type = 'SandboxStarted'",
            s=box.id,
        )
    assert (lives, started) == (1, 1)


def test_a_deeply_nested_event_is_a_dead_letter_and_the_log_goes_on(
    stack: Settings, client: Any
) -> None:
    # Given a proven event nested 100,000 deep (it used to stop the projector for good)
    publisher = bus.Publisher(stack)
    deep = b'{"type": "SandboxStopped", "payload": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    proof = _platform_proof(stack, deep)
    ours = _dead_letters_after(
        stack,
        lambda: publisher.publish(stack.topic_events, "x", deep, wait=True, headers=proof),
        deep,
    )
    publisher.close()
    # Then the projector and the scheduler each set it aside with the reason
    assert {(d["consumer"], d["reason"]) for d in ours} >= {("projector", "too_deep")}
    # And the log goes on: a sandbox's life after it is recorded
    with client.create() as box:
        assert box.exec("echo after").stdout == b"after\n"


def test_bad_requests_in_a_batch_cost_the_good_ones_nothing(client: Any) -> None:
    # Given a batch where every other request is hostile: nested JSON, a reply
    # partition beyond the topic, a NUL in a trajectory id (all from a real tenant)
    sandbox_ids = [f"sb-batch-{uuid.uuid4().hex[:10]}" for _ in range(3)]
    good = [CreateSandbox(**client.request_fields(s), memory_mb=32) for s in sandbox_ids]
    futures = []
    hostile = [
        b"[" * 50_000 + b"]" * 50_000,
        json.dumps(
            {
                **json.loads(encode(good[0])),
                "request_id": str(uuid.uuid4()),
                "sandbox_id": "sb-hostile-1",
                "reply_to": {"topic": client._reply_to.topic, "partition": 60_000},
            }
        ).encode(),
        json.dumps(
            {
                "type": "Exec",
                "sandbox_id": "sb-hostile-2",
                "command": "true",
                "trajectory_id": "t\x00",
                "step": 0,
            }
        ).encode(),
    ]
    publisher = bus.Publisher(client.settings)
    cred = client.credential
    for request, bad in zip(good, hostile, strict=True):
        futures.append(client.send(request))
        proof = headers(Purpose.REQUEST, cred.key_id, cred.secret, bad)
        publisher.publish(client.settings.topic_requests, "sb-hostile", bad, headers=proof)
    publisher.flush()
    publisher.close()
    # Then every good request is answered: its sandbox runs
    boxes = [client.sandbox(s) for s in sandbox_ids]
    try:
        for request, future in zip(good, futures, strict=True):
            client.wait(request, future, 60)
        for box in boxes:
            assert box.exec("echo ok").stdout == b"ok\n"
    finally:
        for box in boxes:
            box.close()


def test_a_request_of_many_arrays_is_too_complex_and_costs_the_next_nothing(
    stack: Settings, client: Any
) -> None:
    # Given a tenant's signed Exec whose command is 150,000 empty arrays (refusing one
    # such record took the scheduler, which serves every tenant, seconds of CPU)
    body = json.loads(encode(Exec(sandbox_id="sb-complex", tenant="tests", command="x")))
    raw = json.dumps(body | {"command": [[]] * 150_000}, separators=(",", ":")).encode()
    publisher = bus.Publisher(stack)
    ours = _dead_letters_after(
        stack,
        lambda: publisher.publish(
            stack.topic_requests, "sb-complex", raw, wait=True, headers=_signed(stack, raw)
        ),
        raw,
    )
    publisher.close()
    # Then the scheduler sets it aside, saying why, before parsing it
    assert [(d["consumer"], d["reason"]) for d in ours] == [("scheduler", "too_complex")]
    # And the next tenant's command is answered as usual
    with client.create() as box:
        assert box.exec("echo next").stdout == b"next\n"
