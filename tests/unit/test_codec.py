"""Decoding refuses bad bytes with a named reason (no services needed)."""

from __future__ import annotations

import json

import pytest

from app.domain.codec import (
    DeadLetterReason,
    DecodeError,
    decode_event,
    decode_reply,
    decode_request,
    encode,
    peek,
)
from app.domain.events import SandboxStopped, StoppedPayload
from app.domain.replies import ExecOutput
from app.domain.requests import CreateSandbox, Exec


def test_event_round_trip() -> None:
    event = SandboxStopped(sandbox_id="sb-1", payload=StoppedPayload(reason="oom"))
    assert decode_event(encode(event)) == event


def test_request_round_trip_keeps_type() -> None:
    request = Exec(sandbox_id="sb-1", tenant="t", command=["echo", "hi"])
    decoded = decode_request(encode(request))
    assert isinstance(decoded, Exec)
    assert decoded == request


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"{not json", DeadLetterReason.MALFORMED_JSON),
        (b"\xff\xfe", DeadLetterReason.MALFORMED_JSON),
        (b"[1, 2]", DeadLetterReason.NOT_AN_OBJECT),
        (b'{"type": "Teleport"}', DeadLetterReason.UNKNOWN_TYPE),
        (
            json.dumps({"type": "Exec", "version": 99}).encode(),
            DeadLetterReason.UNSUPPORTED_VERSION,
        ),
        (json.dumps({"type": "Exec", "sandbox_id": "sb-1"}).encode(), DeadLetterReason.INVALID),
        (b"x" * 2000, DeadLetterReason.TOO_LARGE),
        # hostile, not just wrong: none of these may raise anything but DecodeError
        (b"[" * 999, DeadLetterReason.TOO_DEEP),
        (b'{"a":' * 199, DeadLetterReason.TOO_DEEP),
        (b'{"type": "Exec", "command": "\\ud800"}', DeadLetterReason.MALFORMED_JSON),
        (b'{"type": "Exec", "version": ' + b"9" * 900 + b"}", DeadLetterReason.UNSUPPORTED_VERSION),
        (b'{"type": ["Exec"]}', DeadLetterReason.UNKNOWN_TYPE),
        (b'{"type": {"Exec": 1}}', DeadLetterReason.UNKNOWN_TYPE),
        (
            b'{"type": "Exec", "sandbox_id": "sb-1", "command": "a\\u0000"}',
            DeadLetterReason.INVALID,
        ),
        (
            # NaN is no JSON (Postgres' jsonb refuses it too): refused while parsing
            b'{"type": "Exec", "sandbox_id": "sb-1", "command": "x", "timeout_s": NaN}',
            DeadLetterReason.MALFORMED_JSON,
        ),
    ],
)
def test_bad_requests_are_refused_with_reason(raw: bytes, reason: DeadLetterReason) -> None:
    with pytest.raises(DecodeError) as info:
        decode_request(raw, max_bytes=1000)
    assert info.value.reason == reason


def test_unknown_fields_are_refused() -> None:
    body = json.loads(encode(CreateSandbox(sandbox_id="sb-1", tenant="t")))
    body["privileged"] = True
    with pytest.raises(DecodeError) as info:
        decode_request(json.dumps(body).encode())
    assert info.value.reason == DeadLetterReason.INVALID
    assert "privileged" in info.value.detail


def test_impossible_resources_are_invalid() -> None:
    body = json.loads(encode(CreateSandbox(sandbox_id="sb-1", tenant="t")))
    body["cpus"] = -2
    with pytest.raises(DecodeError) as info:
        decode_request(json.dumps(body).encode())
    assert "cpus" in info.value.detail


def test_replies_are_read_tolerantly_but_still_validated() -> None:
    reply = ExecOutput(
        request_id="6f1c0000-0000-4000-8000-000000000000", sandbox_id="sb-1", exit_code=0,
        stdout_b64="", stderr_b64="", duration_ms=1.0,
    )  # fmt: skip
    body = json.loads(encode(reply))
    # A newer platform's extra field does not break an older SDK
    body["cpu_ms"] = 3.5
    assert decode_reply(json.dumps(body).encode()) == reply
    # but a known field with a wrong value is still refused
    body["exit_code"] = "zero"
    with pytest.raises(DecodeError) as info:
        decode_reply(json.dumps(body).encode())
    assert info.value.reason == DeadLetterReason.INVALID


@pytest.mark.parametrize(
    "raw", [b"", b"\xff", b"[" * 100_000, b'{"a":' * 100_000, b'{"a": "\\ud800"}', b"[1]"]
)
def test_peek_never_raises(raw: bytes) -> None:
    assert peek(raw) == {}
    assert peek(b'{"request_id": "x", "deep": ' + b"[" * 10 + b"]" * 10 + b"}")["request_id"] == "x"
