"""Every kind of bad event goes to the dead-letter topic with its reason and bytes,
the projector carries on, and its counter moves."""

from __future__ import annotations

import base64
import json
import re
import urllib.request
import uuid
from typing import Any

import pytest
from kafka import TopicPartition

from app import bus
from app.config import Settings
from app.domain.events import NodeLost, NodeLostPayload
from tests.conftest import scalar, wait_for

pytestmark = pytest.mark.integration


def dead_letter_count(settings: Settings, reason: str) -> float:
    """The projector's counter for ``reason``, read from its /metrics endpoint."""
    url = f"http://127.0.0.1:{settings.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    pattern = rf'dsec_dead_letters_total{{consumer="projector",reason="{reason}"}} ([0-9.e+]+)'
    match = re.search(pattern, text)
    return float(match.group(1)) if match else 0.0


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
    publisher = bus.Publisher(stack)
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
