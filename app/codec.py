"""Bytes on the bus <-> typed messages, with a named reason for every refusal."""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, TypeAdapter, ValidationError

from app.domain.base import SCHEMA_VERSION
from app.domain.events import EVENT_ADAPTER, EVENT_TYPES, Event
from app.domain.replies import REPLY_ADAPTER, REPLY_FIELDS, REPLY_KINDS, Reply
from app.domain.requests import REQUEST_ADAPTER, REQUEST_TYPES, Request
from app.errors import DsecError


class DeadLetterReason(StrEnum):
    """Why a message could not be consumed."""

    TOO_LARGE = "too_large"
    MALFORMED_JSON = "malformed_json"
    NOT_AN_OBJECT = "not_an_object"
    UNKNOWN_TYPE = "unknown_type"
    UNSUPPORTED_VERSION = "unsupported_version"
    INVALID = "invalid"
    UNSTORABLE = "unstorable"
    UNAUTHENTICATED = "unauthenticated"
    FORBIDDEN = "forbidden"


class DecodeError(DsecError, ValueError):
    """A message that does not decode; ``reason`` says why."""

    def __init__(self, reason: DeadLetterReason, detail: str) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail


def encode(message: BaseModel) -> bytes:
    """Serialise a message to compact JSON bytes."""
    return message.model_dump_json().encode()


def _load(raw: bytes, max_bytes: int, discriminator: str, known: frozenset[str]) -> Any:
    if len(raw) > max_bytes:
        raise DecodeError(DeadLetterReason.TOO_LARGE, f"{len(raw)} bytes > {max_bytes}")
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DecodeError(DeadLetterReason.MALFORMED_JSON, str(exc)) from exc
    if not isinstance(obj, dict):
        raise DecodeError(DeadLetterReason.NOT_AN_OBJECT, type(obj).__name__)
    kind = obj.get(discriminator)
    if kind not in known:
        raise DecodeError(DeadLetterReason.UNKNOWN_TYPE, f"{discriminator}={kind!r}")
    version = obj.get("version", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        raise DecodeError(
            DeadLetterReason.UNSUPPORTED_VERSION, f"version={version!r}, supported {SCHEMA_VERSION}"
        )
    return obj


def _validate(adapter: TypeAdapter[Any], obj: Any) -> Any:
    try:
        return adapter.validate_python(obj)
    except ValidationError as exc:
        errors = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:5]
        )
        raise DecodeError(DeadLetterReason.INVALID, errors) from exc


def decode_event(raw: bytes, max_bytes: int = 1 << 20) -> Event:
    """Validate an event; raise :class:`DecodeError` with the reason otherwise."""
    if len(raw) <= max_bytes:
        # Fast path: pydantic parses and validates the bytes in one pass (Rust);
        # only a refusal takes the slow path that names the reason.
        try:
            event: Event = EVENT_ADAPTER.validate_json(raw)
            return event
        except ValidationError:
            pass
    event = _validate(EVENT_ADAPTER, _load(raw, max_bytes, "type", EVENT_TYPES))
    return event


def decode_request(raw: bytes, max_bytes: int = 1 << 20) -> Request:
    """Validate a request; raise :class:`DecodeError` with the reason otherwise."""
    if len(raw) <= max_bytes:
        try:
            fast: Request = REQUEST_ADAPTER.validate_json(raw)
            return fast
        except ValidationError:
            pass
    request: Request = _validate(REQUEST_ADAPTER, _load(raw, max_bytes, "type", REQUEST_TYPES))
    return request


def decode_reply(raw: bytes, max_bytes: int = 48 << 20) -> Reply:
    """Validate a reply, as a tolerant reader: fields this version does not know are
    dropped, so a platform that adds one does not break the trainers' older SDKs
    (requests and events stay strict; see docs/protocol.md, "Evolving the messages")."""
    obj = _load(raw, max_bytes, "kind", REPLY_KINDS)
    known = REPLY_FIELDS[obj["kind"]]
    reply: Reply = _validate(REPLY_ADAPTER, {k: v for k, v in obj.items() if k in known})
    return reply


def peek(raw: bytes) -> dict[str, Any]:
    """Best-effort look into an undecodable message (ids for a Rejected event)."""
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return obj if isinstance(obj, dict) else {}
