"""Bytes on the bus <-> typed messages, with a named reason for every refusal.

Whatever the bytes, a decoder returns a message or raises :class:`DecodeError`, never
anything else: one message that raised something else would stop the consumer that
read it. Valid messages take one pydantic pass over the bytes (Rust); only refusals
take the slow path that names the reason, which parses with the same parser
(``pydantic_core.from_json``: no recursion in Python, lone surrogates refused) after a
byte scan that refuses nesting deeper than :data:`MAX_DEPTH` and more arrays and
objects than :data:`MAX_CONTAINERS`.

A refusal costs about what reading the bytes costs, whatever their shape: anyone with
a credential may write a record of up to 1 MiB that a shared consumer (the scheduler,
a node's inbox) decodes before anything else. A parser spends ~1 us on each array or
object, and pydantic one error object on each wrong item of a list: a record of
300,000 empty arrays, or of 450,000 numbers where a command's strings go, cost 4-5 s
of CPU to refuse (bench/refusals.py). Hence the cap on arrays and objects, checked
before any parse, and ``fail_fast`` on every list and dict field of the messages:
their first wrong item is their refusal.
"""

from __future__ import annotations

import re
from enum import StrEnum
from itertools import accumulate
from typing import Any

from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic_core import from_json

from app.domain.base import MAX_DETAIL, PROTOCOL_VERSIONS, SCHEMA_VERSION
from app.domain.events import EVENT_ADAPTER, EVENT_TYPES, Event
from app.domain.replies import REPLY_ADAPTER, REPLY_FIELDS, REPLY_KINDS, Reply
from app.domain.requests import REQUEST_ADAPTER, REQUEST_TYPES, WIRE, Request
from app.errors import DsecError

#: Deepest nesting of arrays and objects a message may have (the schemas need 4).
MAX_DEPTH = 64
#: Most arrays and objects a message may hold (brackets in strings do not count): the
#: schemas need about a dozen.
MAX_CONTAINERS = 1024


class DeadLetterReason(StrEnum):
    """Why a message could not be consumed."""

    TOO_LARGE = "too_large"
    TOO_DEEP = "too_deep"
    #: More arrays and objects than :data:`MAX_CONTAINERS`.
    TOO_COMPLEX = "too_complex"
    MALFORMED_JSON = "malformed_json"
    NOT_AN_OBJECT = "not_an_object"
    UNKNOWN_TYPE = "unknown_type"
    UNSUPPORTED_VERSION = "unsupported_version"
    INVALID = "invalid"
    UNSTORABLE = "unstorable"
    UNAUTHENTICATED = "unauthenticated"
    FORBIDDEN = "forbidden"
    #: A second end of a life the log has ended already (app/domain/admission.py).
    ALREADY_ENDED = "already_ended"
    #: The consumer failed on it (a bug: its log has the traceback); the rest of its
    #: batch was handled.
    INTERNAL = "internal"


class DecodeError(DsecError, ValueError):
    """A message that does not decode; ``reason`` says why."""

    def __init__(self, reason: DeadLetterReason, detail: str) -> None:
        # The detail is stored and sent on: bounded, and no NUL or lone surrogate.
        detail = (
            detail[:MAX_DETAIL]
            .encode("utf-8", "backslashreplace")
            .decode("utf-8")
            .replace("\x00", "\\x00")
        )
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail


def encode(message: BaseModel) -> bytes:
    """Serialise a message to compact JSON bytes."""
    return message.model_dump_json().encode()


# A JSON string, closing quote optional so that an unterminated one ends the scan
# instead of being retried from every later quote; possessive, so never backtracking.
_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"?', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = [0] * 256
_STEP[ord("[")] = _STEP[ord("{")] = 1
_STEP[ord("]")] = _STEP[ord("}")] = -1
_BACKSLASH = ord("\\")


def _opened(raw: bytes) -> int:
    """Arrays and objects ``raw`` may open, brackets in strings counted too: at least
    as many as it opens, found at memchr's speed."""
    return raw.count(b"[") + raw.count(b"{")


def check_shape(raw: bytes) -> None:
    """Refuse ``raw`` if it nests arrays and objects deeper than :data:`MAX_DEPTH` or
    holds more than :data:`MAX_CONTAINERS` of them (brackets inside strings do not
    count), raising :class:`DecodeError`: before parsing any JSON a client wrote.
    Linear; a count settles most messages."""
    if _opened(raw) <= MAX_DEPTH:
        return
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    if max(accumulate(map(_STEP.__getitem__, brackets)), default=0) > MAX_DEPTH:
        raise DecodeError(DeadLetterReason.TOO_DEEP, f"nested deeper than {MAX_DEPTH}")
    opened = brackets.count(b"[") + brackets.count(b"{")
    if opened > MAX_CONTAINERS:
        raise DecodeError(
            DeadLetterReason.TOO_COMPLEX, f"{opened} arrays and objects > {MAX_CONTAINERS}"
        )


def _fast(raw: bytes, max_bytes: int) -> bool:
    """Whether ``raw`` may take the fast path: a refusal there would cost as much as the
    bytes could make it (the slow path's scan refuses first what it must)."""
    return len(raw) <= max_bytes and _opened(raw) <= MAX_CONTAINERS


def _parse(raw: bytes) -> Any:
    check_shape(raw)
    try:
        return from_json(raw, allow_inf_nan=False)
    except (ValueError, RecursionError, MemoryError) as exc:
        raise DecodeError(DeadLetterReason.MALFORMED_JSON, str(exc)) from exc


def _short(value: object) -> str:
    try:
        return repr(value)[:100]
    except ValueError:  # an int too long to print
        return f"<{type(value).__name__}>"


def _load(raw: bytes, max_bytes: int, discriminator: str, known: frozenset[str]) -> Any:
    if len(raw) > max_bytes:
        raise DecodeError(DeadLetterReason.TOO_LARGE, f"{len(raw)} bytes > {max_bytes}")
    obj = _parse(raw)
    if not isinstance(obj, dict):
        raise DecodeError(DeadLetterReason.NOT_AN_OBJECT, type(obj).__name__)
    kind = obj.get(discriminator)
    if not isinstance(kind, str) or kind not in known:
        raise DecodeError(DeadLetterReason.UNKNOWN_TYPE, f"{discriminator}={_short(kind)}")
    version = obj.get("version", SCHEMA_VERSION)
    if version not in PROTOCOL_VERSIONS:
        served = ", ".join(map(str, PROTOCOL_VERSIONS))
        raise DecodeError(
            DeadLetterReason.UNSUPPORTED_VERSION,
            f"version={_short(version)}, supported {served}",
        )
    return obj


def _validate(adapter: TypeAdapter[Any], obj: Any, context: Any = None) -> Any:
    try:
        return adapter.validate_python(obj, context=context)
    except ValidationError as exc:
        raise DecodeError(DeadLetterReason.INVALID, _summary(exc)) from exc
    except Exception as exc:  # a validator that did not expect this input
        raise DecodeError(DeadLetterReason.INVALID, f"{type(exc).__name__}: {exc}") from exc


def _summary(exc: ValidationError) -> str:
    """The first errors, each as ``location: message`` (keys cut short)."""
    try:
        return "; ".join(
            f"{'.'.join(str(p)[:100] for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:5]
        )
    except Exception:  # a refusal must not fail for the way it is told
        return f"{exc.error_count()} validation errors"


def decode_event(raw: bytes, max_bytes: int = 1 << 20) -> Event:
    """Validate an event; raise :class:`DecodeError` with the reason otherwise."""
    if _fast(raw, max_bytes):
        # Fast path: pydantic parses and validates the bytes in one pass (Rust);
        # only a refusal takes the slow path that names the reason. (Its parser stops
        # at 200 levels by itself, and a valid message is 4 deep: no depth scan here.)
        try:
            event: Event = EVENT_ADAPTER.validate_json(raw)
            return event
        except Exception:  # any refusal: the slow path names it (or raises DecodeError)
            pass
    event = _validate(EVENT_ADAPTER, _load(raw, max_bytes, "type", EVENT_TYPES))
    return event


def decode_request(raw: bytes, max_bytes: int = 1 << 20) -> Request:
    """Validate a request read off the bus (it must carry its own ``request_id`` and
    ``sent_at``); raise :class:`DecodeError` with the reason otherwise.

    A request whose text carries a NUL character is refused (``invalid``): what it
    says lands in the log, and Postgres' jsonb cannot store U+0000.
    """
    request: Request | None = None
    if _fast(raw, max_bytes):
        try:
            request = REQUEST_ADAPTER.validate_json(raw, context=WIRE)
        except Exception:  # any refusal: as in decode_event
            request = None
    if request is None:
        obj = _load(raw, max_bytes, "type", REQUEST_TYPES)
        request = _validate(REQUEST_ADAPTER, obj, WIRE)
    # The parser refuses a raw NUL byte in a string: only an escape can make one, and
    # looking for a backslash first (memchr) keeps this to ~15 ns on most requests.
    if _BACKSLASH in raw and b"\\u0000" in raw:
        where = _nul_at(request.model_dump(), ())
        if where is not None:
            raise DecodeError(
                DeadLetterReason.INVALID, f"{'.'.join(where)}: text may not contain NUL (\\u0000)"
            )
    return request


def _nul_at(value: object, path: tuple[str, ...]) -> tuple[str, ...] | None:
    """Where in ``value`` (a dumped message) a string carries NUL, if anywhere."""
    if isinstance(value, str):
        return path if "\x00" in value else None
    if isinstance(value, dict):
        for key, item in value.items():
            name = str(key)
            if "\x00" in name:
                return (*path, f"{name[:100]!r} (a key)")
            found = _nul_at(item, (*path, name[:100]))
            if found is not None:
                return found
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            found = _nul_at(item, (*path, str(i)))
            if found is not None:
                return found
    return None


def decode_reply(raw: bytes, max_bytes: int = 48 << 20) -> Reply:
    """Validate a reply, as a tolerant reader: fields this version does not know are
    dropped, so a platform that adds one does not break the trainers' older SDKs
    (requests and events stay strict; see docs/protocol.md, "Evolving the messages")."""
    if _fast(raw, max_bytes):
        # Fast path, as in decode_event: a reply with no unknown field (the usual one).
        try:
            fast: Reply = REPLY_ADAPTER.validate_json(raw)
            return fast
        except Exception:  # an unknown field, or a refusal: the slow path sorts it out
            pass
    obj = _load(raw, max_bytes, "kind", REPLY_KINDS)
    known = REPLY_FIELDS[obj["kind"]]
    reply: Reply = _validate(REPLY_ADAPTER, {k: v for k, v in obj.items() if k in known})
    return reply


def peek(raw: bytes) -> dict[str, Any]:
    """Best-effort look into an undecodable message (ids for a Rejected event): its
    top-level object, or ``{}`` for anything that is not one. Never raises."""
    try:
        obj = _parse(raw)
    except Exception:  # a look, not a check: whatever went wrong, nothing was seen
        return {}
    return obj if isinstance(obj, dict) else {}
