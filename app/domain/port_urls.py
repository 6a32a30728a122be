"""Exposed ports' URLs: the token a URL carries, made and checked by the node that
holds the sandbox (no I/O).

A URL is ``http://<node's ports address>/<token>/<path>``. The token names the
sandbox, the port and when it stops working, under an HMAC with a key only that node
holds (derived from its credential's secret): whoever has the URL may use it until it
expires or the sandbox ends; changing any part of it, or guessing one, gives nothing.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from dataclasses import dataclass

#: How many ports one sandbox may have open at once.
MAX_EXPOSED = 16


@dataclass(frozen=True)
class PortGrant:
    """What a valid token allows: ``port`` of ``sandbox_id`` until ``expires`` (epoch s)."""

    sandbox_id: str
    port: int
    expires: int


def url_key(secret: bytes) -> bytes:
    """A node's key for its port URLs, from its credential's secret."""
    return hmac.new(secret, b"dsec port urls", hashlib.sha256).digest()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def mint(key: bytes, grant: PortGrant) -> str:
    """The token for ``grant``."""
    body = f"{grant.sandbox_id}|{grant.port}|{grant.expires}".encode()
    return f"{_b64(body)}.{_b64(hmac.new(key, body, hashlib.sha256).digest())}"


def check(key: bytes, token: str, now: float) -> PortGrant | None:
    """The grant ``token`` proves, if it is this node's and has not expired."""
    body_text, _, sig_text = token.partition(".")
    try:
        body, sig = _unb64(body_text), _unb64(sig_text)
    except ValueError:
        return None
    if not hmac.compare_digest(hmac.new(key, body, hashlib.sha256).digest(), sig):
        return None
    try:
        sandbox_id, port, expires = body.decode().split("|")
        grant = PortGrant(sandbox_id, int(port), int(expires))
    except ValueError:
        return None
    return grant if now < grant.expires else None
