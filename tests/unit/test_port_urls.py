"""Exposed ports' tokens: only the node's key makes one, and only until it expires."""

from __future__ import annotations

from app.domain.port_urls import PortGrant, check, mint, url_key

KEY = url_key(b"node secret")
GRANT = PortGrant("sb-1.x", 8080, 1_000)


def test_a_token_proves_its_grant_until_it_expires() -> None:
    token = mint(KEY, GRANT)
    assert check(KEY, token, 999.0) == GRANT
    assert check(KEY, token, 1_000.0) is None


def test_another_key_an_altered_token_or_garbage_proves_nothing() -> None:
    token = mint(KEY, GRANT)
    assert check(url_key(b"another node"), token, 0.0) is None
    body, _, sig = token.partition(".")
    other = mint(KEY, PortGrant("sb-1.x", 8081, 1_000)).partition(".")[0]
    assert check(KEY, f"{other}.{sig}", 0.0) is None  # another port under this signature
    assert check(KEY, f"{body}.{sig[:-2]}", 0.0) is None
    for junk in ("", ".", "a.b", "%%%.%%%", body):
        assert check(KEY, junk, 0.0) is None
