"""The container driver port in memory: containers in a dict, no Podman.

For tests of what sits above the driver (the warm pool, the node's handlers and
upkeep). It behaves as ``tests/contracts/test_container_driver.py`` says every driver
does: containers are kept by name, a create is idempotent by name, a name is never
taken twice, only containers labelled ``dsec.sandbox_id`` are listed, and every error
is a :class:`~workers.errors.NodeError` (:class:`ImageNotFound` for a missing image).

It stands for a node whose driver has a cgroup v1 limiter: a create makes the
sandbox's cgroups (kept as their :class:`~workers.containers.limits.Limits`), they can be renamed
and rewritten, and a removal takes them with the container. No process runs: usage is
not known, the OOM killer never strikes, and killing a sandbox's processes ends its
container as SIGKILL would (exit code 137).
"""

from __future__ import annotations

import signal
import threading
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from workers.containers import label
from workers.containers.limits import Limits
from workers.containers.port import (
    ContainerDriver,
    SandboxContainer,
    Usage,
    container_name,
    sandbox_id_of,
)
from workers.containers.spec import SandboxSpec
from workers.errors import ImageNotFound, NodeError

#: The exit code of a container whose PID 1 was SIGKILLed.
KILLED_EXIT_CODE = 128 + signal.SIGKILL


@dataclass
class _Container:
    id: str
    name: str
    image: str
    labels: dict[str, str] = field(default_factory=dict)
    state: str = "running"
    exit_code: int | None = None

    def seen(self) -> SandboxContainer:
        return SandboxContainer(
            sandbox_id=sandbox_id_of(self.name, self.labels),
            container_id=self.id,
            name=self.name,
            image=self.image,
            state=self.state,
            exit_code=self.exit_code,
            oom_killed=False,
            labels=dict(self.labels),
        )


def _short(image: str) -> str:
    # As users write image names (PodmanDriver.list_images drops the prefix too).
    return image.removeprefix("localhost/")


class InMemoryDriver(ContainerDriver):
    """One node's containers and cgroups, in memory. Thread-safe (one lock, no I/O)."""

    can_rename_cgroups = True

    def __init__(
        self, images: Iterable[str], on_start: Callable[[SandboxSpec], None] | None = None
    ) -> None:
        #: The images the node can run; a create of any other raises ImageNotFound.
        self.images = {_short(image) for image in images}
        #: Told of each container started (an agent's double connects from there, as
        #: the agent does when its container starts).
        self.on_start = on_start
        self._containers: dict[str, _Container] = {}
        self._cgroups: dict[str, Limits] = {}
        self._lock = threading.Lock()

    # --- containers ------------------------------------------------------------------

    def create_and_start(self, spec: SandboxSpec) -> str:
        container_id = self._create_and_start(spec)
        if self.on_start is not None:
            self.on_start(spec)
        return container_id

    def _create_and_start(self, spec: SandboxSpec) -> str:
        with self._lock:
            found = self._containers.get(spec.container_name)
            if found is None:
                if _short(spec.image) not in self.images:
                    raise ImageNotFound(f"image {spec.image!r} is not on this node")
                labels = {**spec.labels, label.SANDBOX_ID: spec.sandbox_id}
                found = self._add(spec.container_name, spec.image, labels)
            limits = Limits.of(spec.memory_mb, spec.pids_limit, spec.cpus)
            self._cgroups.setdefault(spec.sandbox_id, limits)
            found.state, found.exit_code = "running", None
            return found.id

    def add(self, name: str, image: str, labels: dict[str, str] | None = None) -> str:
        """A running container made outside the driver (another tool, an older node):
        no cgroups, and listed only if it carries the sandbox label."""
        with self._lock:
            if name in self._containers:
                raise NodeError(f"create {name}: name already in use")
            return self._add(name, image, dict(labels or {})).id

    def _add(self, name: str, image: str, labels: dict[str, str]) -> _Container:
        container = _Container(uuid.uuid4().hex + uuid.uuid4().hex, name, image, labels)
        self._containers[name] = container
        return container

    def get(self, sandbox_id: str) -> SandboxContainer | None:
        with self._lock:
            found = self._containers.get(container_name(sandbox_id))
            return None if found is None else found.seen()

    def list_sandboxes(self) -> list[SandboxContainer]:
        with self._lock:
            return [c.seen() for c in self._containers.values() if label.SANDBOX_ID in c.labels]

    def rename(self, old_id: str, new_id: str) -> None:
        old, new = container_name(old_id), container_name(new_id)
        with self._lock:
            found = self._containers.get(old)
            if found is None:
                raise NodeError(f"rename {old}: no such container")
            if new != old and new in self._containers:
                raise NodeError(f"rename {old}: name {new} already in use")
            del self._containers[old]
            found.name = new
            self._containers[new] = found

    def remove(self, sandbox_id: str) -> bool:
        with self._lock:
            self._cgroups.pop(sandbox_id, None)
            return self._containers.pop(container_name(sandbox_id), None) is not None

    def list_images(self) -> list[str]:
        return sorted(self.images)

    # --- the sandbox's cgroups -------------------------------------------------------

    def limits(self, sandbox_id: str) -> Limits | None:
        """The limits in the sandbox's cgroups, or None if it has none."""
        with self._lock:
            return self._cgroups.get(sandbox_id)

    def rename_cgroups(self, old_id: str, new_id: str) -> None:
        with self._lock:
            if old_id in self._cgroups:
                self._cgroups[new_id] = self._cgroups.pop(old_id)
            elif new_id not in self._cgroups:
                raise NodeError(f"rename cgroups of {old_id} to {new_id}: {old_id} has none")

    def update_limits(self, sandbox_id: str, memory_mb: int, pids: int, cpus: float) -> None:
        with self._lock:
            if sandbox_id not in self._cgroups:
                raise NodeError(f"limits of {sandbox_id}: it has no cgroups")
            self._cgroups[sandbox_id] = Limits.of(memory_mb, pids, cpus)

    def remove_cgroups(self, sandbox_id: str) -> bool:
        with self._lock:
            if self._running(sandbox_id) is not None:
                return False
            self._cgroups.pop(sandbox_id, None)
            return True

    def cgroup_sandbox_ids(self) -> list[str]:
        with self._lock:
            return sorted(self._cgroups)

    def usage(self, sandbox_id: str) -> Usage:
        # A running sandbox here is its PID 1 alone; time and memory are not modelled.
        with self._lock:
            held = sandbox_id in self._cgroups and self._running(sandbox_id) is not None
            return Usage(processes=1 if held else 0, oom_kills=0)

    def oom_kills(self, sandbox_id: str) -> int:
        return 0

    def kill_processes(self, sandbox_id: str) -> int:
        with self._lock:
            found = self._running(sandbox_id)
            if found is None or sandbox_id not in self._cgroups:
                return 0
            found.state, found.exit_code = "exited", KILLED_EXIT_CODE
            return 1

    def _running(self, sandbox_id: str) -> _Container | None:
        found = self._containers.get(container_name(sandbox_id))
        return found if found is not None and found.state == "running" else None
