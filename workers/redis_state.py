"""What a node keeps in Redis: its exec claims and commands in flight, the lifecycle
tasks it is doing, its trajectory steps' claims and results, and its inbox position.

Every call that reaches Redis goes through :func:`_translated`, so redis-py's errors
leave this module as the node's own (:class:`~workers.errors.RedisUnavailable` when
Redis cannot be reached, :class:`~workers.errors.RedisFailed` otherwise): callers
never catch a driver's exception.

Claims. Claiming an exec's request id (``SET NX``) is what makes a command run at
most once however often its record or task is delivered. The same step records the
command as in flight, with what is needed to answer it (its request and reply key),
until it is answered. A worker that dies takes its agents' connections with it, and
the agents then kill those commands: the next worker finds them still recorded and
answers each one ``interrupted``, so a trainer hears of it instead of waiting out its
timeout. Lifecycle and file tasks (create, destroy, freeze, thaw, write, read) are
idempotent: the next worker does those again (``tasks.redo_interrupted``).

Trajectory steps run at most once. The scheduler answers steps it finds in the log.
A step that is not there yet (its result still on the way to Postgres, or running
right now) is guarded here: the node claims ``(trajectory_id, step)`` before running
it, and keeps the result for an hour afterwards. A second request for a claimed step
waits for that result and is answered with it, marked replayed, instead of running
the command again.

The inbox position is kept after each batch's claims, so a restart re-reads at most
one batch (:mod:`workers.inbox`).
"""

from __future__ import annotations

import functools
import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any, ParamSpec, TypeVar

import redis
from pydantic import ValidationError

from app.domain.direct import SandboxKey
from app.domain.node_tasks import open_secret, seal_secret
from app.domain.records import StoredOffset
from app.domain.requests import Exec
from app.domain.trajectory import RecordedStep
from workers.errors import RedisFailed, RedisUnavailable
from workers.socket_timeout import set_read_timeout, set_write_timeout
from workers.state_port import DirectRoute

log = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")

#: A trajectory step's claim is kept this long (a restarted trainer may ask a step
#: again hours later; the scheduler answers it from the log by then).
STEP_CLAIM_TTL_S = 7 * 86_400
#: Beyond twice the freshness window, what a command's claim outlives: clock skew
#: between the node and the scheduler that judged the request fresh.
CLAIM_SKEW_S = 60.0


def claim_ttl_s(request_max_age_s: float) -> int:
    """How long a command's claim is kept. A command runs only while fresh (sent at
    most ``request_max_age_s`` ago, and the gate lets one through that was stamped as
    far in the future), so a claim kept twice that, and the skew, outlives every
    delivery of its request that may still run; older ones are refused as stale. (Kept
    7 days, a unit's 20,000 commands/s held 1.6 TB of claims in Redis.)"""
    return int(2 * request_max_age_s + CLAIM_SKEW_S)


#: A step's result is kept this long for the requests that wait on it; by then the log
#: has it, and the scheduler answers from there.
STEP_RESULT_TTL_S = 3600
#: How often a request waiting on another's step looks for its result.
STEP_POLL_S = 0.05

# Claim and record in one round trip, and only if the claim is new.
_CLAIM = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2]) then
    redis.call('HSET', KEYS[2], ARGV[3], ARGV[4])
    return 1
end
return 0
"""


#: How long a call on the claims' connection may wait for Redis.
CLAIMS_TIMEOUT_S = 5.0


class _KernelTimed(redis.Connection):
    """A connection whose socket blocks, with its timeouts kept by the kernel
    (workers/socket_timeout.py): each round trip is a write and a read, no polls."""

    def _connect(self) -> socket.socket:
        sock: socket.socket = super()._connect()  # type: ignore[no-untyped-call]
        set_read_timeout(sock, CLAIMS_TIMEOUT_S)
        set_write_timeout(sock, CLAIMS_TIMEOUT_S)
        return sock


#: Connections one client keeps to Redis at most. Every command thread of a node (up
#: to ``DSEC_NODE_MAX_COMMANDS`` where commands wait on threads) may call at once;
#: redis-py's own pool refuses a caller past its cap (100 since redis-py 6) with "Too
#: many connections", and a command whose ``answered`` was refused stayed in flight,
#: to be answered again as interrupted at the worker's next start. These calls take
#: well under a millisecond each: past the cap a thread waits for a connection instead.
POOL_SIZE = 32


def _client(url: str, **kwargs: Any) -> redis.Redis:
    """A client whose callers wait (up to :data:`CLAIMS_TIMEOUT_S`) for one of
    :data:`POOL_SIZE` connections."""
    pool = redis.BlockingConnectionPool.from_url(
        url, max_connections=POOL_SIZE, timeout=CLAIMS_TIMEOUT_S, **kwargs
    )
    return redis.Redis(connection_pool=pool)


def connect(url: str) -> redis.Redis:
    """A client of the Redis at ``url`` (connecting on first use)."""
    return _client(url)


def connect_claims(url: str) -> redis.Redis:
    """The client of the claims, which are on every command's path: its sockets block,
    with kernel timeouts. Pooled: the pool checks a connection before each use, which
    is what finds one that a restarted Redis closed and opens another before the
    command is sent (a single shared connection saved those system calls, but its
    first command after a Redis restart failed, and a claim cannot be sent twice: a
    second SET NX of the same claim would say the command already ran)."""
    return _client(
        url,
        connection_class=_KernelTimed,
        socket_timeout=None,
        socket_connect_timeout=CLAIMS_TIMEOUT_S,
    )


def _translated(call: Callable[P, T]) -> Callable[P, T]:
    """``call``, with redis-py's errors raised as the node's own."""

    @functools.wraps(call)
    def translated(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return call(*args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise RedisUnavailable(f"{call.__qualname__}: {exc}") from exc
        except redis.RedisError as exc:
            raise RedisFailed(f"{call.__qualname__}: {exc}") from exc

    return translated


class Claims:
    """A node's exec claims, its commands in flight and the tasks it is doing."""

    def __init__(self, client: redis.Redis, node_id: str, secret: bytes, claim_ttl_s: int) -> None:
        self._redis = client
        self._node_id = node_id
        self._claim_ttl_s = claim_ttl_s
        # Reply keys are kept sealed for this node: Redis is shared by every node.
        self._secret = secret
        self._in_flight = f"dsec:inflight:{node_id}"
        self._tasks = f"dsec:inflight-tasks:{node_id}"
        self._claim: Any = client.register_script(_CLAIM)

    @_translated
    def claim(self, request: Exec, reply_key: bytes | None) -> bool:
        """True the first time ``request`` is seen (its id, from its sender: see
        :attr:`~app.domain.requests.RequestBase.scope`); it is then in flight here
        until :meth:`answered`."""
        return bool(self._claim(**self._claim_call(request, reply_key)))

    @_translated
    def claim_many(self, commands: list[tuple[Exec, bytes | None]]) -> list[bool]:
        """:meth:`claim` for each of ``commands`` (with its reply key), in one round
        trip."""
        pipe = self._redis.pipeline(transaction=False)
        for request, reply_key in commands:
            self._claim(**self._claim_call(request, reply_key), client=pipe)
        return [bool(claimed) for claimed in pipe.execute()]

    def _claim_call(self, request: Exec, reply_key: bytes | None) -> dict[str, list[Any]]:
        sealed = seal_secret(self._secret, reply_key) if reply_key else ""
        record = {"request": request.model_dump_json(), "reply_key_sealed": sealed}
        return {
            "keys": [f"dsec:done:{request.scope}", self._in_flight],
            "args": [self._node_id, self._claim_ttl_s, request.scope, json.dumps(record)],
        }

    def answered(self, scope: str) -> None:
        """The command or task of the request of ``scope`` was answered (or will never
        need to be)."""
        self.answered_many([scope])

    @_translated
    def answered_many(self, scopes: list[str]) -> None:
        """:meth:`answered` for each of ``scopes``, in one round trip (from both hashes:
        a command's scope is in one, a task's in the other)."""
        if scopes:
            pipe = self._redis.pipeline(transaction=False)
            pipe.hdel(self._in_flight, *scopes)
            pipe.hdel(self._tasks, *scopes)
            pipe.execute()

    @_translated
    def hold(self, scope: str, task: str, args: list[str]) -> None:
        """A lifecycle or file task is being done here (sealed, as it came) until
        :meth:`answered`: a worker that dies meanwhile leaves it to the next one."""
        record = json.dumps({"task": task, "args": args})
        self._redis.hset(self._tasks, scope, record)

    def held(self) -> list[tuple[str, tuple[str, list[str]]]]:
        """Lifecycle and file tasks a worker of this node took and never finished:
        each with the field it is kept under (for :meth:`answered`)."""
        return self._read(
            self._tasks, lambda r: (str(r["task"]), [str(a) for a in r["args"]]), "held task"
        )

    def unanswered(self) -> list[tuple[str, tuple[Exec, bytes | None]]]:
        """Commands claimed here and never answered (their worker died): each with
        the field it is kept under (for :meth:`answered`; a worker before request ids
        were scoped kept it under the bare id)."""
        return self._read(
            self._in_flight,
            lambda r: (
                Exec.model_validate_json(r["request"]),
                open_secret(self._secret, r["reply_key_sealed"]) if r["reply_key_sealed"] else None,
            ),
            "in-flight command",
        )

    @_translated
    def _read(
        self, key: str, parse: Callable[[dict[str, Any]], T], what: str
    ) -> list[tuple[str, T]]:
        """Every record of the hash ``key``, parsed, with its field; one that cannot be
        is dropped."""
        found: list[tuple[str, T]] = []
        entries: dict[bytes, bytes] = self._redis.hgetall(key)  # type: ignore[assignment]
        for field, value in entries.items():
            try:
                found.append((field.decode(), parse(json.loads(value))))
            except (ValueError, KeyError, TypeError, ValidationError) as exc:
                log.error("%s %s unreadable, dropped: %s", what, field, exc)
                self._redis.hdel(key, field)
        return found


class StepGuard:
    """Claims trajectory steps and shares their results."""

    def __init__(self, client: redis.Redis) -> None:
        self._redis = client

    @staticmethod
    def _keys(tenant: str, trajectory_id: str, step: int) -> tuple[str, str]:
        # Trajectory ids are the tenant's own; a tenant name has no ':'.
        base = f"dsec:step:{tenant}:{trajectory_id}:{step}"
        return base, base + ":result"

    @_translated
    def claim(self, tenant: str, trajectory_id: str, step: int, request_id: str) -> bool:
        """True if this request may run the step (nobody claimed it before)."""
        claim, _ = self._keys(tenant, trajectory_id, step)
        return bool(self._redis.set(claim, request_id, nx=True, ex=STEP_CLAIM_TTL_S))

    @_translated
    def release(self, tenant: str, trajectory_id: str, step: int) -> None:
        """Give the step up (the command could not be started at all)."""
        claim, _ = self._keys(tenant, trajectory_id, step)
        self._redis.delete(claim)

    @_translated
    def record(self, tenant: str, trajectory_id: str, recorded: RecordedStep) -> None:
        """Keep the step's result for the requests that wait on it."""
        _, key = self._keys(tenant, trajectory_id, recorded.step)
        kept = {**asdict(recorded), "request_id": str(recorded.request_id)}
        self._redis.set(key, json.dumps(kept), ex=STEP_RESULT_TTL_S)

    @_translated
    def wait(
        self, tenant: str, trajectory_id: str, step: int, timeout_s: float
    ) -> RecordedStep | None:
        """The result of a step someone else claimed, once it is recorded."""
        _, key = self._keys(tenant, trajectory_id, step)
        deadline = time.monotonic() + timeout_s
        while True:
            raw = self._redis.get(key)
            if raw is not None:
                try:
                    kept = json.loads(raw)
                    return RecordedStep(**{**kept, "request_id": uuid.UUID(kept["request_id"])})
                except (ValueError, KeyError, TypeError) as exc:  # written by another version
                    log.error("step result %s unreadable: %s", key, exc)
                    return None
            if time.monotonic() >= deadline:
                return None
            time.sleep(STEP_POLL_S)


class InboxPosition:
    """Where a node's inbox resumes: per partition, beside the claims it made."""

    def __init__(self, client: redis.Redis, node_id: str) -> None:
        self._redis = client
        self._key = f"dsec:inbox:{node_id}"

    @_translated
    def stored(self) -> dict[int, StoredOffset]:
        """The position saved last, by partition."""
        saved: dict[bytes, bytes] = self._redis.hgetall(self._key)  # type: ignore[assignment]
        out: dict[int, StoredOffset] = {}
        for field, value in saved.items():
            topic_id, _, partition = field.decode().partition(":")
            out[int(partition)] = StoredOffset(uuid.UUID(topic_id), int(value))
        return out

    @_translated
    def save(self, topic_id: uuid.UUID, offsets: dict[int, int]) -> None:
        """Resume from ``offsets`` (partition -> next offset) of this incarnation."""
        # One incarnation's positions only: an old one's would be read as this one's.
        pipe = self._redis.pipeline(transaction=True)
        pipe.delete(self._key)
        for partition, offset in offsets.items():
            pipe.hset(self._key, f"{topic_id}:{partition}", offset)
        pipe.execute()


class Routes:
    """A node's sandbox keys (sealed for this node: Redis is shared by every node) and
    the credentials it was told are revoked. Read through a cache in the worker's
    memory, as only this node's worker writes them; Redis is what a restarted worker
    finds them in."""

    def __init__(self, client: redis.Redis, node_id: str, secret: bytes, ended_ttl_s: int) -> None:
        """``ended_ttl_s``: how long an ended sandbox's route still answers that it
        ended (a command sent to it before is refused as stale after that)."""
        self._redis = client
        self._secret = secret
        self._prefix = f"dsec:direct:{node_id}:"
        self._revoked_key = f"dsec:revoked:{node_id}"
        self._ended_ttl_s = ended_ttl_s
        self._routes: dict[str, DirectRoute] = {}
        self._revoked: frozenset[str] | None = None
        self._lock = threading.Lock()

    @_translated
    def keep(self, sandbox_id: str, key: SandboxKey) -> None:
        """The direct route of a sandbox created here."""
        self._store(sandbox_id, DirectRoute(key))

    @_translated
    def route(self, sandbox_id: str) -> DirectRoute | None:
        """The sandbox's route (from Redis, once, after a restart)."""
        with self._lock:
            found = self._routes.get(sandbox_id)
        if found is not None:
            return found
        raw = self._redis.get(self._prefix + sandbox_id)
        found = self._read(raw) if isinstance(raw, bytes) else None
        if found is not None:
            with self._lock:
                self._routes[sandbox_id] = found
        return found

    @_translated
    def frozen(self, sandbox_id: str, frozen: bool) -> None:
        """The sandbox was frozen (or thawed)."""
        found = self.route(sandbox_id)
        if found is not None:
            self._store(sandbox_id, replace(found, frozen=frozen))

    @_translated
    def ended(self, sandbox_id: str, why: str) -> None:
        """The sandbox ended: its route says so for ``ended_ttl_s``, then is gone."""
        found = self.route(sandbox_id)
        if found is not None:
            self._store(sandbox_id, replace(found, ended=why), self._ended_ttl_s)

    @_translated
    def revoke(self, key_ids: list[str]) -> None:
        """Credentials revoked (kept for good: the list is short)."""
        if key_ids:
            self._redis.sadd(self._revoked_key, *key_ids)
        with self._lock:
            self._revoked = None

    @_translated
    def revoked(self) -> frozenset[str]:
        """Every credential this node was told is revoked."""
        with self._lock:
            if self._revoked is not None:
                return self._revoked
        members: set[bytes] = self._redis.smembers(self._revoked_key)  # type: ignore[assignment]
        found = frozenset(m.decode() for m in members)
        with self._lock:
            self._revoked = found
        return found

    def _store(self, sandbox_id: str, route: DirectRoute, ttl_s: int | None = None) -> None:
        key = route.key
        doc = {
            "key_id": key.key_id, "sealed": seal_secret(self._secret, key.secret),
            "tenant": key.tenant, "actor": key.actor, "ended": route.ended,
            "frozen": route.frozen,
        }  # fmt: skip
        self._redis.set(self._prefix + sandbox_id, json.dumps(doc), ex=ttl_s)
        with self._lock:
            if ttl_s is None:
                self._routes[sandbox_id] = route
            else:  # an ended one is read from Redis while it is kept there
                self._routes.pop(sandbox_id, None)

    def _read(self, raw: bytes) -> DirectRoute | None:
        try:
            doc = json.loads(raw)
            secret = open_secret(self._secret, doc["sealed"])
            if secret is None:
                return None
            key = SandboxKey(doc["key_id"], secret, doc["tenant"], doc["actor"])
            return DirectRoute(key, doc.get("ended"), bool(doc.get("frozen")))
        except (ValueError, KeyError, TypeError):
            log.warning("a direct route in Redis is unreadable; ignored")
            return None
