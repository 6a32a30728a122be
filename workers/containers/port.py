"""The container driver port: what the node and its warm pool ask of a container driver.

:class:`~workers.containers.podman_driver.PodmanDriver` is the real adapter (rootless Podman);
:class:`~workers.containers.memory_driver.InMemoryDriver` keeps containers in a dict, for tests of
the logic above it. One contract suite, ``tests/contracts/test_container_driver.py``,
states the behaviour both must have.

A driver knows a sandbox by its id: its container is named ``dsec-<sandbox id>`` and
labelled ``dsec.sandbox_id`` (:mod:`workers.containers.label`); the sandbox's cgroups carry the
id too. Every error a driver raises is a :class:`workers.errors.NodeError`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from workers.containers import label
from workers.containers.spec import SandboxSpec


@dataclass(frozen=True)
class Usage:
    """What a sandbox's cgroups say of it (None: not known, e.g. no limiter)."""

    cpu_s: float | None = None
    memory_peak_mb: float | None = None
    processes: int | None = None
    oom_kills: int | None = None


@dataclass(frozen=True)
class SandboxContainer:
    """A sandbox container as the driver reports it."""

    sandbox_id: str
    container_id: str
    name: str
    image: str
    #: Podman's state: created, running, exited, stopped, paused, ...
    state: str
    exit_code: int | None
    #: The kernel's OOM killer killed the container or one of its processes (Podman's
    #: flag, or the sandbox cgroup's OOM kill counter; may be set while it runs).
    oom_killed: bool
    labels: dict[str, str] = field(default_factory=dict)
    #: Its init process on the host (None: not running, or not known).
    pid: int | None = None

    @property
    def running(self) -> bool:
        """The container's process is alive."""
        return self.state == "running"

    @property
    def warm(self) -> bool:
        """A warm-pool container nobody has claimed (still named after its slot)."""
        return label.WARM in self.labels and self.labels.get(label.SANDBOX_ID) == self.sandbox_id

    @property
    def claimed(self) -> bool:
        """A warm-pool container renamed to the sandbox that claimed it: its labels
        still describe the slot, the node's claim record describes the sandbox."""
        return label.WARM in self.labels and self.labels.get(label.SANDBOX_ID) != self.sandbox_id


class ContainerDriver(Protocol):
    """The sandbox containers of one node, and the cgroups that hold them."""

    # --- containers ------------------------------------------------------------------

    def create_and_start(self, spec: SandboxSpec) -> str:
        """Create and start the sandbox's container; return its id. Idempotent by
        name: an existing container of that name is reused (and started). An image
        the node lacks raises :class:`~workers.errors.ImageNotFound`, leaving nothing."""
        ...

    def get(self, sandbox_id: str) -> SandboxContainer | None:
        """The sandbox's container (found by name, whatever its labels), or None."""
        ...

    def list_sandboxes(self) -> list[SandboxContainer]:
        """Every container carrying the ``dsec.sandbox_id`` label, warm ones too."""
        ...

    def rename(self, old_id: str, new_id: str) -> None:
        """Give sandbox ``old_id``'s container ``new_id``'s name; its id and labels stay.
        A name already taken, or no container to rename, raises NodeError."""
        ...

    def remove(self, sandbox_id: str) -> bool:
        """Kill and remove the sandbox's container, then its cgroups; False if there
        was no container (so a second removal is harmless)."""
        ...

    def list_images(self) -> list[str]:
        """Names of the images the node can run, as users write them."""
        ...

    # --- the sandbox's cgroups -------------------------------------------------------

    @property
    def can_rename_cgroups(self) -> bool:
        """A live sandbox's cgroups can be renamed here (a warm pool needs it)."""
        ...

    def rename_cgroups(self, old_id: str, new_id: str) -> None:
        """Rename a live sandbox's cgroups (idempotent once done)."""
        ...

    def update_limits(self, sandbox_id: str, memory_mb: int, pids: int, cpus: float) -> None:
        """Rewrite a live sandbox's memory, pids and CPU limits."""
        ...

    def remove_cgroups(self, sandbox_id: str) -> bool:
        """Remove the sandbox's cgroups if no process is left in them."""
        ...

    def cgroup_sandbox_ids(self) -> list[str]:
        """Sandboxes that have cgroups on this node."""
        ...

    def usage(self, sandbox_id: str) -> Usage:
        """The sandbox's resource use so far (before its removal)."""
        ...

    def oom_kills(self, sandbox_id: str) -> int:
        """Processes of the sandbox the kernel's OOM killer killed."""
        ...

    def kill_processes(self, sandbox_id: str) -> int:
        """SIGKILL every process of the sandbox now; how many were signalled."""
        ...


def container_name(sandbox_id: str) -> str:
    """The name of a sandbox's container (:attr:`SandboxSpec.container_name`)."""
    return f"dsec-{sandbox_id}"


def sandbox_id_of(name: str, labels: dict[str, str]) -> str:
    """The sandbox a container is, from its name rather than its label: a claimed warm
    container was renamed to its sandbox's name, while its labels, fixed at create,
    still name the warm slot."""
    name = name.lstrip("/")
    return name[len("dsec-") :] if name.startswith("dsec-") else labels.get(label.SANDBOX_ID, "")
