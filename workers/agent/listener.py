"""The listening socket of one sandbox's agent (:class:`AgentListener`): the host
listens, the agent connects out, so the host only opens paths in its own directories.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import time
from pathlib import Path

from workers.agent.connection import HELLO_FRAME_LEN, IO_TIMEOUT_S, AgentConnection, check_hello
from workers.agent.errors import AgentError, AgentUnavailable
from workers.containers.spec import AGENT_SOCKET_NAME


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
            while len(raw) < HELLO_FRAME_LEN:
                chunk = sock.recv(HELLO_FRAME_LEN - len(raw))
                if not chunk:
                    raise AgentUnavailable("agent hung up before HELLO")
                raw += chunk
            hello = check_hello(raw)
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
