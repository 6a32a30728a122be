"""docs/protocol.md's worked signing example is what the platform computes, byte for
byte, and the platform accepts the request it signs."""

from __future__ import annotations

import re
import uuid
from pathlib import Path

from app.domain.codec import decode_reply, decode_request
from app.domain.proof import Purpose, check_mac, mac, reply_key, sandbox_key

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


def _example() -> dict[str, str]:
    text = DOC.read_text()
    block = re.search(r"```text\n(key id:.*?)```", text, re.S)
    assert block, "the worked example is missing from docs/protocol.md"
    fields = {}
    for line in block.group(1).splitlines():
        name, _, value = line.partition(":")
        fields[name.strip()] = value.strip()
    return fields


def test_the_worked_example_is_what_the_platform_computes() -> None:
    ex = _example()
    key = bytes.fromhex(ex["key"])
    request = ex["request"].encode()
    assert ex["dsec-key"] == ex["key id"]
    assert mac(key, Purpose.REQUEST, request) == ex["dsec-mac"]
    parsed = decode_request(request)
    rk = reply_key(key, parsed.request_id)
    assert rk.hex() == ex["reply key"]
    reply = ex["reply"].encode()
    assert decode_reply(reply).request_id == parsed.request_id
    assert check_mac(rk, Purpose.REPLY, reply, ex["reply mac"])


def test_the_direct_route_example_is_what_the_platform_computes() -> None:
    ex = _example()
    block = re.search(r"```text\n(sandbox key:.*?)```", DOC.read_text(), re.S)
    assert block, "the direct route's example is missing from docs/protocol.md"
    direct = dict(
        (name.strip(), value.strip())
        for name, _, value in (line.partition(":") for line in block.group(1).splitlines())
    )
    request = ex["request"].encode()
    parsed = decode_request(request)
    key = sandbox_key(bytes.fromhex(ex["key"]), parsed.sandbox_id)
    assert key.hex() == direct["sandbox key"]
    assert mac(key, Purpose.DIRECT, request) == direct["direct mac"]
    rk = reply_key(key, parsed.request_id)
    assert rk.hex() == direct["reply key"]
    assert check_mac(rk, Purpose.REPLY, ex["reply"].encode(), direct["reply mac"])


def test_the_doc_python_snippet_agrees() -> None:
    ex = _example()
    snippet = re.search(r"```python\n(import hashlib.*?)```", DOC.read_text(), re.S)
    assert snippet
    scope: dict[str, object] = {}
    exec(snippet.group(1), scope)
    key, request = bytes.fromhex(ex["key"]), ex["request"].encode()
    made = scope["request_headers"](ex["key id"], key, request)  # type: ignore[operator]
    assert made == [("dsec-key", ex["key id"].encode()), ("dsec-mac", ex["dsec-mac"].encode())]
    rid = uuid.UUID("6f1c2a50-8d2e-4b7a-9c1e-2f3a4b5c6d7e")
    proven = scope["reply_is_proven"]  # type: ignore[assignment]
    assert proven(key, rid, ex["reply"].encode(), ex["reply mac"].encode())  # type: ignore[operator]


def _named_in_doc() -> set[str]:
    """Every word the doc sets in backticks outside its code blocks."""
    prose = re.sub(r"```.*?```", "", DOC.read_text(), flags=re.S)
    return {
        word for quoted in re.findall(r"`([^`]+)`", prose) for word in re.findall(r"[\w.]+", quoted)
    }


def test_the_doc_names_every_request_event_reply_and_reason() -> None:
    from app.domain import base
    from app.domain.codec import DeadLetterReason
    from app.domain.events import EVENT_TYPES
    from app.domain.replies import REPLY_KINDS
    from app.domain.requests import REQUEST_TYPES

    reasons = [base.RejectReason, base.FailReason, base.StopReason, DeadLetterReason]
    wanted = {*REQUEST_TYPES, *EVENT_TYPES, *REPLY_KINDS} | {r.value for e in reasons for r in e}
    assert wanted - _named_in_doc() == set()
