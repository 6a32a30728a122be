"""Whatever bytes arrive, a decoder returns a message or raises DecodeError (no services).

One message that makes a decoder raise anything else stops the consumer reading it,
so these feed the decoders hostile bytes: random ones, random JSON, deep nesting,
NUL, lone surrogates and invalid UTF-8 in every text field of valid messages, extreme
numbers and huge arrays.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from app.domain.base import StopReason
from app.domain.codec import (
    MAX_CONTAINERS,
    MAX_DEPTH,
    DeadLetterReason,
    DecodeError,
    decode_event,
    decode_reply,
    decode_request,
    encode,
    peek,
)
from app.domain.events import (
    CommandCompleted,
    CommandPayload,
    LastState,
    NodeHeartbeat,
    NodePayload,
    RequestedPayload,
    SandboxRequested,
    SandboxStopped,
    StoppedPayload,
)
from app.domain.replies import ErrorReply, ExecOutput
from app.domain.requests import CreateSandbox, Exec, ReplyTo, WriteFile

Decoder = Callable[[bytes], Any]
DECODERS: list[Decoder] = [decode_event, decode_request, decode_reply]
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_ID = uuid.UUID("6f1c0000-0000-4000-8000-000000000000")
_AT = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
VALID: list[BaseModel] = [
    Exec(
        sandbox_id="sb-1", tenant="t", job_id="j", command=["echo", "hi"], env={"K": "v"},
        cwd="/workspace", trajectory_id="traj", step=3, sent_at=_AT,
        reply_to=ReplyTo(topic="dsec.replies.t", partition=1),
    ),
    CreateSandbox(sandbox_id="sb-2", tenant="t", labels={"a": "b"}, env={"X": "y"}, sent_at=_AT),
    WriteFile(sandbox_id="sb-3", path="/workspace/f", data_b64="aGkK", sent_at=_AT),
    SandboxRequested(
        sandbox_id="sb-1", tenant="t", occurred_at=_AT,
        payload=RequestedPayload(
            request_id=_ID, actor="t/k", image="img", cpus=1.0, memory_mb=512, disk_mb=256,
            ttl_s=60, network=False, labels={"l": "v"},
        ),
    ),
    SandboxStopped(
        sandbox_id="sb-1", occurred_at=_AT,
        payload=StoppedPayload(
            reason=StopReason.OOM, detail="d", actor="t/k",
            last_state=LastState(observed_by="node", cpu_s=1.5, last_command="ls"),
        ),
    ),
    CommandCompleted(
        sandbox_id="sb-1", occurred_at=_AT,
        payload=CommandPayload(
            request_id=_ID, actor="t/k", command=["ls", "-l"], exit_code=0, duration_ms=1.0,
            stdout_bytes=3, stderr_bytes=0, stdout_head="hi\n",
        ),
    ),
    NodeHeartbeat(
        node_id="n1", occurred_at=_AT,
        payload=NodePayload(
            capacity_sandboxes=4, capacity_cpus=4.0, capacity_memory_mb=4096,
            images=["img"], queue="q", sandboxes=["sb-1"],
        ),
    ),
    ExecOutput(
        request_id=_ID, sandbox_id="sb-1", exit_code=0, stdout_b64="aGkK", stderr_b64="",
        duration_ms=1.0,
    ),
    ErrorReply(request_id=_ID, sandbox_id="sb-1", reason="invalid", detail="nope"),
]  # fmt: skip


def _bodies() -> list[dict[str, Any]]:
    return [json.loads(encode(m)) for m in VALID]


def _paths(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every place in a JSON body that holds a string, a number or a key."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield (*path, ("key", key))
            yield from _paths(item, (*path, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _paths(item, (*path, i))
    elif isinstance(value, str | int | float) and not isinstance(value, bool):
        yield path


def _put(body: Any, path: tuple[Any, ...], new: Any) -> None:
    *up, last = path
    for step in up:
        body = body[step]
    if isinstance(last, tuple):  # a key: rename it, keeping its value
        body[new] = body.pop(last[1])
    else:
        body[last] = new


_PLACEHOLDER = "\x01\x02placeholder\x02\x01"
_PLACEHOLDER_JSON = json.dumps(_PLACEHOLDER).encode()


def _with_raw(body: dict[str, Any], path: tuple[Any, ...], raw_token: bytes) -> bytes:
    """``body`` as JSON, with ``raw_token`` written verbatim where ``path`` was."""
    body = json.loads(json.dumps(body))
    _put(body, path, _PLACEHOLDER)
    return json.dumps(body).encode().replace(_PLACEHOLDER_JSON, raw_token)


def _check(raw: bytes) -> None:
    """Every decoder gives a message or a DecodeError with a named reason; peek a dict."""
    for decoder in DECODERS:
        try:
            message = decoder(raw)
        except DecodeError as exc:
            assert isinstance(exc.reason, DeadLetterReason)
            # its detail travels in dead letters and Rejected events: storable text
            assert "\x00" not in exc.detail
            exc.detail.encode("utf-8")
        else:
            encode(message)  # what was accepted can be sent on
            if decoder is decode_request:  # and a request's text can be stored
                assert not any("\x00" in s for s in _strings(message.model_dump(mode="json")))
    seen = peek(raw)
    assert isinstance(seen, dict)
    json.dumps(seen, ensure_ascii=False).encode("utf-8")  # what it saw can be written out


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield str(key)
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def test_the_valid_messages_are_valid() -> None:
    # The hostile variants below start from these: each must decode as it is.
    for message in VALID:
        raw = encode(message)
        decoded = [d(raw) for d in DECODERS if _decodes(d, raw)]
        assert decoded == [message]


def _decodes(decoder: Decoder, raw: bytes) -> bool:
    try:
        decoder(raw)
    except DecodeError:
        return False
    return True


# --- any bytes, any JSON ---------------------------------------------------------


@FUZZ
@given(st.binary(max_size=2048))
def test_any_bytes(raw: bytes) -> None:
    _check(raw)


_char = st.characters() | st.sampled_from("\x00\ud800\udbff\udc00\udfff\ufffe\uffff")
_any_text = st.text(_char, max_size=40)
_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**60), max_value=10**60)
    | st.floats(allow_nan=True, allow_infinity=True)
    | _any_text,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(_any_text, inner, max_size=6),
    max_leaves=40,
)


@FUZZ
@given(_json_values, st.booleans())
def test_any_json_value(value: Any, ascii_only: bool) -> None:
    # ensure_ascii writes a lone surrogate as a \udXXX escape; without it, it is
    # written raw (surrogatepass): bytes that are not UTF-8.
    text = json.dumps(value, ensure_ascii=ascii_only, allow_nan=True)
    _check(text.encode("utf-8", "surrogatepass"))


@FUZZ
@given(st.sampled_from(range(len(VALID))), st.dictionaries(_any_text, _json_values, max_size=4))
def test_valid_message_with_extra_fields(index: int, extra: dict[str, Any]) -> None:
    body = {**_bodies()[index], **extra}
    _check(json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass"))


# --- deep nesting ----------------------------------------------------------------


_openers = st.lists(st.sampled_from(["[", '{"a":', '{"type":', "["]), min_size=1, max_size=4)


@FUZZ
@given(
    st.integers(min_value=MAX_DEPTH - 2, max_value=20_000), _openers, st.booleans(), st.booleans()
)
def test_deep_nesting(depth: int, openers: list[str], closed: bool, inside_a_message: bool) -> None:
    levels = [openers[i % len(openers)] for i in range(depth)]
    deep = "".join(levels)
    if closed:
        deep += "0" + "".join("]" if level == "[" else "}" for level in reversed(levels))
    raw = (
        _with_raw(_bodies()[0], ("command",), deep.encode()) if inside_a_message else deep.encode()
    )
    _check(raw)
    if depth + inside_a_message > MAX_DEPTH:
        for decoder in DECODERS:
            with pytest.raises(DecodeError) as info:
                decoder(raw)
            assert info.value.reason == DeadLetterReason.TOO_DEEP
        assert peek(raw) == {}


@pytest.mark.parametrize("decoder", DECODERS)
@pytest.mark.parametrize("deep", [b"[" * 100_000, b'{"a":' * 100_000, b"[" * 5000 + b"]" * 5000])
def test_deep_nesting_is_too_deep(decoder: Decoder, deep: bytes) -> None:
    with pytest.raises(DecodeError) as info:
        decoder(deep)
    assert info.value.reason == DeadLetterReason.TOO_DEEP
    assert peek(deep) == {}


def test_brackets_in_strings_do_not_count() -> None:
    body = json.loads(encode(VALID[0]))
    body["command"] = ["[" * 500 + "{" * 500]
    assert decode_request(json.dumps(body).encode()).command == body["command"]


def test_hostile_strings_are_scanned_in_linear_time() -> None:
    # Unterminated strings full of escaped quotes, and brackets: the depth scan must
    # not retry from every quote.
    raw = b'{"type": "Exec", "command": "' + b'\\"[' * 300_000
    started = time.monotonic()
    for decoder in DECODERS:
        with pytest.raises(DecodeError):
            decoder(raw, 4 << 20)
    assert peek(raw) == {}
    assert time.monotonic() - started < 5


# --- hostile text and numbers in every field of valid messages ---------------------


_hostile_text: st.SearchStrategy[bytes] = st.sampled_from(
    [
        b'"\\u0000"',
        b'"a\\u0000b"',
        b'"\\ud800"',
        b'"\\udfff x"',
        b'"\\ud800\\ud800"',
        b'"\\ude00\\ud83d"',
        b'"\xff\xfe"',
        b'"\xed\xa0\x80"',
        b'"\xc0\x80"',
        b'"a\x00b"',
        b'"\x1f"',
        b'"\\\\u0000"',
        b'"\\ud83d\\ude00"',
        b'"' + b"x" * 70_000 + b'"',
    ]
) | _any_text.map(lambda t: json.dumps(t).encode())
_extreme_numbers = st.sampled_from(
    [
        b"NaN",
        b"Infinity",
        b"-Infinity",
        b"1e999",
        b"-1e999",
        b"1e-999",
        b"-0",
        b"9" * 4300,
        b"9" * 5000,
        b"-" + b"9" * 5000,
        b"1." + b"0" * 5000,
        b"18446744073709551616",
        b"-9223372036854775809",
        b"0x10",
        b"01",
        b"1e",
        b"true",
        b"null",
        b"[]",
        b"{}",
    ]
)


@FUZZ
@given(st.data(), _hostile_text | _extreme_numbers)
def test_hostile_values_in_every_field(data: st.DataObject, token: bytes) -> None:
    index = data.draw(st.sampled_from(range(len(VALID))))
    body = _bodies()[index]
    path = data.draw(st.sampled_from(sorted(_paths(body), key=repr)))
    if isinstance(path[-1], tuple):  # a key must stay a string to stay in place
        if not token.startswith(b'"'):
            token = b'"' + token + b'"'
        rendered = json.dumps(body).encode()
        key = json.dumps(path[-1][1]).encode() + b":"
        raw = rendered.replace(key, token + b":", 1)
    else:
        raw = _with_raw(body, path, token)
    _check(raw)


@pytest.mark.parametrize("field", ["command", "job_id", "cwd", "trajectory_id", "tenant"])
def test_a_nul_in_any_request_text_is_invalid(field: str) -> None:
    body = json.loads(encode(VALID[0]))
    body[field] = "/workspace/a\x00b" if field == "cwd" else "a\x00b"
    with pytest.raises(DecodeError) as info:
        decode_request(json.dumps(body).encode())
    assert info.value.reason == DeadLetterReason.INVALID
    assert field in info.value.detail and "NUL" in info.value.detail


def test_a_nul_in_a_key_or_a_list_is_invalid() -> None:
    body = json.loads(encode(VALID[0]))
    body["env"] = {"A\x00": "v"}
    with pytest.raises(DecodeError) as info:
        decode_request(json.dumps(body).encode())
    assert "NUL" in info.value.detail
    body["env"] = {}
    body["command"] = ["echo", "a\x00"]
    with pytest.raises(DecodeError) as info:
        decode_request(json.dumps(body).encode())
    assert "command.1" in info.value.detail


def test_an_escaped_backslash_before_u0000_is_text_not_nul() -> None:
    body = json.loads(encode(VALID[0]))
    body["command"] = "printf '\\u0000'"
    assert decode_request(json.dumps(body).encode()).command == "printf '\\u0000'"


@pytest.mark.parametrize("decoder", DECODERS)
def test_a_lone_surrogate_is_malformed(decoder: Decoder) -> None:
    raw = json.dumps(json.loads(encode(VALID[0])) | {"command": "\ud800"}).encode()
    with pytest.raises(DecodeError) as info:
        decoder(raw)
    assert info.value.reason == DeadLetterReason.MALFORMED_JSON
    assert peek(raw) == {}  # nothing a consumer could not write out again


# --- huge arrays -----------------------------------------------------------------


@settings(max_examples=10, deadline=None)
@given(st.integers(min_value=1, max_value=50_000), st.sampled_from([b"0", b'"x"', b"[]", b"{}"]))
def test_huge_arrays(count: int, item: bytes) -> None:
    array = b"[" + b",".join([item] * count) + b"]"
    _check(array)
    for index, field in ((0, "command"), (0, "env"), (5, "payload"), (6, "payload")):
        _check(_with_raw(_bodies()[index], (field,), array))


def test_a_refusal_detail_is_storable_text() -> None:
    body = json.loads(encode(VALID[0]))
    body["env"] = {"K\x00" + "x" * 10_000: 1}
    with pytest.raises(DecodeError) as info:
        decode_request(json.dumps(body).encode())
    assert "\x00" not in info.value.detail
    assert len(info.value.detail) <= 2000


# --- refusals cost what reading costs (bench/refusals.py) --------------------------


@pytest.mark.parametrize("decoder", DECODERS)
@pytest.mark.parametrize("shape", [b"[]", b"{}", b'{"a":[]}'])
def test_many_arrays_or_objects_are_too_complex(decoder: Decoder, shape: bytes) -> None:
    # A parser spends ~1 us on each: 300,000 of them in a 1 MiB record took seconds
    many = b"[" + b",".join([shape] * (MAX_CONTAINERS + 1)) + b"]"
    for raw in (many, _with_raw(_bodies()[0], ("command",), many)):
        with pytest.raises(DecodeError) as info:
            decoder(raw)
        assert info.value.reason == DeadLetterReason.TOO_COMPLEX
        assert peek(raw) == {}


def test_brackets_in_strings_do_not_make_a_message_too_complex() -> None:
    body = json.loads(encode(VALID[0]))
    body["command"] = ["[]{}" * MAX_CONTAINERS]
    assert decode_request(json.dumps(body).encode()).command == body["command"]


#: A list or dict field of each decoder's messages, as (message index, path).
_COLLECTIONS = [
    (0, ("command",)), (0, ("env",)), (1, ("labels",)), (1, ("env",)),
    (3, ("payload", "labels")), (5, ("payload", "command")),
    (6, ("payload", "images")), (6, ("payload", "sandboxes")), (7, ("sha256",)),
]  # fmt: skip


@pytest.mark.parametrize(("index", "path"), _COLLECTIONS)
@pytest.mark.parametrize("collection", ["list", "dict"])
def test_a_collection_is_refused_at_its_first_wrong_item(
    index: int, path: tuple[str, ...], collection: str
) -> None:
    # Numbers where strings go: pydantic makes an error object for each wrong item
    # unless told to stop at the first (450,000 of them cost 4-5 s to refuse).
    wrong: Any = [0] * 50_000 if collection == "list" else {str(i): 0 for i in range(50_000)}
    body = _bodies()[index]
    _put(body, path, wrong)
    raw = json.dumps(body).encode()
    refused = 0
    for decoder in DECODERS:
        with pytest.raises(DecodeError) as info:
            decoder(raw)
        cause = info.value.__cause__
        if isinstance(cause, ValidationError):
            refused += 1
            assert cause.error_count() <= 3, (decoder.__name__, cause.error_count())
    assert refused >= 1  # its own decoder validated it, and stopped early
