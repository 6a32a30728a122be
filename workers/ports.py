"""Exposed ports: ``sandbox.expose(8080)`` answers a URL, and this node's proxy
carries HTTP and WebSocket from it into the sandbox.

The proxy reads a request's head, checks the token its path starts with
(app/domain/port_urls.py: this node's HMAC, not expired, the port still exposed, the
sandbox still here), strips the token from the path and connects to the port on the
sandbox's own loopback: the connection is made inside the sandbox's network
namespace (its init's), so a sandbox without network serves too, and the proxy can
reach nothing else. A plain request is sent with ``Connection: close`` (the next one
comes on a new connection and is checked again); an upgrade (WebSocket) is then
spliced both ways until either side closes. Anything wrong gets the same 404: a
guessed, altered, expired or closed URL learns nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass

from app.domain.port_urls import MAX_EXPOSED, PortGrant, check, mint
from workers.http_relay import plain_response, read_head, splice

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0
_CLONE_NEWNET = 0x40000000


_NOT_FOUND = plain_response("404 Not Found", "not found\n")
_BAD_GATEWAY = plain_response("502 Bad Gateway", "nothing on that port\n")
#: setns, from the C library (Python 3.11's os has no setns).
_LIBC = ctypes.CDLL(None, use_errno=True)


@dataclass(frozen=True)
class Exposed:
    """A sandbox's open ports and the pid whose network namespace they are in."""

    pid: int
    ports: frozenset[int]


def connect_inside(pid: int, port: int) -> socket.socket:
    """A TCP connection to ``127.0.0.1:port`` in the network namespace of ``pid``,
    made on a thread of its own (setns moves only the calling thread; the thread
    then ends, so nothing else ever runs in the sandbox's namespace)."""
    made: list[socket.socket | BaseException] = []

    def inside() -> None:
        try:
            fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
            try:
                if _LIBC.setns(fd, _CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns")
            finally:
                os.close(fd)
            made.append(socket.create_connection(("127.0.0.1", port), CONNECT_TIMEOUT_S))
        except BaseException as exc:
            made.append(exc)

    thread = threading.Thread(target=inside, name="dsec-port-connect", daemon=True)
    thread.start()
    thread.join()
    if not made or isinstance(made[0], BaseException):
        raise OSError(f"no connection to port {port}: {made[0] if made else 'no answer'}")
    return made[0]


class PortProxy:
    """This node's exposed ports and the proxy that serves them."""

    def __init__(self, key: bytes, host: str, port: int) -> None:
        self.key = key
        self.server = socket.create_server((host, port), backlog=256, reuse_port=False)
        #: Where URLs point: the address the proxy listens on.
        self.address = f"{host}:{self.server.getsockname()[1]}"
        self._open: dict[str, Exposed] = {}
        self._lock = threading.Lock()

    def start(self) -> None:
        threading.Thread(target=self._accept, name="dsec-ports", daemon=True).start()

    def expose(self, sandbox_id: str, pid: int, port: int, ttl_s: int) -> str:
        """Open ``port`` of the sandbox whose init is ``pid``; its URL."""
        with self._lock:
            known = self._open.get(sandbox_id)
            ports = (known.ports if known else frozenset()) | {port}
            if len(ports) > MAX_EXPOSED:
                raise ValueError(f"at most {MAX_EXPOSED} ports of one sandbox are open at once")
            self._open[sandbox_id] = Exposed(pid, ports)
        token = mint(self.key, PortGrant(sandbox_id, port, int(time.time()) + ttl_s))
        return f"http://{self.address}/{token}/"

    def close(self, sandbox_id: str) -> None:
        """The sandbox ended: every URL of it stops working."""
        with self._lock:
            self._open.pop(sandbox_id, None)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                log.exception("ports proxy accept")
                time.sleep(0.1)
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        with contextlib.closing(client):
            try:
                read = read_head(client)
                routed = self._route(read[0]) if read is not None else None
                if routed is None:
                    client.sendall(_NOT_FOUND)
                    return
                (pid, port), upstream_head = routed
                try:
                    upstream = connect_inside(pid, port)
                except OSError:
                    client.sendall(_BAD_GATEWAY)
                    return
                with contextlib.closing(upstream):
                    assert read is not None
                    upstream.sendall(upstream_head + read[1])
                    splice(client, upstream)
            except OSError:
                return

    def _route(self, head: bytes) -> tuple[tuple[int, int], bytes] | None:
        """Where a request head goes and the head as the sandbox gets it; None when
        its token does not hold."""
        line, _, rest = head.partition(b"\r\n")
        parts = line.split(b" ")
        if len(parts) != 3 or not parts[1].startswith(b"/"):
            return None
        token, _, path = parts[1][1:].partition(b"/")
        grant = check(self.key, token.decode("ascii", "replace"), time.time())
        if grant is None:
            return None
        with self._lock:
            exposed = self._open.get(grant.sandbox_id)
        if exposed is None or grant.port not in exposed.ports:
            return None
        headers = [h for h in rest.split(b"\r\n") if h]
        upgrade = any(h.lower().startswith(b"upgrade:") for h in headers)
        if not upgrade:
            headers = [h for h in headers if not h.lower().startswith(b"connection:")]
            headers.append(b"Connection: close")
        request_line = b" ".join([parts[0], b"/" + path, parts[2]])
        return (exposed.pid, grant.port), b"\r\n".join([request_line, *headers]) + b"\r\n\r\n"
