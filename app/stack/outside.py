"""A stand-in for the world beyond a node: a network namespace joined to the host by a
veth pair and routed through it, as the internet is. Tests and benchmarks of egress run
their servers in one (no traffic leaves the machine)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass


def _sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


@dataclass(frozen=True)
class Outside:
    """Namespace ``name``, its end ``eth0`` holding ``addresses`` (CIDR), the host's end
    ``veth`` holding ``host_side``/24 and routing to them."""

    name: str
    veth: str
    host_side: str
    addresses: tuple[str, ...]

    @property
    def inside(self) -> list[str]:
        """The prefix that runs a command in the namespace."""
        return ["ip", "netns", "exec", self.name]

    def make(self) -> Outside:
        """Make it afresh (whatever a run cut short left is removed first)."""
        self.remove()
        _sh("ip", "netns", "add", self.name)
        _sh("ip", "link", "add", self.veth, "type", "veth", "peer", "name", "eth0",
            "netns", self.name)  # fmt: skip
        _sh("ip", "addr", "add", f"{self.host_side}/24", "dev", self.veth)
        _sh("ip", "link", "set", self.veth, "up")
        for address in self.addresses:
            _sh(*self.inside, "ip", "addr", "add", address, "dev", "eth0")
        _sh(*self.inside, "ip", "link", "set", "eth0", "up")
        _sh(*self.inside, "ip", "link", "set", "lo", "up")
        _sh(*self.inside, "ip", "route", "add", "default", "via", self.host_side)
        return self

    def remove(self) -> None:
        """Take it away (nothing if it is not there)."""
        subprocess.run(["ip", "link", "del", self.veth], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)
