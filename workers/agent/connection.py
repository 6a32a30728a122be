"""Host side of the in-sandbox agent, one connection: listen for it and talk to it.

The host listens on ``<run_dir>/agent.sock`` (``run_dir`` is host-owned and mounted
read-only at ``/.dsec/run``); the agent connects out. So the host only ever opens paths
in its own directories and never follows a symlink the sandbox made. Anything that
arrives on the socket is still untrusted: frames are size-checked before allocation
and a HELLO must arrive within a deadline. The code in a sandbox is hostile to its
agent: the node accepts only the container's init (:func:`peer_is_sandbox_init`,
from the socket's peer credentials), and never reads more than a request asked for.
:mod:`workers.agent.pool` keeps the connections of every sandbox of a node, and
:mod:`workers.agent.listener` listens for them.
"""

from __future__ import annotations

import contextlib
import logging
import math
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from workers.agent.errors import (
    AgentError,
    AgentProtocolError,
    AgentRefused,
    AgentTimeout,
    AgentUnavailable,
)
from workers.agent.messages import (
    HEADER_LEN,
    HELLO_PAYLOAD_LEN,
    SUPPORTED_VERSIONS,
    AgentErrorReply,
    AgentExecResult,
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
)
from workers.agent.protocol import (
    CapCheck,
    decode_hello,
    decode_response,
    encode_request,
    frame_length,
    op_of,
    response_limit,
)
from workers.socket_timeout import set_read_timeout, set_write_timeout

log = logging.getLogger(__name__)

#: Added to a command's timeout for the socket wait: the agent needs up to ~2.1 s after
#: the deadline (kill, wait for the process, linger for the pipes) plus transfer time.
EXEC_MARGIN_S = 5.0
#: Socket timeout for PING and file transfers (at most 64 MiB each).
IO_TIMEOUT_S = 30.0
HELLO_FRAME_LEN = HEADER_LEN + HELLO_PAYLOAD_LEN
#: Bytes asked of the socket at once while frames are small: a response's header and
#: body, and a streamed command's next frames, come in one read instead of one each
#: (each read a system call and a wait on this node's busiest path). A larger frame is
#: read to its exact length.
READ_CHUNK = 64 * 1024
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


def check_hello(raw: bytes | bytearray) -> Hello:
    frame_length(raw[:HEADER_LEN], HELLO_PAYLOAD_LEN)
    hello = decode_hello(raw[HEADER_LEN:])
    if hello.version not in SUPPORTED_VERSIONS:
        raise AgentProtocolError(
            f"agent speaks protocol {hello.version}, host speaks {sorted(SUPPORTED_VERSIONS)}"
        )
    return hello


class Answer:
    """The answer to one request as its frames come, whoever reads them (a request's
    own thread, or the node's waiter): each frame held to what the request asked for,
    output frames passed on, the final response handed back."""

    def __init__(self, request: Request, on_output: Callable[[Output], None] | None) -> None:
        self.op = op_of(request)
        #: Largest frame the request's answer may hold.
        self.limit = response_limit(request)
        self._caps = CapCheck(request)
        self._on_output = on_output

    def take(self, payload: bytes | bytearray) -> Response | None:
        """The final response, if ``payload`` is it; None for an output frame."""
        response = decode_response(self.op, payload)
        self._caps.check(response)
        if not isinstance(response, Output):
            return response
        if self._on_output is not None:
            try:
                self._on_output(response)
            except Exception:  # the command's result must still be read
                log.exception("output handler failed: no more output passed on")
                self._on_output = None
        return None


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
        # Blocking, its timeouts kept by the kernel (workers/socket_timeout.py).
        self._sock.setblocking(True)
        self._read_timeout: float | None = None
        self._write_timeout: float | None = None
        # Read from the socket and not yet handed over: the start of the next frame.
        self._pending = bytearray()
        self._chunk = bytearray(READ_CHUNK)
        # The round trip's timeout and deadline, and whether its first read was made.
        self._timeout: float | None = None
        self._deadline: float | None = None
        self._reading = False
        # Sent by send() and read by one thread that waits on many (workers/agent/
        # waiter.py): close() then leaves the descriptor to that thread, which sees the
        # end on it (a descriptor closed under epoll is dropped without an event).
        self._watched = False
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
        #: Held through :meth:`AgentPool.hold_idle` for a request another thread waits
        #: on: never shared, since a second request on it would read the first's answer
        #: (guarded by the pool).
        self.exclusive = False

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
        request, wait = self.exec_request(
            argv, env, cwd, timeout_s, max_output, stdin, stream=on_output is not None
        )
        result = self.request(request, wait, on_output)
        assert isinstance(result, AgentExecResult)
        if on_output is not None and not request.stream:
            for stream, data in ((1, result.stdout), (2, result.stderr)):
                if data:
                    on_output(Output(stream, data))
        return result

    def exec_request(
        self,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout_s: float | None = None,
        max_output: int = 1 << 20,
        stdin: bytes = b"",
        *,
        stream: bool = False,
    ) -> tuple[ExecRequest, float | None]:
        """The request :meth:`exec` sends (``stream``: output frames while it runs, if
        this agent can), and how long its round trip may take (None: without end)."""
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
            stream=stream and self.hello.version >= 2,
        )
        return request, None if timeout_s is None else timeout_s + self.exec_margin_s

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
            self._timeout = timeout_s
            self._deadline = None if timeout_s is None else time.monotonic() + timeout_s
            self._reading = False
            try:
                if self._write_timeout != timeout_s:  # each set is a system call
                    set_write_timeout(self._sock, timeout_s)
                    self._write_timeout = timeout_s
                try:
                    self._sock.sendall(data)
                except BlockingIOError as exc:
                    raise TimeoutError from exc
                answer = Answer(request, on_output)
                while (response := answer.take(self._read_frame(answer.limit))) is None:
                    pass
                if self._pending:
                    # More than the request asked for: whatever it is, it would be
                    # read as the next request's answer.
                    raise AgentProtocolError(
                        f"agent sent {len(self._pending)} bytes after its response"
                    )
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

    def _read_frame(self, limit: int) -> bytearray:
        """The next frame's payload, at most ``limit`` bytes."""
        self._fill(HEADER_LEN)
        length = frame_length(self._pending[:HEADER_LEN], limit)
        end = HEADER_LEN + length
        if end > READ_CHUNK and len(self._pending) < end:
            # A large frame (a file, a long output) is read into its own buffer, to
            # its exact length.
            body = bytearray(length)
            have = len(self._pending) - HEADER_LEN
            body[:have] = self._pending[HEADER_LEN:]
            self._pending.clear()
            view = memoryview(body)
            while have < length:
                have += self._recv_into(view[have:])
            return body
        self._fill(end)
        body = self._pending[HEADER_LEN:end]
        del self._pending[:end]
        return body

    def _fill(self, n: int) -> None:
        """Read until :attr:`_pending` holds ``n`` bytes (as many more as come in one
        read, up to :data:`READ_CHUNK`)."""
        while len(self._pending) < n:  # n <= READ_CHUNK: larger frames go around
            view = memoryview(self._chunk)[: READ_CHUNK - len(self._pending)]
            got = self._recv_into(view)
            self._pending += view[:got]

    def _recv_into(self, view: memoryview) -> int:
        """One read into ``view``, within the round trip's deadline: the first waits
        the request's whole timeout (most requests have the same one: set once), the
        next ones what is left of it."""
        wait = self._timeout
        if self._reading and self._deadline is not None:
            wait = self._deadline - time.monotonic()
            if wait <= 0:
                raise TimeoutError
        self._reading = True
        if wait != self._read_timeout:
            set_read_timeout(self._sock, wait)
            self._read_timeout = wait
        try:
            got = self._sock.recv_into(view)
        except BlockingIOError as exc:
            raise TimeoutError from exc
        if got == 0:
            raise AgentUnavailable("agent closed the connection")
        return got

    # ------------------------------ a request waited on by another thread (waiter.py)

    def fileno(self) -> int:
        """The socket's descriptor (to wait on it with epoll)."""
        return self._sock.fileno()

    def send(self, request: Request) -> None:
        """Send ``request`` and return without waiting for its answer, which
        :meth:`read_frames` takes as it arrives: one thread then waits on many
        connections (:mod:`workers.agent.waiter`) instead of one thread on each. Until
        :meth:`unwatch`, :meth:`close` only shuts the socket down."""
        data = encode_request(request)
        with self._lock:
            if self._closed:
                raise AgentUnavailable("agent connection is closed")
            self._watched = True
            try:
                if self._write_timeout != self.io_timeout_s:
                    set_write_timeout(self._sock, self.io_timeout_s)
                    self._write_timeout = self.io_timeout_s
                self._sock.sendall(data)
            except BlockingIOError as exc:
                self._shut_down()
                raise AgentTimeout(f"agent took no request for {self.io_timeout_s} s") from exc
            except OSError as exc:
                self._shut_down()
                raise AgentUnavailable(f"agent connection broke: {exc}") from exc

    def read_frames(self, limit: int) -> list[bytearray]:
        """The payloads of the frames complete after one read of what has arrived
        (never waits; each at most ``limit`` bytes). Raises :class:`AgentUnavailable`
        once the connection ended and :class:`AgentProtocolError` for a frame above
        ``limit``."""
        with self._lock:
            if self._closed:
                raise AgentUnavailable("agent connection is closed")
            view = memoryview(self._chunk)
            try:
                got = self._sock.recv_into(view, READ_CHUNK, socket.MSG_DONTWAIT)
            except BlockingIOError:
                got = -1
            except OSError as exc:
                raise AgentUnavailable(f"agent connection broke: {exc}") from exc
            if got == 0:
                raise AgentUnavailable("agent closed the connection")
            if got > 0:
                self._pending += view[:got]
            frames = []
            while len(self._pending) >= HEADER_LEN:
                end = HEADER_LEN + frame_length(self._pending[:HEADER_LEN], limit)
                if len(self._pending) < end:
                    break
                frames.append(self._pending[HEADER_LEN:end])
                del self._pending[:end]
            return frames

    @property
    def unread(self) -> int:
        """Bytes read from the socket and not yet part of a frame handed over."""
        return len(self._pending)

    def unwatch(self, *, failed: bool) -> None:
        """The waiting thread is done with the request :meth:`send` sent: the
        connection is closed for good if it ``failed`` or was closed meanwhile."""
        with self._lock:
            self._watched = False
            if failed or self._closed:
                self._close_locked()

    def _shut_down(self) -> None:
        """Closed: for good, or (while another thread waits on it) shut down."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        if not self._watched:
            self._close_locked()

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
            if not self._watched:
                self._close_locked()
