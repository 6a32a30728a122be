"""The in-sandbox agent's double, for unit tests of the node without Podman.

It speaks the agent's wire protocol (version 3: :mod:`workers.agent.protocol`) on the
host's real socket, from threads of the test's own process, so the node's real
:class:`~workers.agent.pool.AgentPool` and :class:`~workers.agent.connection.AgentConnection`
carry every request: it connects out to a sandbox's socket when its container starts
(the in-memory driver's ``on_start``), keeps one connection idle beside those serving
a request, as the agent does, and answers what it is asked. Commands do not run: a
:data:`Run` function says what each one did (by default :func:`scripted`).
"""

from __future__ import annotations

import contextlib
import shlex
import socket
import threading
from collections.abc import Callable
from pathlib import Path

from workers.agent.errors import AgentProtocolError
from workers.agent.messages import (
    HEADER_LEN,
    MAX_REQUEST_FRAME,
    AgentErrorReply,
    AgentExecResult,
    ExecRequest,
    Hello,
    Output,
    PingRequest,
    Pong,
    ReadFileRequest,
    ReadFileResult,
    Request,
    Response,
    SignalAllRequest,
    WriteFileRequest,
    WriteFileResult,
)
from workers.agent.protocol import decode_request, encode_hello, encode_response, frame_length
from workers.containers.spec import AGENT_SOCKET_NAME

#: What a command did, given the request that runs it.
Run = Callable[[ExecRequest], AgentExecResult]

#: The errno of a missing file (what the agent answers a read of one with).
ENOENT = 2


def scripted(request: ExecRequest) -> AgentExecResult:
    """A shell that knows two words: ``echo`` (prints the rest) and ``exit N``, in
    ``/bin/sh -c`` scripts of statements separated by ``;``. Any other program is
    not found (127), as a real shell says."""
    script = request.argv[2] if request.argv[:2] == ("/bin/sh", "-c") else shlex.join(request.argv)
    out = bytearray()
    for statement in script.split(";"):
        words = shlex.split(statement)
        if not words:
            continue
        if words[0] == "echo":
            out += (" ".join(words[1:]) + "\n").encode()
        elif words[0] == "exit":
            return AgentExecResult(exit_code=int(words[1]), stdout=bytes(out), stderr=b"")
        else:
            error = f"sh: {words[0]}: not found\n".encode()
            return AgentExecResult(exit_code=127, stdout=bytes(out), stderr=error)
    return AgentExecResult(exit_code=0, stdout=bytes(out), stderr=b"")


class AgentDouble:
    """The agents of every sandbox a test starts; thread-safe."""

    def __init__(self, run: Run = scripted) -> None:
        self.run = run
        #: Each sandbox's files, as written through it.
        self.files: dict[str, dict[str, bytes]] = {}
        #: Every request served, with its sandbox, in the order they came.
        self.served: list[tuple[str, Request]] = []
        self._socks: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False

    def start(self, sandbox_id: str, run_dir: Path) -> None:
        """The sandbox's agent starts: it connects to the host's socket in ``run_dir``."""
        self._spare(sandbox_id, run_dir / AGENT_SOCKET_NAME)

    def close(self) -> None:
        """Every agent hangs up."""
        with self._lock:
            self._closed = True
            socks, self._socks = set(self._socks), set()
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _spare(self, sandbox_id: str, path: Path) -> None:
        """Open one more connection (the idle one) and serve it on a thread."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(str(path))
            sock.sendall(encode_hello(Hello(version=3, pid=1)))
        except OSError:  # the host stopped listening: the sandbox is going away
            sock.close()
            return
        with self._lock:
            if self._closed:
                sock.close()
                return
            self._socks.add(sock)
        threading.Thread(
            target=self._serve, args=(sandbox_id, path, sock), name="agent-double", daemon=True
        ).start()

    def _serve(self, sandbox_id: str, path: Path, sock: socket.socket) -> None:
        spared = False
        try:
            while True:
                header = _recv_exact(sock, HEADER_LEN)
                request = decode_request(_recv_exact(sock, frame_length(header, MAX_REQUEST_FRAME)))
                if not spared:  # this one is busy now: the agent keeps another idle
                    spared = True
                    self._spare(sandbox_id, path)
                with self._lock:
                    self.served.append((sandbox_id, request))
                for response in self._answer(sandbox_id, request):
                    sock.sendall(encode_response(response))
        except (OSError, EOFError, AgentProtocolError):
            # The host hung up (the sandbox was destroyed, or the test ended), or sent
            # a frame the agent cannot read: the agent drops that connection too.
            pass
        finally:
            with self._lock:
                self._socks.discard(sock)
            sock.close()

    def _answer(self, sandbox_id: str, request: Request) -> list[Response]:
        match request:
            case PingRequest() | SignalAllRequest():
                return [Pong()]
            case ExecRequest():
                result = self.run(request)
                if not request.stream:
                    return [result]
                chunks: list[Response] = [
                    Output(stream, data)
                    for stream, data in ((1, result.stdout), (2, result.stderr))
                    if data
                ]
                return [*chunks, result]
            case WriteFileRequest():
                with self._lock:
                    self.files.setdefault(sandbox_id, {})[request.path] = request.data
                return [WriteFileResult(bytes_written=len(request.data))]
            case ReadFileRequest():
                with self._lock:
                    data = self.files.get(sandbox_id, {}).get(request.path)
                if data is None:
                    return [AgentErrorReply(errno=ENOENT, message=f"{request.path}: no such file")]
                kept = data[: request.max_bytes]
                return [ReadFileResult(data=kept, truncated=len(kept) < len(data))]


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        got = sock.recv(n - len(buf))
        if not got:
            raise EOFError
        buf += got
    return bytes(buf)
