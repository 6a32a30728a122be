"""Egress secrets without a network: what a secret may be, how it is sealed at rest
and for a node, which sandboxes carry it, and how the node's proxy rewrites a
request (each hostile head refused, the secret only where it belongs)."""

from __future__ import annotations

import ipaddress
import json
from datetime import UTC, datetime

import dns.message
import pytest
from pydantic import ValidationError

from app.control.egress_secrets import SecretVault, StoredSecrets
from app.db.egress_secrets import StoredSecret
from app.domain.egress import EgressSecret, NetworkPolicy, carries
from app.domain.node_tasks import NodeTask, TaskEnvelope, seal, seal_egress_secrets, unseal
from workers.egress_dns import EgressResolver
from workers.egress_proxy import rewrite
from workers.host.egress import Attachment

NODE_KEY = b"n" * 32
KEY = EgressSecret(destination="api.example.org", header="Authorization", value="Bearer sk-1")


def test_a_secret_is_a_name_a_header_and_a_one_line_value() -> None:
    assert KEY.destination == "api.example.org"
    assert "sk-1" not in repr(KEY) and "sk-1" not in KEY.model_dump_json()
    for bad in (
        {"destination": "*.example.org"},  # wildcards: one destination, one secret
        {"destination": "10.0.0.1"},
        {"destination": "api.example.org:443"},
        {"header": "Host"},  # framing headers belong to the proxy
        {"header": "Transfer-Encoding"},
        {"header": "X Bad"},
        {"value": "v\r\nX-Injected: 1"},  # header injection
        {"value": ""},
        {"value": "x" * 9000},
    ):
        with pytest.raises(ValidationError):
            EgressSecret.model_validate({**KEY.plain(), **bad})


def test_only_an_allowlist_reaching_the_destination_on_443_carries_it() -> None:
    assert carries(NetworkPolicy(allow=["api.example.org:443"]), "api.example.org")
    assert carries(NetworkPolicy(allow=["*.example.org"]), "api.example.org")
    assert not carries(NetworkPolicy(allow=["api.example.org:80"]), "api.example.org")
    assert not carries(NetworkPolicy(allow=["other.example.com:443"]), "api.example.org")


def test_a_stored_value_opens_only_as_its_tenants_destination_and_header() -> None:
    vault = SecretVault(b"m" * 32)
    sealed = vault.seal("alpha", KEY)
    assert b"sk-1" not in sealed
    row = StoredSecret("api.example.org", "Authorization", sealed, "k", datetime.now(UTC))
    opened = vault.open("alpha", row)
    assert opened is not None and opened.value.get_secret_value() == "Bearer sk-1"
    # A row copied to another tenant, or under another header, does not open.
    assert vault.open("beta", row) is None
    assert vault.open("alpha", row._replace(header="X-Other")) is None
    assert SecretVault(b"o" * 32).open("alpha", row) is None


def test_the_schedulers_store_hands_over_what_the_allowlist_reaches() -> None:
    vault = SecretVault(b"m" * 32)
    other = EgressSecret(destination="other.test", header="X-Key", value="v")
    rows = [
        StoredSecret(s.destination, s.header, vault.seal("alpha", s), "k", datetime.now(UTC))
        for s in (KEY, other)
    ]
    store = StoredSecrets(vault, lambda tenant: rows if tenant == "alpha" else [])
    found = store.for_sandbox("alpha", NetworkPolicy(allow=["api.example.org:443"]))
    assert [s.destination for s in found] == ["api.example.org"]
    assert store.for_sandbox("beta", NetworkPolicy(allow=["api.example.org:443"])) == []


def test_secrets_travel_sealed_for_their_node_only() -> None:
    sealed = seal_egress_secrets(NODE_KEY, [KEY])
    assert sealed is not None and "sk-1" not in sealed
    envelope = TaskEnvelope(request="{}", egress_secrets_sealed=sealed)
    opened = unseal(NodeTask.CREATE, seal(NodeTask.CREATE, envelope, "k-node", NODE_KEY),
                    "k-node", NODE_KEY)  # fmt: skip
    assert not isinstance(opened, str)
    assert [s.plain() for s in opened.secrets] == [KEY.plain()]
    # The same envelope sealed under another node's key: not opened, and not said why.
    other = b"o" * 32
    refused = unseal(NodeTask.CREATE, seal(NodeTask.CREATE, envelope, "k-other", other),
                     "k-other", other)  # fmt: skip
    assert isinstance(refused, str) and "sk-1" not in refused
    assert seal_egress_secrets(NODE_KEY, []) is None


def _secrets_for(name: str) -> list[EgressSecret]:
    return [KEY] if name == "api.example.org" else []


def test_the_proxy_adds_the_header_in_place_of_the_sandboxes() -> None:
    routed = rewrite(
        b"POST /v1 HTTP/1.1\r\nHost: API.example.org:80\r\nauthorization: mine\r\n"
        b"Connection: keep-alive\r\nContent-Length: 2",
        _secrets_for,
    )
    assert isinstance(routed, tuple)
    name, head = routed
    assert name == "api.example.org"
    assert head.startswith(b"POST /v1 HTTP/1.1\r\n")
    assert b"Authorization: Bearer sk-1\r\n" in head and b"mine" not in head
    assert b"keep-alive" not in head and head.endswith(b"Connection: close\r\n\r\n")
    assert b"Content-Length: 2" in head


@pytest.mark.parametrize(
    ("head", "status"),
    [
        (b"GET / HTTP/1.1\r\nHost: echo.example.org", b"403"),  # no secret for that host
        (b"GET http://echo.example.org/ HTTP/1.1\r\nHost: api.example.org", b"400"),
        (b"GET / HTTP/1.1\r\nHost: api.example.org\r\nHost: echo.example.org", b"400"),
        (b"GET / HTTP/1.1", b"400"),  # no Host
        (b"GET / HTTP/1.1\r\nHost: api.example.org:8080", b"400"),
        (b"GET / HTTP/1.1\r\nHost: api.example.org\r\n folded: line", b"400"),
        (b"GET / HTTP/1.1\r\nHost : api.example.org", b"400"),
        (b"CONNECT api.example.org:443 HTTP/1.1\r\nHost: api.example.org", b"400"),
        (b"GET / SPDY/3\r\nHost: api.example.org", b"400"),
    ],
)
def test_the_proxy_refuses_heads_it_would_not_carry(head: bytes, status: bytes) -> None:
    answer = rewrite(head, _secrets_for)
    assert isinstance(answer, bytes) and answer.startswith(b"HTTP/1.1 " + status)
    assert b"sk-1" not in answer


class _Fence:
    def __init__(self, attachment: Attachment) -> None:
        self.attachment = attachment
        self.pins: list[tuple[list[str], bool]] = []

    def of_address(self, source: str) -> Attachment | None:
        return self.attachment

    def pin(self, attachment: Attachment, addresses: list[str], ttl_s: int, ports: object,
            secret: bool = False) -> None:  # fmt: skip
        self.pins.append((addresses, secret))


def test_only_a_secrets_destination_is_pinned_for_the_proxy() -> None:
    policy = NetworkPolicy(allow=["api.example.org:443", "echo.example.org:80"])
    attachment = Attachment(
        "sb-1", 1, policy, ipaddress.IPv4Address("10.213.0.5"),
        ipaddress.IPv4Address("10.213.0.6"), (KEY,),
    )  # fmt: skip
    assert "sk-1" not in repr(attachment)
    fence = _Fence(attachment)
    resolver = EgressResolver(fence, lambda name: ["10.99.0.2"], ())  # type: ignore[arg-type]
    resolver.sock.close()
    for name in ("api.example.org", "echo.example.org"):
        resolver.answer(dns.message.make_query(name, "A").to_wire(), "10.213.0.6")
    assert fence.pins == [(["10.99.0.2"], True), (["10.99.0.2"], False)]
    assert json.dumps([s.plain() for s in attachment.secrets_for("API.example.org.")])
    assert attachment.secrets_for("echo.example.org") == []


def test_a_sandbox_holds_no_more_proxy_connections_than_its_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A sandbox opening connections it never speaks on, to tie up the node's threads
    import socket
    import time

    from workers import egress_proxy

    box = Attachment(
        "sb-1", 3, NetworkPolicy(allow=["api.test:443"]),
        ipaddress.IPv4Address("10.213.0.13"), ipaddress.IPv4Address("10.213.0.14"),
    )  # fmt: skip
    refused: list[str] = []

    class Fence:
        max_connections = 2

        def of_address(self, source: str) -> Attachment:
            return box

        def count_refused_name(self, attachment: Attachment, name: str) -> None:
            refused.append(name)

    # As if the firewall had redirected each (a test's connection is not)
    monkeypatch.setattr(egress_proxy, "original_destination", lambda sock: ("10.99.0.2", 80))
    proxy = egress_proxy.SecretProxy(Fence(), None)  # type: ignore[arg-type]
    proxy.start()
    held = [socket.create_connection(("127.0.0.1", proxy.port)) for _ in range(2)]
    time.sleep(0.3)
    extra = socket.create_connection(("127.0.0.1", proxy.port))
    extra.settimeout(5)
    assert extra.recv(1) == b""  # closed at once: over the cap
    assert refused == ["(secrets proxy: too many connections)"]
    for conn in held:  # the first two are still open, waiting for their heads
        conn.settimeout(0.2)
        with pytest.raises(TimeoutError):
            conn.recv(1)
    for conn in (*held, extra):
        conn.close()
    proxy.server.close()
