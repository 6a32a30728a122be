"""The settings of sandboxes' network (``DSEC_*``, part of :class:`app.config.Settings`)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings


class EgressSettings(BaseSettings):
    """What a node gives sandboxes that ask for network (docs/isolation.md)."""

    allow_egress: bool = Field(
        True,
        description=(
            "Nodes give network egress (slirp4netns) to sandboxes created with network=True;"
            " false refuses them. Sandboxes have no network unless they ask either way."
        ),
    )
    egress_pool: str = Field(
        "10.213.0.0/16",
        description=(
            "IPv4 addresses of sandboxes with an egress allowlist (a /30 each, on a"
            " veth of their own): pick a range no site network uses. Same on a host's nodes."
        ),
    )
    egress_max_connections: int = Field(
        256, ge=1, le=65_536, description="Open connections one allowlisted sandbox may hold."
    )
    egress_mbit: int = Field(
        100, ge=1, le=100_000, description="Bandwidth of one allowlisted sandbox, each way, Mbit/s."
    )
    ports_host: str = Field(
        "127.0.0.1",
        description=(
            "Address a node's proxy of exposed ports listens on and its URLs name"
            " (sandbox.expose): the node's address that trainers and browsers reach."
        ),
    )
    ports_port: int = Field(0, ge=0, le=65535, description="Its port (0: any free one, per node).")
    egress_hosts: Path | None = Field(
        None,
        description=(
            "Hosts file the node's sandbox resolver reads before the host's resolver (a"
            " site's internal names); default <state_dir>/egress-hosts."
        ),
    )
    egress_ca_file: Path | None = Field(
        None,
        description=(
            "CA certificates the node trusts, besides the system's, for the TLS it opens"
            " to egress secrets' destinations (a site's internal CA); default"
            " <state_dir>/egress-ca.pem where it exists."
        ),
    )
