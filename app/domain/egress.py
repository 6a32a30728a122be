"""A sandbox's egress allowlist: its wire shape, how a rule reads, which names and
addresses it lets through (no I/O; the node enforces it, workers/host/egress.py).

Deny by default. A rule is ``destination[:ports]``:

- ``pypi.mirror.internal:443``: a host name, enforced as a name: the sandbox learns
  its addresses only from the node's resolver, which answers allowed names alone and
  pins what it answered (only those addresses, on those ports, are let through);
- ``*.example.org:443``: any name under ``example.org`` (not the apex itself);
- ``10.1.2.0/24:80`` or ``10.1.2.3``: IPv4 addresses, as written;
- ports: one (``443``), a range (``8000-8100``) or none/``*`` for all of them.

TCP only (UDP leaves only as DNS to the node's resolver). Whatever a rule says, the
node never lets a sandbox reach loopback, link-local (169.254.169.254 among them),
multicast, the node's own addresses or another sandbox.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated

from pydantic import AfterValidator, Field, SecretStr

from app.domain.base import Message

#: Most rules one policy holds (each becomes a few firewall set elements).
MAX_RULES = 64
ALL_PORTS = (1, 65535)

_LABEL = r"(?!-)[a-z0-9-]{1,63}(?<!-)"
_NAME = re.compile(rf"^(\*\.)?{_LABEL}(\.{_LABEL})*$")

#: Addresses no rule reaches, whatever it says: the answers the resolver never pins
#: and the ranges the node drops before it looks at a sandbox's allowlist.
NEVER = tuple(
    ipaddress.IPv4Network(net)
    for net in ("0.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "224.0.0.0/4", "240.0.0.0/4")
)


@dataclass(frozen=True)
class AllowRule:
    """One parsed rule: a name (``wildcard``: any name under it) or a network, and
    the ports it opens (inclusive)."""

    name: str | None
    network: ipaddress.IPv4Network | None
    wildcard: bool
    ports: tuple[int, int]

    def matches(self, name: str) -> bool:
        """Whether ``name`` (lower case, no trailing dot) is one this rule allows."""
        if self.name is None:
            return False
        if self.wildcard:
            return name.endswith("." + self.name)
        return name == self.name


def parse_rule(text: str) -> AllowRule:
    """Read one rule; ValueError says what is wrong with it."""
    rule = text.strip().lower()
    if not rule or len(rule) > 300:
        raise ValueError(f"egress rule {text!r}: empty or too long")
    if rule.startswith("[") or rule.count(":") > 1:
        raise ValueError(f"egress rule {text!r}: IPv6 destinations are not supported")
    destination, _, port_text = rule.partition(":")
    ports = _ports(text, port_text)
    try:
        network = ipaddress.IPv4Network(destination, strict=False)
    except ValueError:
        network = None
    if network is not None:
        if any(network.subnet_of(never) for never in NEVER):
            raise ValueError(
                f"egress rule {text!r}: {network} is loopback, link-local, multicast or"
                " reserved, which no sandbox reaches"
            )
        return AllowRule(None, network, False, ports)
    if re.fullmatch(r"[0-9./]+", destination):
        raise ValueError(f"egress rule {text!r}: {destination!r} is no IPv4 address or network")
    if len(destination) > 253 or not _NAME.match(destination):
        raise ValueError(f"egress rule {text!r}: {destination!r} is no host name")
    wildcard = destination.startswith("*.")
    name = destination[2:] if wildcard else destination
    if wildcard and "." not in name:
        raise ValueError(f"egress rule {text!r}: a wildcard needs a domain under a suffix")
    return AllowRule(name, None, wildcard, ports)


def _ports(text: str, port_text: str) -> tuple[int, int]:
    if port_text in ("", "*"):
        return ALL_PORTS
    low, _, high = port_text.partition("-")
    try:
        first, last = int(low), int(high or low)
    except ValueError:
        raise ValueError(f"egress rule {text!r}: {port_text!r} is no port or range") from None
    if not 1 <= first <= last <= 65535:
        raise ValueError(f"egress rule {text!r}: ports must be 1-65535, low to high")
    return first, last


def _checked(rules: list[str]) -> list[str]:
    for rule in rules:
        parse_rule(rule)
    return rules


class NetworkPolicy(Message):
    """Network for a sandbox, denied unless a rule allows it (module docstring)."""

    allow: Annotated[list[str], AfterValidator(_checked)] = Field(
        min_length=1,
        max_length=MAX_RULES,
        fail_fast=True,
        description=(
            "Destinations the sandbox may reach over TCP: 'name[:ports]',"
            " '*.domain[:ports]', 'a.b.c.d[/len][:ports]'; ports '443', '8000-8100',"
            " '*' or none for all."
        ),
    )

    def rules(self) -> list[AllowRule]:
        """The rules, parsed."""
        return [parse_rule(rule) for rule in self.allow]

    def ports_for(self, name: str) -> list[tuple[int, int]]:
        """The ports ``name`` is allowed on (empty: the name is not allowed)."""
        clean = name.lower().rstrip(".")
        return [rule.ports for rule in self.rules() if rule.matches(clean)]

    def networks(self) -> list[tuple[ipaddress.IPv4Network, tuple[int, int]]]:
        """The address rules, as written."""
        return [(rule.network, rule.ports) for rule in self.rules() if rule.network is not None]


def pinnable(
    address: ipaddress.IPv4Address, forbidden: tuple[ipaddress.IPv4Network, ...] = ()
) -> bool:
    """Whether the resolver may answer (and pin) ``address`` for an allowed name: never
    loopback, link-local, multicast or reserved, nor ``forbidden`` (the node's own
    addresses, the sandboxes' pool): a name that rebinds to them gets no answer."""
    return not any(address in net for net in (*NEVER, *forbidden))


# --- secrets added on the way out -------------------------------------------------

#: Where the node sends a secret's requests: TLS to this port of its destination,
#: the certificate verified for the destination's name.
SECRET_UPSTREAM_PORT = 443
#: Where the sandbox sends them: plain HTTP to the destination's name (the node's
#: proxy takes it there; nothing crosses the node's own network unencrypted).
SECRET_PLAIN_PORT = 80
#: Most secrets a tenant holds, and the largest value one carries.
MAX_SECRETS = 100
MAX_SECRET_BYTES = 8192
#: Headers that frame a request: the proxy owns them, and no secret sets them.
FRAMING_HEADERS = frozenset(
    {
        "host", "content-length", "transfer-encoding", "connection", "upgrade", "te",
        "trailer", "keep-alive", "proxy-connection", "expect",
    }
)  # fmt: skip
_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,64}$")


def _destination(text: str) -> str:
    name = text.strip().lower().rstrip(".")
    if not _NAME.match(name) or name.startswith("*.") or len(name) > 253:
        raise ValueError(f"secret destination {text!r}: a host name (no wildcard, no port)")
    if re.fullmatch(r"[0-9.]+", name):
        raise ValueError(f"secret destination {text!r}: a host name, not an address")
    return name


def _header(text: str) -> str:
    if not _TOKEN.match(text) or text.lower() in FRAMING_HEADERS:
        raise ValueError(f"secret header {text!r}: a header name, not one that frames a request")
    return text


def _value(value: SecretStr) -> SecretStr:
    raw = value.get_secret_value()
    if not raw or len(raw.encode()) > MAX_SECRET_BYTES:
        raise ValueError(f"a secret's value is 1 to {MAX_SECRET_BYTES} bytes")
    if any((ord(c) < 0x20 and c != "\t") or ord(c) == 0x7F for c in raw):
        raise ValueError("a secret's value holds no line breaks or control characters")
    return value


class EgressSecret(Message):
    """A header the node adds to a tenant's sandboxes' requests to ``destination``
    (the value is hidden from reprs and logs: :class:`pydantic.SecretStr`)."""

    destination: Annotated[str, AfterValidator(_destination)] = Field(
        description="The host name whose requests carry the header (exact, no wildcard)."
    )
    header: Annotated[str, AfterValidator(_header)] = Field(
        description="The header's name, e.g. Authorization."
    )
    value: Annotated[SecretStr, AfterValidator(_value)] = Field(
        description="The header's value; never shown, logged or put in a sandbox."
    )

    def plain(self) -> dict[str, str]:
        """The secret with its value, for sealing it to a node (and nothing else)."""
        return {
            "destination": self.destination,
            "header": self.header,
            "value": self.value.get_secret_value(),
        }


def carries(policy: NetworkPolicy, destination: str) -> bool:
    """Whether a sandbox under ``policy`` gets a secret for ``destination``: its
    allowlist lets it reach the name on the port the node sends the secret to."""
    return any(low <= SECRET_UPSTREAM_PORT <= high for low, high in policy.ports_for(destination))


#: The secrets a sandbox of ``tenant`` under ``policy`` is to carry (the schedulers'
#: store: app/control/egress_secrets.py).
SecretLookup = Callable[[str, NetworkPolicy], list[EgressSecret]]


def no_secrets(tenant: str, policy: NetworkPolicy) -> list[EgressSecret]:
    """What a platform without a secrets store hands over: nothing."""
    return []
