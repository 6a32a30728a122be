"""What the node needs to know to build one sandbox container (no I/O here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

#: Where the host-owned, read-only agent directory (binary + static busybox) appears.
AGENT_BIN_MOUNT = "/.dsec/bin"
#: Where the host-owned, read-only per-sandbox run directory (agent socket) appears.
AGENT_RUN_MOUNT = "/.dsec/run"
#: File name of the socket the host listens on inside the run directory.
AGENT_SOCKET_NAME = "agent.sock"
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
    network: bool = False
    env: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    agent_bin_dir: Path = Path("/var/lib/dsec/agent")
    run_dir: Path = Path("/var/lib/dsec/run")
    tmp_mb: int = 64

    @property
    def container_name(self) -> str:
        return f"dsec-{self.sandbox_id}"
