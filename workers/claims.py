"""The commands a node claimed, those of them not answered yet, and the lifecycle
tasks it is doing (Redis).

Claiming an exec's request id (``SET NX``) is what makes a command run at most once
however often its record or task is delivered. The same step records the command as
in flight, with what is needed to answer it (its request and reply key), until it is
answered. A worker that dies takes its agents' connections with it, and the agents
then kill those commands: the next worker finds them still recorded and answers each
one ``interrupted``, so a trainer hears of it instead of waiting out its timeout.
Lifecycle and file tasks (create, destroy, freeze, thaw, write, read) are idempotent:
the next worker does those again (``tasks.redo_interrupted``).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import redis
from pydantic import ValidationError

from app.domain.requests import Exec

log = logging.getLogger(__name__)

T = TypeVar("T")

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
        self._tasks = f"dsec:inflight-tasks:{node_id}"
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
        """The command or task was answered (or will never need to be)."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.hdel(self._in_flight, str(request_id))
        pipe.hdel(self._tasks, str(request_id))
        pipe.execute()

    def hold(self, request_id: uuid.UUID, task: str, args: list[str]) -> None:
        """A lifecycle or file task is being done here (sealed, as it came) until
        :meth:`answered`: a worker that dies meanwhile leaves it to the next one."""
        record = json.dumps({"task": task, "args": args})
        self._redis.hset(self._tasks, str(request_id), record)

    def held(self) -> list[tuple[str, list[str]]]:
        """Lifecycle and file tasks a worker of this node took and never finished."""
        return self._read(
            self._tasks, lambda r: (str(r["task"]), [str(a) for a in r["args"]]), "held task"
        )

    def unanswered(self) -> list[tuple[Exec, bytes | None]]:
        """Commands claimed here and never answered (their worker died)."""
        return self._read(
            self._in_flight,
            lambda r: (
                Exec.model_validate_json(r["request"]),
                bytes.fromhex(r["reply_key"]) or None,
            ),
            "in-flight command",
        )

    def _read(self, key: str, parse: Callable[[dict[str, Any]], T], what: str) -> list[T]:
        """Every record of the hash ``key``, parsed; one that cannot be is dropped."""
        found: list[T] = []
        entries: dict[bytes, bytes] = self._redis.hgetall(key)  # type: ignore[assignment]
        for field, value in entries.items():
            try:
                found.append(parse(json.loads(value)))
            except (ValueError, KeyError, TypeError, ValidationError) as exc:
                log.error("%s %s unreadable, dropped: %s", what, field, exc)
                self._redis.hdel(key, field)
        return found
