"""The commands a node claimed, and those of them not answered yet (Redis).

Claiming an exec's request id (``SET NX``) is what makes a command run at most once
however often its record or task is delivered. The same step records the command as
in flight, with what is needed to answer it (its request and reply key), until it is
answered. A worker that dies takes its agents' connections with it, and the agents
then kill those commands: the next worker finds them still recorded and answers each
one ``interrupted``, so a trainer hears of it instead of waiting out its timeout.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

import redis
from pydantic import ValidationError

from app.domain.requests import Exec

log = logging.getLogger(__name__)

#: Claims are kept this long (a replay of the same request id within it is skipped).
DEDUPE_TTL_S = 7 * 86_400

# Claim and record in one round trip, and only if the claim is new.
_CLAIM = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2]) then
    redis.call('HSET', KEYS[2], ARGV[3], ARGV[4])
    return 1
end
return 0
"""


class Claims:
    """A node's exec claims and its commands in flight."""

    def __init__(self, client: redis.Redis, node_id: str) -> None:
        self._redis = client
        self._node_id = node_id
        self._in_flight = f"dsec:inflight:{node_id}"
        self._claim: Any = client.register_script(_CLAIM)

    def claim(self, request: Exec, reply_key: bytes | None) -> bool:
        """True the first time ``request``'s id is seen; it is then in flight here
        until :meth:`answered`."""
        record = {"request": request.model_dump_json(), "reply_key": (reply_key or b"").hex()}
        claimed = self._claim(
            keys=[f"dsec:done:{request.request_id}", self._in_flight],
            args=[self._node_id, DEDUPE_TTL_S, str(request.request_id), json.dumps(record)],
        )
        return bool(claimed)

    def answered(self, request_id: uuid.UUID) -> None:
        """The command was answered (or will never need to be)."""
        self._redis.hdel(self._in_flight, str(request_id))

    def unanswered(self) -> list[tuple[Exec, bytes | None]]:
        """Commands claimed here and never answered (their worker died)."""
        found: list[tuple[Exec, bytes | None]] = []
        entries: dict[bytes, bytes] = self._redis.hgetall(self._in_flight)  # type: ignore[assignment]
        for field, value in entries.items():
            try:
                record = json.loads(value)
                request = Exec.model_validate_json(record["request"])
                key = bytes.fromhex(record["reply_key"]) or None
            except (ValueError, KeyError, TypeError, ValidationError) as exc:
                log.error("in-flight record %s unreadable, dropped: %s", field, exc)
                self._redis.hdel(self._in_flight, field)
                continue
            found.append((request, key))
        return found
