"""Egress secrets added on the way out: a sandbox sends plain HTTP to a destination
its tenant holds a secret for (``http://api.example.org/...``), and this node's proxy
adds the secret's header and carries the request to the destination over TLS.

The value never enters the sandbox: it lives in the node worker's memory (opened
from the scheduler's sealed task) and goes out only inside a TLS connection whose
certificate is verified for the secret's destination name. The node's firewall
(workers/host/egress.py) sends a sandbox's port 80 here only for the addresses its
resolver answered for such a name; the proxy then checks, per request:

- the connection comes from a sandbox of this node (by its address) by way of that
  redirect (its original destination was port 80);
- the request is in origin form (``GET /path``: no absolute URI naming another host)
  with exactly one Host, a name this sandbox holds a secret for;
- the header the secret sets is dropped from what the sandbox sent, then added;
- the upstream is the original destination address, port 443, with SNI and the
  certificate's name check set to the Host: a name pointed elsewhere gets a 502,
  never the header.

One request per connection (``Connection: close`` upstream, as the ports proxy
does), upgrades spliced both ways. Responses come back as they are: the proxy
follows no redirect, so a destination sending the sandbox elsewhere sends it there
without the header.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

from app.domain.egress import SECRET_PLAIN_PORT, SECRET_UPSTREAM_PORT, EgressSecret
from workers.host.egress import Attachment, EgressFence
from workers.http_relay import plain_response, read_head, splice

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0
#: Linux's getsockopt for a redirected connection's original destination.
_SO_ORIGINAL_DST = 80
#: Headers that say how a connection goes on: the proxy decides that.
_HOP = frozenset({b"connection", b"proxy-connection", b"keep-alive"})


def rewrite(
    head: bytes, secrets_for: Callable[[str], list[EgressSecret]]
) -> tuple[str, bytes] | bytes:
    """A request head as it goes upstream, with its destination name; or the whole
    answer the sandbox gets instead (400 for a head the proxy will not carry, 403
    for a host without a secret here). No I/O."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not parts[1].startswith(b"/") or not parts[2].startswith(b"HTTP/1."):
        return plain_response("400 Bad Request", "origin-form HTTP/1.x requests only\n")
    headers: list[tuple[bytes, bytes]] = []
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not name or name != name.strip() or line[:1] in (b" ", b"\t"):
            return plain_response("400 Bad Request", "malformed header\n")
        headers.append((name, value.strip()))
    hosts = [value for name, value in headers if name.lower() == b"host"]
    if len(hosts) != 1:
        return plain_response("400 Bad Request", "exactly one Host header\n")
    host, _, port = hosts[0].decode("ascii", "replace").lower().partition(":")
    if port not in ("", str(SECRET_PLAIN_PORT)):
        return plain_response("400 Bad Request", "the Host's port is the one connected to\n")
    secrets = secrets_for(host)
    if not secrets:
        return plain_response("403 Forbidden", f"no egress secret for {host[:253]} here\n")
    replaced = {s.header.lower().encode() for s in secrets}
    upgrade = any(name.lower() == b"upgrade" for name, _ in headers)
    kept = [
        name + b": " + value
        for name, value in headers
        if name.lower() not in replaced and (upgrade or name.lower() not in _HOP)
    ]
    added = [f"{s.header}: {s.value.get_secret_value()}".encode() for s in secrets]
    closing = [] if upgrade else [b"Connection: close"]
    return host, b"\r\n".join([lines[0], *kept, *added, *closing]) + b"\r\n\r\n"


def original_destination(sock: socket.socket) -> tuple[str, int]:
    """Where a redirected connection was headed (address, port)."""
    raw = sock.getsockopt(socket.SOL_IP, _SO_ORIGINAL_DST, 16)
    port, address = struct.unpack_from("!2xH4s", raw)
    return socket.inet_ntoa(address), port


class SecretProxy:
    """This node's proxy for egress secrets (a daemon thread per connection)."""

    def __init__(self, fence: EgressFence, ca_file: Path | None) -> None:
        self.fence = fence
        self.ca_file = ca_file
        # Every address: the firewall redirects to the sandbox's host-side address,
        # and the proxy answers only connections from its sandboxes' addresses.
        self.server = socket.create_server(("0.0.0.0", 0), backlog=256)
        self.port: int = self.server.getsockname()[1]
        self._context: tuple[float, ssl.SSLContext] | None = None
        self._lock = threading.Lock()
        #: Connections each sandbox holds open through the proxy (its interface's):
        #: no more than the firewall lets it open past the node (a thread each).
        self._open: dict[str, int] = {}

    def start(self) -> None:
        threading.Thread(target=self._accept, name="dsec-egress-proxy", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self.server.accept()
            except OSError:
                log.exception("egress proxy accept")
                time.sleep(0.1)
                continue
            threading.Thread(target=self._serve, args=(conn, peer[0]), daemon=True).start()

    def _serve(self, client: socket.socket, source: str) -> None:
        with contextlib.closing(client):
            attachment = self.fence.of_address(source)
            if attachment is None:
                return  # not a sandbox of this node
            if not self._take(attachment.iface):
                self.fence.count_refused_name(attachment, "(secrets proxy: too many connections)")
                return
            try:
                self._carry(client, attachment)
            finally:
                with self._lock:
                    self._open[attachment.iface] -= 1

    def _take(self, iface: str) -> bool:
        with self._lock:
            held = self._open.get(iface, 0)
            if held >= self.fence.max_connections:
                return False
            self._open[iface] = held + 1
            return True

    def _carry(self, client: socket.socket, attachment: Attachment) -> None:
        """Read the head, add the secret, carry it over TLS and splice the rest."""
        try:
            address, port = original_destination(client)
            if port != SECRET_PLAIN_PORT:
                return  # not redirected here by the firewall
            read = read_head(client)
            if read is None:
                return
            routed = rewrite(read[0], attachment.secrets_for)
            if isinstance(routed, bytes):
                client.sendall(routed)
                return
            name, head = routed
            upstream = self._connect(address, name)
            if isinstance(upstream, bytes):
                client.sendall(upstream)
                return
            with contextlib.closing(upstream):
                upstream.sendall(head + read[1])
                splice(client, upstream)
        except OSError:
            return

    def _connect(self, address: str, name: str) -> ssl.SSLSocket | bytes:
        """A TLS connection to ``address`` verified as ``name``; or the 502 to send."""
        try:
            raw = socket.create_connection((address, SECRET_UPSTREAM_PORT), CONNECT_TIMEOUT_S)
        except OSError as exc:
            return plain_response("502 Bad Gateway", f"{name}:{SECRET_UPSTREAM_PORT}: {exc}\n")
        try:
            return self.context().wrap_socket(raw, server_hostname=name)
        except (ssl.SSLError, OSError) as exc:
            raw.close()
            log.warning("egress proxy: %s at %s refused: %s", name, address, exc)
            return plain_response(
                "502 Bad Gateway", f"{name}: no TLS verified for that name ({type(exc).__name__})\n"
            )

    def context(self) -> ssl.SSLContext:
        """The system's trust and the site's CA file, read again when it changes."""
        mtime = -1.0
        if self.ca_file is not None:
            with contextlib.suppress(OSError):
                mtime = self.ca_file.stat().st_mtime
        with self._lock:
            if self._context is None or self._context[0] != mtime:
                context = ssl.create_default_context()
                if mtime >= 0 and self.ca_file is not None:
                    context.load_verify_locations(cafile=str(self.ca_file))
                self._context = (mtime, context)
            return self._context[1]
