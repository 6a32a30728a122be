"""What the node needs to know to build one sandbox container (no I/O here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from app.domain.egress import NetworkPolicy

#: Where the host-owned, read-only agent directory (binary + static busybox) appears.
AGENT_BIN_MOUNT = "/.dsec/bin"
#: Where the host-owned, read-only per-sandbox run directory (agent socket) appears.
AGENT_RUN_MOUNT = "/.dsec/run"
#: File name of the socket the host listens on inside the run directory.
AGENT_SOCKET_NAME = "agent.sock"
#: The resolver every sandbox is told of (in the agent directory, written by the node):
#: only an allowlisted sandbox's DNS reaches anything (the node's resolver).
RESOLV_CONF = "resolv.conf"
#: Writable working directory inside every sandbox.
WORKDIR = "/workspace"


@dataclass(frozen=True)
class SandboxSpec:
    """A fully resolved sandbox: the container is named after ``sandbox_id``."""

    sandbox_id: str
    image: str
    cpus: float = 1.0
    memory_mb: int = 512
    pids_limit: int = 256
    disk_mb: int = 256
    #: Egress anywhere (slirp4netns); an allowlist is ``egress`` and keeps this False.
    network: bool = False
    egress: NetworkPolicy | None = None
    env: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    agent_bin_dir: Path = Path("/var/lib/dsec/agent")
    run_dir: Path = Path("/var/lib/dsec/run")
    tmp_mb: int = 64

    @property
    def container_name(self) -> str:
        return f"dsec-{self.sandbox_id}"
