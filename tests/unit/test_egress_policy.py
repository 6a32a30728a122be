"""Egress allowlists: how a rule reads, what it lets through, and what the node's
resolver answers (the resolver with a recording fence and lookup: no network)."""

from __future__ import annotations

import ipaddress
import json
import socket
from typing import Any

import dns.message
import dns.rcode
import pytest
from pydantic import ValidationError

from app.domain.egress import ALL_PORTS, NetworkPolicy, parse_rule, pinnable
from app.domain.requests import CreateSandbox
from workers.egress_dns import EgressResolver
from workers.host import egress
from workers.host.egress import Attachment
from workers.host.nft_sets import keys_of

POOL = ipaddress.IPv4Network("10.213.0.0/16")
HOST = ipaddress.IPv4Network("192.0.2.10/32")


def test_rules_read_names_wildcards_networks_and_ports() -> None:
    assert parse_rule("PyPI.mirror.internal:443").name == "pypi.mirror.internal"
    wild = parse_rule("*.example.org:8000-8100")
    assert wild.wildcard and wild.ports == (8000, 8100)
    assert wild.matches("a.example.org") and wild.matches("b.a.example.org")
    assert not wild.matches("example.org") and not wild.matches("badexample.org")
    net = parse_rule("10.1.2.0/24:80")
    assert net.network == ipaddress.IPv4Network("10.1.2.0/24") and net.ports == (80, 80)
    assert parse_rule("10.1.2.3").ports == ALL_PORTS
    assert parse_rule("mirror.internal:*").ports == ALL_PORTS


@pytest.mark.parametrize(
    "rule",
    [
        "", "*", "*.org", "a..b", "-a.org", "a.org:0", "a.org:70000", "a.org:90-80",
        "a.org:http", "[::1]:80", "fe80::1", "127.0.0.1:80", "169.254.169.254",
        "169.254.0.0/16", "224.0.0.1", "1.2.3.999", "a.org/24", "a b.org",
    ],
)  # fmt: skip
def test_a_bad_rule_is_refused_with_its_reason(rule: str) -> None:
    with pytest.raises(ValueError, match="egress rule"):
        parse_rule(rule)


def test_a_create_carries_an_allowlist_or_is_refused() -> None:
    made = CreateSandbox(sandbox_id="sb-1", network={"allow": ["a.example.org:443"]})
    assert made.egress == NetworkPolicy(allow=["a.example.org:443"])
    assert CreateSandbox(sandbox_id="sb-1", network=True).egress is None
    with pytest.raises(ValidationError, match="egress rule"):
        CreateSandbox(sandbox_id="sb-1", network={"allow": ["169.254.169.254:80"]})
    with pytest.raises(ValidationError):
        CreateSandbox(sandbox_id="sb-1", network={"allow": []})
    with pytest.raises(ValidationError):
        CreateSandbox(sandbox_id="sb-1", network={"allow": ["a.org"] * 65})


def test_an_allowed_name_is_pinned_nothing_else_is() -> None:
    assert not pinnable(ipaddress.IPv4Address("127.0.0.1"))
    assert not pinnable(ipaddress.IPv4Address("169.254.169.254"))
    assert not pinnable(ipaddress.IPv4Address("10.213.0.6"), (POOL,))
    assert pinnable(ipaddress.IPv4Address("10.99.0.2"), (POOL,))


class _Fence:
    def __init__(self, policy: NetworkPolicy) -> None:
        self.attachment = Attachment(
            "sb-1", 1, policy, ipaddress.IPv4Address("10.213.0.5"),
            ipaddress.IPv4Address("10.213.0.6"),
        )  # fmt: skip
        self.pins: list[tuple[list[str], list[tuple[int, int]]]] = []
        self.secret_pins: list[bool] = []
        self.refused = 0

    def of_address(self, source: str) -> Attachment | None:
        return self.attachment if source == str(self.attachment.sandbox_ip) else None

    def pin(
        self, attachment: Attachment, addresses: Any, ttl_s: int, ports: Any, secret: bool = False
    ) -> None:
        self.pins.append((list(addresses), ports))
        self.secret_pins.append(secret)

    def count_refused_name(self, attachment: Attachment, name: str = "") -> None:
        self.refused += 1


def _resolver(names: dict[str, list[str]]) -> tuple[EgressResolver, _Fence, list[str]]:
    fence = _Fence(NetworkPolicy(allow=["*.example.org:443", "api.test:8080"]))
    looked_up: list[str] = []

    def lookup(name: str) -> list[str]:
        looked_up.append(name)
        return names.get(name, [])

    resolver = EgressResolver(fence, lookup, (POOL, HOST))  # type: ignore[arg-type]
    resolver.sock.close()
    return resolver, fence, looked_up


def _ask(resolver: EgressResolver, name: str, source: str = "10.213.0.6") -> Any:
    wire = resolver.answer(dns.message.make_query(name, "A").to_wire(), source)
    return None if wire is None else dns.message.from_wire(wire)


def test_an_allowed_name_is_answered_and_pinned_on_its_ports() -> None:
    resolver, fence, _ = _resolver({"a.example.org": ["10.99.0.2", "::1", "bogus"]})
    reply = _ask(resolver, "A.Example.org.")
    assert [r.address for r in reply.answer[0]] == ["10.99.0.2"]
    assert fence.pins == [(["10.99.0.2"], [(443, 443)])]


def test_a_name_not_allowed_is_refused_without_being_looked_up() -> None:
    # DNS tunnelling: data spelled into names of a domain not on the list never
    # leaves the node, not even as a lookup on the host.
    resolver, fence, looked_up = _resolver({})
    reply = _ask(resolver, "c2VjcmV0.attacker.test")
    assert reply.rcode() == dns.rcode.REFUSED
    assert looked_up == [] and fence.pins == [] and fence.refused == 1


def test_an_allowed_name_that_rebinds_to_a_forbidden_address_gets_nothing() -> None:
    resolver, fence, _ = _resolver(
        {"api.test": ["169.254.169.254", "127.0.0.1", "10.213.0.9", _host_address()]}
    )
    reply = _ask(resolver, "api.test")
    assert reply.rcode() == dns.rcode.NXDOMAIN and reply.answer == []
    assert fence.pins == []


def test_queries_from_elsewhere_get_no_reply() -> None:
    resolver, _, looked_up = _resolver({"api.test": ["10.99.0.2"]})
    assert _ask(resolver, "api.test", source="10.213.0.10") is None
    assert resolver.answer(b"\x00garbage", "10.213.0.6") is None
    assert looked_up == []


def _host_address() -> str:
    """One of this host's own addresses besides loopback (a name answering with it
    would lead a sandbox to the node)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.1", 9))  # no packet: picks the route's source address
        return str(probe.getsockname()[0])


def _fence_recording(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, list[str]]:
    scripts: list[str] = []
    monkeypatch.setattr(egress, "_run", lambda argv, stdin=None: scripts.append(stdin or ""))
    fence = egress.EgressFence("n1", ipaddress.IPv4Network("10.213.0.0/16"), 53, 256, 100)
    return fence, scripts


def test_an_answer_given_again_is_not_pinned_again_until_its_pin_runs_short(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fence, scripts = _fence_recording(monkeypatch)
    box = Attachment(
        "sb-1", 3, NetworkPolicy(allow=["a.test:443"]),
        ipaddress.IPv4Address("10.213.0.5"), ipaddress.IPv4Address("10.213.0.6"),
    )  # fmt: skip
    fence.pin(box, ["10.99.0.2"], 60, [(443, 443)])
    # Pinned past what the answer asks, so an nft run is saved on the next lookups
    assert f"timeout {egress.MIN_PIN_S + egress.PIN_SLACK_S}s" in scripts[0]
    fence.pin(box, ["10.99.0.2"], 60, [(443, 443)])
    assert len(scripts) == 1
    # Another address, another port, the secrets proxy's mark or a TTL past the pin:
    # each is pinned
    fence.pin(box, ["10.99.0.3"], 60, [(443, 443)])
    fence.pin(box, ["10.99.0.2"], 60, [(80, 80)])
    fence.pin(box, ["10.99.0.2"], 60, [(443, 443)], secret=True)
    fence.pin(box, ["10.99.0.2"], egress.MIN_PIN_S + egress.PIN_SLACK_S, [(443, 443)])
    assert len(scripts) == 5
    assert "secret_dst" in scripts[3]


def test_an_interfaces_set_keys_read_back_as_nft_takes_them() -> None:
    listing = json.dumps({"nftables": [{"set": {"name": "allowed", "elem": [
        {"elem": {"val": {"concat": ["dsb3", "10.99.0.2", 443]}, "timeout": 900}},
        {"concat": ["dsb3", {"prefix": {"addr": "10.1.2.0", "len": 24}},
                    {"range": [8000, 8100]}]},
        {"concat": ["dsb4", "10.99.0.2", 443]},
    ]}}]})  # fmt: skip
    assert keys_of(listing, "dsb3") == [
        '"dsb3" . 10.99.0.2 . 443',
        '"dsb3" . 10.1.2.0/24 . 8000-8100',
    ]
    assert keys_of("not json", "dsb3") == []
