"""What the node's HTTP proxies share (exposed ports: workers/ports.py; egress
secrets: workers/egress_proxy.py): reading a request's head, short answers of their
own, and copying both ways once a request is on its way."""

from __future__ import annotations

import contextlib
import selectors
import socket
import ssl

#: The longest request head a proxy reads (request line and headers).
MAX_HEAD = 16 << 10
HEAD_TIMEOUT_S = 10.0


def plain_response(status: str, text: str) -> bytes:
    """A whole response with a short text body, closing the connection."""
    body = text.encode()
    return (
        f"HTTP/1.1 {status}\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode() + body


def read_head(sock: socket.socket) -> tuple[bytes, bytes] | None:
    """A request's head, and what came after it (a body's start); None for no head."""
    sock.settimeout(HEAD_TIMEOUT_S)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk or len(data) + len(chunk) > MAX_HEAD:
            return None
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    sock.settimeout(None)
    return head, body


def splice(client: socket.socket, upstream: socket.socket) -> None:
    """Copy both ways until the upstream closes. A client that closes its sending side
    (``nc`` once its input ends) still gets the answer: its end is passed on (as a
    plain socket's FIN; a TLS upstream just hears no more) and the copy goes on the
    other way. Either socket may be TLS, whose decrypted bytes can wait in its buffer
    with nothing left to select on."""
    peers: dict[socket.socket, socket.socket] = {client: upstream, upstream: client}
    with selectors.DefaultSelector() as selector:
        for sock in peers:
            sock.setblocking(True)
            selector.register(sock, selectors.EVENT_READ)
        while True:
            for key, _ in selector.select():
                ready = key.fileobj
                assert isinstance(ready, socket.socket)
                data = ready.recv(65536)
                if not data:
                    if ready is upstream:
                        return
                    selector.unregister(client)
                    if not isinstance(upstream, ssl.SSLSocket):
                        with contextlib.suppress(OSError):
                            upstream.shutdown(socket.SHUT_WR)
                    continue
                peers[ready].sendall(data)
                while isinstance(ready, ssl.SSLSocket) and ready.pending():
                    peers[ready].sendall(ready.recv(ready.pending()))
