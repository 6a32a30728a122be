"""Commands in flight on a node, off the Celery pool, shared fairly between tenants.

A command may run for minutes (a test suite, a build); while it runs, the node only
waits on the agent's socket. Held in a Celery pool thread, sixteen of them filled the
node: a create or a destroy, or another tenant's command, queued behind them. So the
exec task only claims the command (on its pool thread, so a worker that dies before
the claim gets the task again, and one that dies after never runs it twice) and hands
the rest here, up to the node's limit (``DSEC_NODE_MAX_COMMANDS``), and the pool
thread is free for the next task at once. A command that can start at once does so
without a thread (:class:`StartableJob`: its agent's answer is waited on by the node's
one waiter, workers/agent/waiter.py); any other waits on a thread of its own.

Fair share: one tenant holds at most ``DSEC_NODE_MAX_COMMANDS_PER_TENANT`` of those
places, so a tenant that floods a node with long commands leaves room for the
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
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar, runtime_checkable

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
#: Runs the rest of a command started without a thread (on whichever thread its answer
#: came on), inside the command's answering; then its place is given to the next.
Finish = Callable[[Callable[[], None]], None]


@runtime_checkable
class StartableJob(Protocol):
    """A job that may start without a thread of its own (workers/agent/waiter.py)."""

    def __call__(self, running: Running) -> None: ...

    def begin(self, running: Running, finish: Finish) -> bool:
        """Start the command and return at once, calling ``finish`` exactly once later
        with what is left to do; False (nothing done) to be run on a thread instead."""
        ...


class Answering(Protocol):
    """Where a command's replies go (the node's courier): proven with its reply key
    while it runs."""

    def answering(
        self, request_id: uuid.UUID, reply_key: bytes | None
    ) -> AbstractContextManager[None]: ...


class Commands:
    """Runs claimed commands, started without a thread or each on its own, with their
    replies' keys."""

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

    def running_in(self, sandbox_id: str) -> bool:
        """True while a claimed command of ``sandbox_id`` has not been answered."""
        with self._lock:
            return any(sandbox == sandbox_id for sandbox, _ in self._known)

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
            if isinstance(job, StartableJob) and self._begin(running, reply_key, job):
                return
            self._pool.submit(self._run, running, reply_key, job)
        except BaseException:
            self._ended(running)
            raise

    def _begin(self, running: Running, reply_key: bytes | None, job: StartableJob) -> bool:
        """Start ``job`` without a thread, if it can; its replies are proven with
        ``reply_key`` from now until it finishes."""
        answering = ExitStack()
        answering.enter_context(self._courier.answering(running.request_id, reply_key))

        def finish(rest: Callable[[], None]) -> None:
            try:
                rest()
            except Exception:
                log.exception("command %s failed", running.request_id)
            finally:
                answering.close()
                self._ended(running)

        try:
            started = job.begin(running, finish)
        except Exception:
            log.exception("command %s could not start without a thread", running.request_id)
            started = False
        if not started:
            answering.close()
        return started

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
