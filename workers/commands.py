"""Commands in flight on a node, off the Celery pool, shared fairly between tenants.

A command may run for minutes (a test suite, a build); while it runs, the node only
waits on the agent's socket. Held in a Celery pool thread, sixteen of them filled the
node: a create or a destroy, or another tenant's command, queued behind them. So the
exec task only claims the command (on its pool thread, so a worker that dies before
the claim gets the task again, and one that dies after never runs it twice) and hands
the rest here: each command waits on a thread of its own, up to the node's limit
(``DSEC_NODE_MAX_COMMANDS``), and the pool thread is free for the next task at once.

Fair share: one tenant holds at most ``DSEC_NODE_MAX_COMMANDS_PER_TENANT`` of those
threads, so a tenant that floods a node with long commands leaves room for the
others; commands beyond a limit wait here and start in turn, one tenant after the
other (round robin), as running ones end. Every claimed command is known by its
request id from its claim to its answer, which is what a KillCommand finds.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from workers.agent.connection import AgentConnection
from workers.tally import NodeTally, NoNodeTally

log = logging.getLogger(__name__)

T = TypeVar("T")


class FairQueue(Generic[T]):
    """Items waiting per tenant, taken one tenant after the other."""

    def __init__(self) -> None:
        self._queues: OrderedDict[str, deque[T]] = OrderedDict()

    def push(self, tenant: str, item: T) -> None:
        """Queue ``item`` behind the tenant's earlier ones."""
        self._queues.setdefault(tenant, deque()).append(item)

    def pop(self, eligible: Callable[[str], bool] = lambda _t: True) -> tuple[str, T] | None:
        """The oldest item of the next eligible tenant in turn; that tenant then goes to
        the back of the line. None if no eligible tenant waits."""
        for tenant in list(self._queues):
            if not eligible(tenant):
                continue
            items = self._queues.pop(tenant)
            item = items.popleft()
            if items:
                self._queues[tenant] = items  # to the back: the others go first
            return tenant, item
        return None

    def __len__(self) -> int:
        return sum(len(items) for items in self._queues.values())


@dataclass(eq=False)
class Running:
    """One claimed command, from its claim to its answer."""

    request_id: uuid.UUID
    sandbox_id: str
    tenant: str
    #: Who killed it (a KillCommand's actor); None while nobody has.
    killed_by: str | None = None
    #: Output the agent streamed so far, per stream: a killed command's result.
    stdout: bytearray = field(default_factory=bytearray)
    stderr: bytearray = field(default_factory=bytearray)
    _conn: AgentConnection | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def attach(self, conn: AgentConnection) -> bool:
        """The connection it runs on; False if it was killed before it started."""
        with self._lock:
            if self.killed_by is not None:
                return False
            self._conn = conn
            return True

    def kill(self, actor: str) -> None:
        """Kill it: closing its connection makes the agent kill its process group."""
        with self._lock:
            if self.killed_by is None:
                self.killed_by = actor
            conn = self._conn
        if conn is not None:
            conn.close()


Job = Callable[[Running], None]


class Answering(Protocol):
    """Where a command's replies go (the node's courier): proven with its reply key
    while it runs."""

    def answering(
        self, request_id: uuid.UUID, reply_key: bytes | None
    ) -> AbstractContextManager[None]: ...


class Commands:
    """Runs claimed commands, each on its own thread, with their replies' keys."""

    def __init__(
        self,
        courier: Answering,
        limit: int,
        per_tenant: int | None = None,
        tally: NodeTally | None = None,
    ) -> None:
        self._courier = courier
        self._tally: NodeTally = tally or NoNodeTally()
        self._limit = limit
        self._per_tenant = min(per_tenant or limit, limit)
        self._pool = ThreadPoolExecutor(max_workers=limit, thread_name_prefix="dsec-command")
        self._lock = threading.Lock()
        # By sandbox and request id: another sender's equal id names another command.
        self._known: dict[tuple[str, uuid.UUID], Running] = {}
        self._active = 0
        self._active_by_tenant: dict[str, int] = {}
        self._waiting: FairQueue[tuple[Running, bytes | None, Job]] = FairQueue()

    def submit(self, running: Running, reply_key: bytes | None, job: Job) -> None:
        """Run ``job`` (a claimed command) now or in its tenant's turn, its replies
        proven with ``reply_key``."""
        with self._lock:
            self._known[running.sandbox_id, running.request_id] = running
            start = self._may_start(running.tenant)
            if start:
                self._started(running.tenant)
            else:
                self._waiting.push(running.tenant, (running, reply_key, job))
            self._measure()
        if start:
            self._spawn(running, reply_key, job)

    def find(self, sandbox_id: str, request_id: uuid.UUID) -> Running | None:
        """The claimed command of ``request_id`` in ``sandbox_id`` (waiting or running),
        if any."""
        with self._lock:
            return self._known.get((sandbox_id, request_id))

    def in_flight(self) -> int:
        """Commands claimed and not yet answered (running or waiting their turn)."""
        with self._lock:
            return len(self._known)

    def _may_start(self, tenant: str) -> bool:
        return (
            self._active < self._limit and self._active_by_tenant.get(tenant, 0) < self._per_tenant
        )

    def _started(self, tenant: str) -> None:
        self._active += 1
        self._active_by_tenant[tenant] = self._active_by_tenant.get(tenant, 0) + 1

    def _spawn(self, running: Running, reply_key: bytes | None, job: Job) -> None:
        try:
            self._pool.submit(self._run, running, reply_key, job)
        except BaseException:
            self._ended(running)
            raise

    def _run(self, running: Running, reply_key: bytes | None, job: Job) -> None:
        try:
            with self._courier.answering(running.request_id, reply_key):
                job(running)
        except Exception:
            log.exception("command %s failed", running.request_id)
        finally:
            self._ended(running)

    def _ended(self, running: Running) -> None:
        with self._lock:
            self._known.pop((running.sandbox_id, running.request_id), None)
            self._active -= 1
            left = self._active_by_tenant.get(running.tenant, 1) - 1
            if left:
                self._active_by_tenant[running.tenant] = left
            else:
                self._active_by_tenant.pop(running.tenant, None)
            turn = self._waiting.pop(self._may_start) if self._active < self._limit else None
            if turn is not None:
                self._started(turn[0])
            self._measure()
        if turn is not None:
            self._spawn(*turn[1])

    def _measure(self) -> None:
        self._tally.commands(len(self._known), len(self._known) - self._active)

    def close(self) -> None:
        """Stop taking commands; those running finish."""
        self._pool.shutdown(wait=False, cancel_futures=False)
