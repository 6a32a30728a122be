"""Timeouts kept by the kernel, for the blocking sockets on each command's path.

A socket given a timeout through Python (``settimeout``) polls before every read and
write: two system calls where one does, and each lets go of the interpreter's lock
and takes it back, which on a busy node is a thread hand-off. A blocking socket with
``SO_RCVTIMEO`` and ``SO_SNDTIMEO`` waits in the read or write itself, and fails it
with ``EAGAIN`` (Python's :class:`BlockingIOError`) once the time is up.
"""

from __future__ import annotations

import socket
import struct

_TIMEVAL = struct.Struct("@ll")


def _timeval(seconds: float | None) -> bytes:
    """A ``struct timeval`` of ``seconds``; zero (wait without end) for None."""
    if seconds is None:
        return _TIMEVAL.pack(0, 0)
    micros = max(1000, round(seconds * 1_000_000))  # 0 would mean no timeout at all
    return _TIMEVAL.pack(micros // 1_000_000, micros % 1_000_000)


def set_read_timeout(sock: socket.socket, seconds: float | None) -> None:
    """Reads of the blocking ``sock`` fail after ``seconds`` (None: they wait)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(seconds))


def set_write_timeout(sock: socket.socket, seconds: float | None) -> None:
    """Writes of the blocking ``sock`` fail after ``seconds`` (None: they wait)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(seconds))
