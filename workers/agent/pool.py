"""The agents of every sandbox of one node process: accept them, keep their
connections, hand one to each request (:class:`AgentPool`). One connection and its
handshake are :mod:`workers.agent.connection`'s.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from workers.agent.connection import (
    HELLO_FRAME_LEN,
    IO_TIMEOUT_S,
    AgentConnection,
    check_hello,
)
from workers.agent.errors import (
    AgentError,
    AgentProtocolError,
    AgentUnavailable,
)
from workers.agent.listener import AgentListener

log = logging.getLogger(__name__)

#: Connections a sandbox's agent may hold (its own cap, MAX_CONNS in dsec_agent.c):
#: requests beyond this many at once queue on a busy connection.
MAX_AGENT_CONNECTIONS = 256
#: How long a request waits for the agent's next spare connection when all of a
#: sandbox's are busy, before it queues behind one of them.
SPARE_WAIT_S = 2.0
#: Idle connections a sandbox keeps after a burst; the host closes the rest (the host,
#: not the agent: only the sender knows that no request is on its way on them).
IDLE_KEPT = 4


@dataclass(eq=False)
class _Slot:
    sandbox_id: str
    listener: AgentListener
    conns: list[AgentConnection] = field(default_factory=list)
    env: Mapping[str, str] = field(default_factory=dict)
    pending: set[_Pending] = field(default_factory=set)


@dataclass(eq=False)
class _Pending:
    slot: _Slot
    sock: socket.socket
    deadline: float
    raw: bytearray = field(default_factory=bytearray)


class AgentPool:
    """The agents of all sandboxes of one worker process, usable from many threads.

    One background thread accepts on every listener (``selectors``) and completes the
    HELLO handshakes without blocking; callers hold a live connection with
    :meth:`using`. An agent of protocol 3 keeps one spare connection beside those
    serving requests, so each request gets a connection of its own and the sandbox
    runs them at once; an older agent has one connection, and its newest valid
    connection replaces the one before (it only reconnects after losing it).
    """

    def __init__(
        self,
        *,
        hello_timeout_s: float = 5.0,
        io_timeout_s: float = IO_TIMEOUT_S,
        max_pending: int = 4,
        verify: Callable[[str, AgentConnection], bool] | None = None,
    ) -> None:
        """``verify(sandbox_id, conn)`` may reject a connection, e.g. when
        ``conn.peer_pid`` is not the container's init process."""
        self.hello_timeout_s = hello_timeout_s
        self.io_timeout_s = io_timeout_s
        self.max_pending = max_pending
        self._verify = verify
        # Guards _slots and every slot's conn; waiters in connection() sleep on it.
        self._cond = threading.Condition(threading.Lock())
        self._slots: dict[str, _Slot] = {}
        # Handshakes in progress; touched only by the loop thread.
        self._pending: set[_Pending] = set()
        self._calls: deque[tuple[Callable[[], object], threading.Event]] = deque()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="dsec-agent-pool", daemon=True)
        self._thread.start()

    def __enter__(self) -> AgentPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ public API

    def register(
        self, sandbox_id: str, run_dir: Path, env: Mapping[str, str] | None = None
    ) -> Path:
        """Listen for the agent of ``sandbox_id`` in ``run_dir`` (before the container
        starts); returns the socket path. Registering again replaces the listener.
        ``env`` becomes every connection's :attr:`AgentConnection.default_env`."""
        listener = AgentListener(run_dir)
        slot = _Slot(sandbox_id, listener, env=dict(env or {}))
        with self._cond:
            old = self._slots.pop(sandbox_id, None)
            self._slots[sandbox_id] = slot
        if old is not None:
            self._drop(old)
        self._call_in_loop(
            lambda: self._selector.register(listener.fileno(), selectors.EVENT_READ, slot)
        )
        return listener.path

    def rename(
        self, old: str, new: str, run_dir: Path, env: Mapping[str, str] | None = None
    ) -> None:
        """Move ``old``'s listener and live connection to ``new`` (a claimed warm
        sandbox) after the host renamed its run directory to ``run_dir``; ``env`` as in
        :meth:`register`. Raises :class:`AgentUnavailable` if ``old`` is not registered
        or ``new`` already is."""
        with self._cond:
            slot = self._slots.get(old)
            if slot is None or new in self._slots:
                raise AgentUnavailable(f"cannot move agent slot {old} to {new}")
            del self._slots[old]
            slot.sandbox_id = new
            slot.listener.path = Path(run_dir) / slot.listener.path.name
            slot.env = dict(env or {})
            for conn in slot.conns:
                conn.default_env = slot.env
            self._slots[new] = slot
            self._cond.notify_all()

    def registered(self) -> set[str]:
        """The sandboxes the pool listens for."""
        with self._cond:
            return set(self._slots)

    def unregister(self, sandbox_id: str) -> None:
        """Stop listening for ``sandbox_id`` and close its connection (idempotent)."""
        with self._cond:
            slot = self._slots.pop(sandbox_id, None)
            self._cond.notify_all()
        if slot is not None:
            self._drop(slot)

    def connection(self, sandbox_id: str, wait_s: float) -> AgentConnection:
        """A live connection of ``sandbox_id`` (an idle one if there is), waiting up to
        ``wait_s`` for the agent to (re)connect. Raises :class:`AgentUnavailable` if it
        does not, or if the sandbox is not registered. Prefer :meth:`using`, which
        keeps other callers off the connection while it is held."""
        return self._pick(sandbox_id, wait_s, hold=False)

    @contextlib.contextmanager
    def using(self, sandbox_id: str, wait_s: float) -> Iterator[AgentConnection]:
        """Hold a connection of ``sandbox_id`` for one or more requests: an idle one,
        the agent's next spare if all are busy, and only when neither comes within
        :data:`SPARE_WAIT_S` (or the agent speaks an older protocol) one that is
        busy, whose requests then run one after another. Errors as :meth:`connection`."""
        conn = self._pick(sandbox_id, wait_s, hold=True)
        try:
            yield conn
        finally:
            self.release(sandbox_id, conn)

    def hold_idle(self, sandbox_id: str) -> AgentConnection | None:
        """An idle live connection of ``sandbox_id``, held until :meth:`release` and
        shared with nobody meanwhile, if one is there right now; None rather than wait
        (or share a busy one)."""
        with self._cond:
            slot = self._slots.get(sandbox_id)
            for conn in slot.conns if slot else ():
                # Only the one chosen is asked whether it lives, as in using().
                if conn.users == 0 and not conn.closed and conn.is_alive():
                    conn.users += 1
                    conn.exclusive = True
                    return conn
        return None

    def release(self, sandbox_id: str, conn: AgentConnection) -> None:
        """Give back a connection held through :meth:`hold_idle` (or :meth:`using`)."""
        surplus = False
        with self._cond:
            conn.users -= 1
            conn.exclusive = False
            slot = self._slots.get(sandbox_id)
            if conn.concurrent and conn.users == 0 and slot is not None:
                idle = sum(1 for c in slot.conns if c.users == 0)
                surplus = idle > IDLE_KEPT and conn in slot.conns
                if surplus:
                    slot.conns.remove(conn)
            self._cond.notify_all()
        if surplus:
            conn.close()

    def _pick(self, sandbox_id: str, wait_s: float, *, hold: bool) -> AgentConnection:
        start = time.monotonic()
        deadline = start + wait_s
        dead: list[AgentConnection] = []
        try:
            with self._cond:
                while True:
                    slot = self._slots.get(sandbox_id)
                    if slot is None:
                        raise AgentUnavailable(f"sandbox {sandbox_id} has no agent listener")
                    alive: list[AgentConnection] = []
                    for conn in slot.conns:
                        (dead if conn.closed else alive).append(conn)
                    slot.conns = alive
                    now = time.monotonic()
                    chosen = next((conn for conn in alive if conn.users == 0), None)
                    shared = [conn for conn in alive if not conn.exclusive]
                    if (
                        chosen is None
                        and shared
                        and (
                            not alive[-1].concurrent
                            or len(alive) >= MAX_AGENT_CONNECTIONS
                            or now >= start + SPARE_WAIT_S
                        )
                    ):
                        chosen = min(shared, key=lambda conn: conn.users)
                    if chosen is not None and not chosen.is_alive():
                        # Only the one chosen is asked (a system call under the pool's
                        # lock, on every command); the others when their turn comes.
                        slot.conns.remove(chosen)
                        dead.append(chosen)
                        continue
                    if chosen is not None:
                        if hold:
                            chosen.users += 1
                        return chosen
                    remaining = deadline - now
                    if remaining <= 0:
                        raise AgentUnavailable(
                            f"agent of sandbox {sandbox_id} not connected after {wait_s} s"
                        )
                    if alive:  # all busy: the agent is connecting its next spare
                        remaining = min(remaining, start + SPARE_WAIT_S - now)
                    self._cond.wait(remaining)
        finally:
            for conn in dead:  # outside the pool lock: close() may wait for a request
                conn.close()

    def connections(self, sandbox_id: str) -> int:
        """Connections the pool holds to ``sandbox_id``'s agent now."""
        with self._cond:
            slot = self._slots.get(sandbox_id)
            return len(slot.conns) if slot else 0

    def is_registered(self, sandbox_id: str) -> bool:
        """True if the pool listens for ``sandbox_id``'s agent."""
        with self._cond:
            return sandbox_id in self._slots

    def is_connected(self, sandbox_id: str) -> bool:
        """True if ``sandbox_id`` has a live connection right now."""
        with self._cond:
            slot = self._slots.get(sandbox_id)
            conns = list(slot.conns) if slot else []
        return any(conn.is_alive() for conn in conns)

    def close(self) -> None:
        """Unregister everything and stop the background thread."""
        with self._cond:
            slots = list(self._slots.values())
            self._slots.clear()
            self._cond.notify_all()
        for slot in slots:
            self._drop(slot)
        self._stopping = True
        self._wake()
        self._thread.join(timeout=5)
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()

    # -------------------------------------------------------- loop plumbing

    def _drop(self, slot: _Slot) -> None:
        conns, slot.conns = slot.conns, []
        for conn in conns:
            conn.close()

        def remove() -> None:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(slot.listener.fileno())
            slot.listener.close()
            for pending in list(slot.pending):
                self._forget(pending)

        self._call_in_loop(remove)

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            self._wake_w.send(b"x")

    def _call_in_loop(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` on the selector thread (the selector is not thread-safe) and wait."""
        if self._stopping or threading.current_thread() is self._thread:
            fn()
            return
        done = threading.Event()
        self._calls.append((fn, done))
        self._wake()
        if not done.wait(timeout=10):
            raise AgentError("agent pool thread is not responding")

    def _run(self) -> None:
        while not self._stopping:
            try:
                self._step()
            except Exception:  # the loop must survive one bad connection
                log.exception("agent pool loop error")
        while self._calls:  # nobody waits forever on a call queued during shutdown
            fn, done = self._calls.popleft()
            with contextlib.suppress(Exception):
                fn()
            done.set()

    def _step(self) -> None:
        timeout = 1.0
        now = time.monotonic()
        for pending in list(self._pending):
            if pending.deadline <= now:
                self._forget(pending)
            else:
                timeout = min(timeout, pending.deadline - now)
        for key, _ in self._selector.select(timeout):
            data = key.data
            if data is None:
                with contextlib.suppress(BlockingIOError):
                    while self._wake_r.recv(4096):
                        pass
            elif isinstance(data, _Slot):
                self._accept(data)
            elif isinstance(data, _Pending):
                self._read_hello(data)
        while self._calls:
            fn, done = self._calls.popleft()
            try:
                fn()
            finally:
                done.set()

    def _accept(self, slot: _Slot) -> None:
        while (sock := slot.listener.accept_nowait()) is not None:
            if len(slot.pending) >= self.max_pending:
                sock.close()  # a sandbox flooding its own socket only hurts itself
                continue
            pending = _Pending(slot, sock, time.monotonic() + self.hello_timeout_s)
            slot.pending.add(pending)
            self._pending.add(pending)
            self._selector.register(sock, selectors.EVENT_READ, pending)

    def _forget(self, pending: _Pending) -> None:
        pending.slot.pending.discard(pending)
        self._pending.discard(pending)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(pending.sock)
        pending.sock.close()

    def _read_hello(self, pending: _Pending) -> None:
        try:
            chunk = pending.sock.recv(HELLO_FRAME_LEN - len(pending.raw))
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._forget(pending)
            return
        pending.raw += chunk
        if len(pending.raw) < HELLO_FRAME_LEN:
            return
        slot = pending.slot
        slot.pending.discard(pending)
        self._pending.discard(pending)
        self._selector.unregister(pending.sock)
        try:
            hello = check_hello(pending.raw)
        except AgentProtocolError as exc:
            log.warning("sandbox %s: bad agent handshake: %s", slot.sandbox_id, exc)
            pending.sock.close()
            return
        conn = AgentConnection(pending.sock, hello, io_timeout_s=self.io_timeout_s)
        try:
            accepted = self._verify is None or self._verify(slot.sandbox_id, conn)
        except Exception:
            log.exception("sandbox %s: verify() failed", slot.sandbox_id)
            accepted = False
        if not accepted:
            log.warning("sandbox %s: agent connection rejected by verify()", slot.sandbox_id)
            conn.close()
            return
        old: list[AgentConnection]
        with self._cond:
            if self._slots.get(slot.sandbox_id) is not slot:
                old = [conn]  # unregistered meanwhile
            elif len(slot.conns) >= MAX_AGENT_CONNECTIONS:
                old = [conn]  # more than the agent's own cap: not a well-behaved agent
            else:
                # Under the lock: rename() may be changing the slot's env right now.
                conn.default_env = slot.env
                if conn.concurrent:
                    old = [c for c in slot.conns if not c.concurrent]
                    slot.conns = [c for c in slot.conns if c.concurrent] + [conn]
                else:  # an older agent holds one connection: the new one replaces it
                    old, slot.conns = slot.conns, [conn]
                self._cond.notify_all()
        for stale in old:
            stale.close()
