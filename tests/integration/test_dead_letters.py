"""Every kind of bad event goes to the dead-letter topic with its reason and bytes,
the projector carries on, and its counter moves."""

from __future__ import annotations

import base64
import json
import uuid
from typing import Any

import pytest
from kafka import TopicPartition
from typer.testing import CliRunner

from app import bus, metrics
from app.cli.main import cli
from app.config import Settings
from app.control import dead_letters
from app.control.keyring import Keyring
from app.domain.dead_letter import DeadLetter
from app.domain.events import NodeLost, NodeLostPayload
from app.domain.proof import Purpose, headers
from tests.conftest import PlatformPublisher, scalar, wait_for

pytestmark = pytest.mark.integration

runner = CliRunner()


def dead_letter_count(settings: Settings, reason: str) -> float:
    """The projector's counter for ``reason``, read from its /metrics endpoint."""
    url = f"http://127.0.0.1:{settings.metrics_port}/metrics"
    found = metrics.sample(
        metrics.scrape(url), "dsec_dead_letters_total", consumer="projector", reason=reason
    )
    return found or 0.0


def _valid_event() -> NodeLost:
    return NodeLost(node_id=f"dl-{uuid.uuid4().hex[:8]}", payload=NodeLostPayload(detail="x"))


def _version_99() -> bytes:
    body = json.loads(_valid_event().model_dump_json())
    body["version"] = 99
    return json.dumps(body).encode()


def _too_large(settings: Settings) -> bytes:
    body = json.loads(_valid_event().model_dump_json())
    body["payload"]["detail"] = "x" * (settings.max_message_bytes + 1000)
    return json.dumps(body).encode()


def _nul_character() -> bytes:
    # Valid JSON and a valid event, but Postgres' jsonb cannot store U+0000.
    return (
        NodeLost(node_id=f"dl-{uuid.uuid4().hex[:8]}", payload=NodeLostPayload(detail="a\x00b"))
        .model_dump_json()
        .encode()
    )


CASES = {
    "unstorable": lambda s: _nul_character(),
    "malformed_json": lambda s: b'{"type": "NodeLost", ',
    "unknown_type": lambda s: json.dumps({"type": "SandboxTeleported", "version": 1}).encode(),
    "unsupported_version": lambda s: _version_99(),
    "too_large": _too_large,
}


@pytest.mark.parametrize("reason", sorted(CASES))
def test_bad_event_is_dead_lettered_with_reason(stack: Settings, db: Any, reason: str) -> None:
    bad = CASES[reason](stack)
    before = dead_letter_count(stack, reason)
    consumer = bus.make_consumer(stack)
    tp = TopicPartition(stack.topic_dead_letters, 0)
    consumer.assign([tp])
    consumer.seek_to_end(tp)
    consumer.position(tp)
    # When a bad event and then a good one are published
    publisher = PlatformPublisher(stack)
    key = f"dl-{uuid.uuid4().hex[:8]}"
    publisher.publish(stack.topic_events, key, bad, wait=True)
    good = _valid_event()
    publisher.publish(stack.topic_events, good.key, good, wait=True)
    publisher.close()
    # Then the dead-letter topic has the bad one, with its reason and original bytes
    letters: list[dict[str, Any]] = []
    for _ in range(100):
        for records in consumer.poll(timeout_ms=100).values():
            letters.extend(json.loads(r.value) for r in records)
        if any(d["key"] == key for d in letters):
            break
    consumer.close()
    ours = [d for d in letters if d["key"] == key]
    assert ours, f"no dead letter for {reason}"
    letter = ours[0]
    assert letter["reason"] == reason
    assert letter["consumer"] == "projector"
    assert letter["original_size"] == len(bad)
    kept = base64.b64decode(letter["original_b64"])
    assert bad.startswith(kept) and (letter["original_truncated"] or kept == bad)
    # And the projector carried on: the good event after it is in the log
    with db() as conn:
        wait_for(
            lambda: scalar(
                conn, "SELECT count(*) FROM events WHERE event_id = :e", e=good.event_id
            ),
            what="the good event after the bad one",
        )
    # And the counter moved
    assert dead_letter_count(stack, reason) >= before + 1


def _letter(settings: Settings, refused_by: str, original: bytes, **extra: Any) -> DeadLetter:
    """A letter as an older projector would have written it, with the record's proof."""
    signer = Keyring.from_settings(settings).scheduler
    proof = headers(Purpose.EVENT, signer.principal.key_id, signer.secret, original)
    return DeadLetter(
        headers=[(name, base64.b64encode(value).decode()) for name, value in proof],
        consumer=refused_by,
        topic=settings.topic_events,
        partition=0,
        offset=0,
        reason="unsupported_version",
        detail="version 1 not supported",
        original_b64=base64.b64encode(original).decode(),
        original_size=len(original),
        key="replayed",
        **extra,
    )


def test_a_letter_whose_cause_is_gone_replays_into_the_log_once(stack: Settings, db: Any) -> None:
    # Given letters from a projector that could not read events this one can, one of
    # them with only the first bytes of a huge message
    refused_by = f"old-projector-{uuid.uuid4().hex[:8]}"
    event = _valid_event()
    raw = event.model_dump_json().encode()
    publisher = PlatformPublisher(stack)
    publisher.publish(stack.topic_dead_letters, "k", _letter(stack, refused_by, raw), partition=0)
    cut = _letter(stack, refused_by, raw[:10], original_truncated=True)
    publisher.publish(stack.topic_dead_letters, "k", cut, partition=0, wait=True)
    publisher.close()
    # When an operator lists and replays what that consumer refused
    listed = runner.invoke(cli, ["deadletters", "ls", "--consumer", refused_by, "--json"])
    assert listed.exit_code == 0, listed.output
    rows = json.loads(listed.stdout)
    assert [r["replayable"] for r in rows] == [True, False]
    assert {r["reason"] for r in rows} == {"unsupported_version"}
    mine = dead_letters.LetterFilter(consumer=refused_by)
    # Then the whole one is sent to its topic and lands in the log; the cut one is not
    outcome = dead_letters.replay(stack, dead_letters.read(stack, mine))
    assert (outcome.sent, outcome.truncated) == (1, 1)
    # And replaying again (a second operator, a retry) leaves one copy in the log
    again = runner.invoke(cli, ["deadletters", "replay", "--consumer", refused_by, "--json"])
    assert json.loads(again.stdout) == {"sent": 1, "truncated": 1}
    # (a marker published after both replays: once it is in, both were consumed)
    marker = _valid_event()
    publisher = PlatformPublisher(stack)
    publisher.publish(stack.topic_events, "replayed", marker, wait=True)  # same partition
    publisher.close()
    count = "SELECT count(*) FROM events WHERE event_id = :e"
    with db() as conn:
        wait_for(lambda: scalar(conn, count, e=marker.event_id), what="the marker in the log")
        assert scalar(conn, count, e=event.event_id) == 1
