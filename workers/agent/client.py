"""Host side of the in-sandbox agent: listen for it, talk to it, keep one per sandbox.

The host listens on ``<run_dir>/agent.sock`` (``run_dir`` is host-owned and mounted
read-only at ``/.dsec/run``); the agent connects out. So the host only ever opens paths
in its own directories and never follows a symlink the sandbox made. Anything that
arrives on the socket is still untrusted: frames are size-checked before allocation
and a HELLO must arrive within a deadline. The code in a sandbox is hostile to its
agent: the node accepts only the container's init (:func:`peer_is_sandbox_init`,
from the socket's peer credentials), and never reads more than a request asked for.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import select
import selectors
import socket
import stat
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from workers.agent.errors import (
    AgentError,
    AgentProtocolError,
    AgentRefused,
    AgentTimeout,
    AgentUnavailable,
)
from workers.agent.protocol import (
    HEADER_LEN,
    HELLO_PAYLOAD_LEN,
    SUPPORTED_VERSIONS,
    AgentErrorReply,
    AgentExecResult,
    CapCheck,
    ExecRequest,
    Hello,
    Output,
    PingRequest,
    ReadFileRequest,
    ReadFileResult,
    Request,
    Response,
    SignalAllRequest,
    WriteFileRequest,
    WriteFileResult,
    decode_hello,
    decode_response,
    encode_request,
    frame_length,
    op_of,
    response_limit,
)
from workers.containers.spec import AGENT_SOCKET_NAME

log = logging.getLogger(__name__)

#: Added to a command's timeout for the socket wait: the agent needs up to ~2.1 s after
#: the deadline (kill, wait for the process, linger for the pipes) plus transfer time.
EXEC_MARGIN_S = 5.0
#: Socket timeout for PING and file transfers (at most 64 MiB each).
IO_TIMEOUT_S = 30.0
#: Connections a sandbox's agent may hold (its own cap, MAX_CONNS in dsec_agent.c):
#: requests beyond this many at once queue on a busy connection.
MAX_AGENT_CONNECTIONS = 256
#: How long a request waits for the agent's next spare connection when all of a
#: sandbox's are busy, before it queues behind one of them.
SPARE_WAIT_S = 2.0
#: Idle connections a sandbox keeps after a burst; the host closes the rest (the host,
#: not the agent: only the sender knows that no request is on its way on them).
IDLE_KEPT = 4
_HELLO_FRAME_LEN = HEADER_LEN + HELLO_PAYLOAD_LEN
_UCRED = struct.Struct("3i")
_DEAD_EVENTS = select.POLLHUP | select.POLLERR | select.POLLRDHUP | select.POLLNVAL


def _nspid(pid: int | str) -> list[int]:
    """The pid of ``pid`` in each pid namespace it is in, outermost first."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("NSpid:"):
                    return [int(part) for part in line.split()[1:]]
    except (OSError, ValueError):
        pass
    return []


def peer_is_sandbox_init(sandbox_id: str, conn: AgentConnection) -> bool:
    """True if the peer of ``conn`` is a container's init: PID 1 of a pid namespace
    right below this process's. The sandbox's own processes cannot pass: they are
    deeper than that, and any namespace they make is deeper still. Only the socket's
    own sandbox can reach it, so this is that sandbox's agent."""
    own, peer = _nspid("self"), _nspid(conn.peer_pid) if conn.peer_pid > 0 else []
    if len(peer) == len(own) + 1 and peer[-1] == 1:
        return True
    log.warning(
        "sandbox %s: refused an agent connection from pid %d (namespaced pids %s): "
        "not the sandbox's init, a process inside it tried to take its channel",
        sandbox_id, conn.peer_pid, peer or "unknown",
    )  # fmt: skip
    return False


def _check_hello(raw: bytes | bytearray) -> Hello:
    frame_length(raw[:HEADER_LEN], HELLO_PAYLOAD_LEN)
    hello = decode_hello(raw[HEADER_LEN:])
    if hello.version not in SUPPORTED_VERSIONS:
        raise AgentProtocolError(
            f"agent speaks protocol {hello.version}, host speaks {sorted(SUPPORTED_VERSIONS)}"
        )
    return hello


class AgentConnection:
    """One connection to an agent. Thread-safe: a lock keeps one request in flight,
    which is all a connection carries (an agent of protocol 3 holds several, one
    request each). Any socket failure closes the connection (the agent then
    reconnects); an agent-side refusal (:class:`AgentRefused`) leaves it usable."""

    def __init__(
        self,
        sock: socket.socket,
        hello: Hello,
        *,
        io_timeout_s: float = IO_TIMEOUT_S,
        exec_margin_s: float = EXEC_MARGIN_S,
    ) -> None:
        self._sock = sock
        self._sock.setblocking(True)
        self.hello = hello
        self.io_timeout_s = io_timeout_s
        self.exec_margin_s = exec_margin_s
        # RLock: a failing request closes the connection while holding it.
        self._lock = threading.RLock()
        self._closed = False
        try:
            pid, uid, _gid = _UCRED.unpack(
                sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
            )
        except OSError:
            pid, uid = 0, -1
        #: The agent's pid as the host sees it (SO_PEERCRED), to check against the
        #: container's init pid; ``hello.pid`` is the pid inside the sandbox.
        self.peer_pid: int = pid
        #: The agent's uid as the host sees it (the sandbox's mapped uid).
        self.peer_uid: int = uid
        #: Environment every command gets under its own ``env``: a claimed warm sandbox's
        #: environment from its create request (its container's is fixed at create).
        self.default_env: Mapping[str, str] = {}
        #: Callers holding it through :meth:`AgentPool.using` (guarded by the pool).
        self.users = 0

    @property
    def concurrent(self) -> bool:
        """The agent serves requests on several connections at once (protocol 3)."""
        return self.hello.version >= 3

    @property
    def closed(self) -> bool:
        """True once the connection was closed (by us or after a failure)."""
        return self._closed

    def is_alive(self) -> bool:
        """Cheap check that the peer has not hung up (no data is consumed)."""
        if self._closed:
            return False
        poller = select.poll()
        try:
            poller.register(self._sock.fileno(), select.POLLRDHUP)
            events = poller.poll(0)
        except (OSError, ValueError):
            return False
        return not any(mask & _DEAD_EVENTS for _, mask in events)

    def ping(self) -> None:
        """Round-trip an empty request."""
        self.request(PingRequest(), self.io_timeout_s)

    def exec(
        self,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout_s: float | None = None,
        max_output: int = 1 << 20,
        stdin: bytes = b"",
        on_output: Callable[[Output], None] | None = None,
    ) -> AgentExecResult:
        """Run ``argv`` in the sandbox and wait for it.

        With ``on_output``, output is handed over while the command runs, in pieces
        that add up to the result's stdout and stderr (an agent older than protocol 2
        hands it over in one piece per stream at the end).

        ``env`` overrides entries of :attr:`default_env`, which override the sandbox's
        environment; ``cwd`` defaults to
        /workspace. After ``timeout_s`` the command's process group is killed and the
        result has ``timed_out``; ``None`` waits without limit (the host too).
        ``max_output`` caps stdout and stderr separately. A program that cannot be
        started exits 127 (not found) or 126, with the reason on stderr.
        """
        if isinstance(argv, str | bytes):
            raise TypeError("argv must be a sequence of strings, not a string")
        timeout_ms = 0
        if timeout_s is not None:
            timeout_ms = max(1, math.ceil(timeout_s * 1000))
        merged = {**self.default_env, **(env or {})}
        request = ExecRequest(
            argv=tuple(argv),
            env=tuple(f"{key}={value}" for key, value in merged.items()),
            cwd=cwd or "",
            timeout_ms=timeout_ms,
            max_output=max_output,
            stdin=stdin,
            stream=on_output is not None and self.hello.version >= 2,
        )
        wait = None if timeout_s is None else timeout_s + self.exec_margin_s
        result = self.request(request, wait, on_output)
        assert isinstance(result, AgentExecResult)
        if on_output is not None and not request.stream:
            for stream, data in ((1, result.stdout), (2, result.stderr)):
                if data:
                    on_output(Output(stream, data))
        return result

    def signal_all(self, signo: int) -> None:
        """Send ``signo`` (SIGSTOP, SIGCONT or SIGKILL) to every process of the sandbox
        but the agent's own (protocol 3)."""
        self.request(SignalAllRequest(signo), self.io_timeout_s)

    def write_file(self, path: str, data: bytes, mode: int = 0o644) -> int:
        """Create or truncate ``path`` (absolute, no ``..``, no symlinks; parents are
        created) with ``data``; returns the bytes written."""
        result = self.request(WriteFileRequest(path, data, mode), self.io_timeout_s)
        assert isinstance(result, WriteFileResult)
        return result.bytes_written

    def read_file(self, path: str, max_bytes: int) -> tuple[bytes, bool]:
        """Read at most ``max_bytes`` of the regular file ``path``; returns the data
        and whether the file holds more. A missing file raises :class:`AgentRefused`
        with ``errno == errno.ENOENT``."""
        result = self.request(ReadFileRequest(path, max_bytes), self.io_timeout_s)
        assert isinstance(result, ReadFileResult)
        return result.data, result.truncated

    def request(
        self,
        request: Request,
        timeout_s: float | None,
        on_output: Callable[[Output], None] | None = None,
    ) -> Response:
        """Send one request and return its response; the lower-level form of the
        methods above. ``timeout_s`` bounds the whole round trip; ``on_output`` gets
        the :class:`Output` frames of a streaming EXEC as they come."""
        data = encode_request(request)  # bad arguments fail here, connection untouched
        with self._lock:
            if self._closed:
                raise AgentUnavailable("agent connection is closed")
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            try:
                self._sock.settimeout(timeout_s)
                self._sock.sendall(data)
                op = op_of(request)
                limit, caps = response_limit(request), CapCheck(request)
                while True:
                    header = self._recv_exact(HEADER_LEN, deadline)
                    length = frame_length(header, limit)
                    response = decode_response(op, self._recv_exact(length, deadline))
                    caps.check(response)
                    if not isinstance(response, Output):
                        break
                    if on_output is not None:
                        try:
                            on_output(response)
                        except Exception:  # the command's result must still be read
                            log.exception("output handler failed: no more output passed on")
                            on_output = None
            except TimeoutError as exc:
                # A late answer would desynchronise the stream; closing also makes the
                # agent kill the command.
                self._close_locked()
                raise AgentTimeout(f"agent did not answer within {timeout_s} s") from exc
            except AgentError:
                self._close_locked()
                raise
            except OSError as exc:
                self._close_locked()
                raise AgentUnavailable(f"agent connection broke: {exc}") from exc
        if isinstance(response, AgentErrorReply):
            raise AgentRefused(response.message, response.errno)
        return response

    def _recv_exact(self, n: int, deadline: float | None) -> bytearray:
        buf = bytearray(n)
        view = memoryview(buf)
        pos = 0
        while pos < n:
            if pos and deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError
                self._sock.settimeout(remaining)
            got = self._sock.recv_into(view[pos:])
            if got == 0:
                raise AgentUnavailable("agent closed the connection")
            pos += got
        return buf

    def _close_locked(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.close()

    def close(self) -> None:
        """Close the connection; a request in flight in another thread fails at once."""
        self._closed = True
        # shutdown() wakes a thread blocked in recv on this socket; close() would not.
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with self._lock:
            self._close_locked()


class AgentListener:
    """The listening socket of one sandbox: ``<run_dir>/agent.sock``, mode 0666 so the
    sandbox's unprivileged mapped uid can connect (``run_dir`` is created if missing;
    it must be host-owned and is mounted read-only into the sandbox)."""

    def __init__(self, run_dir: Path, *, socket_name: str = AGENT_SOCKET_NAME) -> None:
        run_dir = Path(run_dir)
        # 0755: the sandbox's mapped uid must traverse it to reach the socket.
        run_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
        self.path = run_dir / socket_name
        if len(os.fsencode(self.path)) >= 108:
            raise AgentError(f"socket path too long for AF_UNIX (max 107 bytes): {self.path}")
        with contextlib.suppress(FileNotFoundError):
            # The run dir is host-owned: whatever is here is a stale socket of ours.
            if stat.S_ISDIR(os.lstat(self.path).st_mode):
                raise AgentError(f"{self.path} is a directory")
            os.unlink(self.path)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind(os.fspath(self.path))
            os.chmod(self.path, 0o666)
            st = os.lstat(self.path)
            self._identity = (st.st_dev, st.st_ino)
            self._sock.listen(16)
        except OSError:
            self._sock.close()
            raise

    def fileno(self) -> int:
        """The listening socket's descriptor (for selectors)."""
        return self._sock.fileno()

    def accept(
        self, timeout_s: float | None, *, io_timeout_s: float = IO_TIMEOUT_S
    ) -> AgentConnection:
        """Wait for an agent to connect and send a valid HELLO.

        Raises :class:`AgentUnavailable` if none does within ``timeout_s``.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._sock.settimeout(timeout_s)
        try:
            sock, _ = self._sock.accept()
        except TimeoutError as exc:
            raise AgentUnavailable(f"no agent connected to {self.path} in {timeout_s} s") from exc
        try:
            remaining = None if deadline is None else max(0.001, deadline - time.monotonic())
            sock.settimeout(remaining)
            raw = bytearray()
            while len(raw) < _HELLO_FRAME_LEN:
                chunk = sock.recv(_HELLO_FRAME_LEN - len(raw))
                if not chunk:
                    raise AgentUnavailable("agent hung up before HELLO")
                raw += chunk
            hello = _check_hello(raw)
        except TimeoutError as exc:
            sock.close()
            raise AgentUnavailable("agent connected but sent no HELLO in time") from exc
        except BaseException:
            sock.close()
            raise
        return AgentConnection(sock, hello, io_timeout_s=io_timeout_s)

    def accept_nowait(self) -> socket.socket | None:
        """A pending raw connection, or None (non-blocking; for :class:`AgentPool`)."""
        self._sock.setblocking(False)
        try:
            sock, _ = self._sock.accept()
        except BlockingIOError:
            return None
        sock.setblocking(False)
        return sock

    def close(self) -> None:
        """Stop listening and remove the socket file (if it is still ours)."""
        self._sock.close()
        with contextlib.suppress(OSError):
            st = os.lstat(self.path)
            if (st.st_dev, st.st_ino) == self._identity:
                os.unlink(self.path)


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
        surplus = False
        try:
            yield conn
        finally:
            with self._cond:
                conn.users -= 1
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
                        (alive if conn.is_alive() else dead).append(conn)
                    slot.conns = alive
                    now = time.monotonic()
                    chosen = next((conn for conn in alive if conn.users == 0), None)
                    if (
                        chosen is None
                        and alive
                        and (
                            not alive[-1].concurrent
                            or len(alive) >= MAX_AGENT_CONNECTIONS
                            or now >= start + SPARE_WAIT_S
                        )
                    ):
                        chosen = min(alive, key=lambda conn: conn.users)
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
            chunk = pending.sock.recv(_HELLO_FRAME_LEN - len(pending.raw))
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._forget(pending)
            return
        pending.raw += chunk
        if len(pending.raw) < _HELLO_FRAME_LEN:
            return
        slot = pending.slot
        slot.pending.discard(pending)
        self._pending.discard(pending)
        self._selector.unregister(pending.sock)
        try:
            hello = _check_hello(pending.raw)
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
