"""The node's one way to Podman: podman-py against the node user's REST socket.

No podman CLI at runtime: mixing it with the API can start a second rootless user
namespace, after which exec into API-created containers fails. Every podman-py and
requests exception is mapped to :mod:`workers.errors` here; callers never see them.

Containers are named ``dsec-<sandbox_id>`` and labelled ``dsec.sandbox_id``, and are
secure by default: no network, all capabilities dropped, no-new-privileges, read-only
root, tmpfs /tmp and /workspace, pids/memory/CPU limits, no tty. The name is what
identifies a sandbox: a warm-pool container is renamed when it is claimed, and its
labels, fixed at create, keep naming its warm slot (workers/warm_pool.py).

Rootless Podman ignores the limits here (cgroup v1, and cgroup v2 with cgroupfs), so
with a :class:`~workers.containers.limits.CgroupLimiter` the driver creates the sandbox's cgroups
first, then ``init``s the container, moves its PID 1 into them and only then starts
it (see :mod:`workers.containers.limits`). The limits are still passed to Podman too, for hosts
where it can apply them; the node's own cgroups are the ones the sandbox ends up in.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import podman
import podman.errors
import requests

from workers.containers import label
from workers.containers.limits import CgroupLimiter, Limits
from workers.containers.podman_api import container_args, from_inspect, from_list
from workers.containers.port import SandboxContainer, Usage, container_name
from workers.containers.spec import (
    AGENT_BIN_MOUNT,
    AGENT_RUN_MOUNT,
    AGENT_SOCKET_NAME,
    SandboxSpec,
)
from workers.errors import ImageNotFound, NodeError, PodmanUnavailable, SandboxCreateFailed
from workers.host.file_lock import file_lock

log = logging.getLogger(__name__)
P = ParamSpec("P")
T = TypeVar("T")

#: What a sandbox runs unless told otherwise: the in-sandbox agent calling home.
DEFAULT_COMMAND: tuple[str, ...] = (
    f"{AGENT_BIN_MOUNT}/dsec-agent",
    f"{AGENT_RUN_MOUNT}/{AGENT_SOCKET_NAME}",
)


class PodmanDriver:
    """Creates, lists and removes sandbox containers on one node's Podman service: the
    real :class:`~workers.containers.port.ContainerDriver`.

    Thread-safe: each thread gets its own podman-py client (HTTP session).
    Without a ``limiter`` only Podman's own limits apply (none on a rootless cgroup v1
    host): the node worker always passes one (:meth:`CgroupLimiter.detect`).
    """

    def __init__(
        self,
        socket_url: str,
        *,
        command: Sequence[str] = DEFAULT_COMMAND,
        timeout_s: float = 60.0,
        limiter: CgroupLimiter | None = None,
        store_lock: Path | None = None,
        revive: Callable[[], object] | None = None,
    ) -> None:
        self.socket_url = socket_url
        self.command = list(command)
        self.timeout_s = timeout_s
        self.limiter = limiter
        # Held shared around calls that read the shared layer store, so root's
        # imports (holding it exclusive) never interleave with them: see
        # app.images.store.store_lock. None: the caller coordinates.
        self.store_lock = store_lock
        # Starts the node's Podman service again when it does not answer (an idempotent
        # call that meets a dead service revives it and tries once more: _reviving).
        self.revive = revive
        self._local = threading.local()

    def _reviving(self, call: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """``call``, once more after reviving the node's Podman service if it did not
        answer (see :mod:`workers.host.podman_watch`). Only for idempotent calls: a create
        (by container name), a removal, a listing or an inspect."""
        try:
            return call(*args, **kwargs)
        except PodmanUnavailable:
            if self.revive is None:
                raise
            self.revive()
            return call(*args, **kwargs)

    # --- sandboxes -----------------------------------------------------------------

    def create_and_start(self, spec: SandboxSpec, command: Sequence[str] | None = None) -> str:
        """Create and start the sandbox's container; return its id.

        Idempotent: a container of that name is reused (started if it is not running).
        A container this call created and could not start is removed again, with its
        cgroups.
        """
        return self._reviving(self._create_and_start, spec, command)

    def _create_and_start(self, spec: SandboxSpec, command: Sequence[str] | None) -> str:
        name = spec.container_name
        with self._reading_store(), self._mapped(SandboxCreateFailed, f"create {name}"):
            client = self._client()
            existing = self._get(client, name)
            if existing is None:
                # The cgroups come first: their directories are mounted into the sandbox.
                self._make_cgroups(spec)
                views = self.limiter.layout.views(spec.sandbox_id) if self.limiter else []
                try:
                    existing = client.containers.create(
                        spec.image, list(command or self.command), **container_args(spec, views)
                    )
                except podman.errors.APIError as exc:
                    # Podman 4.3 answers both a name taken meanwhile (a redelivered
                    # task racing this one) and a missing image with a bare 500; newer
                    # ones with 409/404. Ask rather than parse messages.
                    existing = self._get(client, name)
                    if existing is None:
                        self._remove_cgroups(spec.sandbox_id)
                        if not client.images.exists(spec.image):
                            msg = f"image {spec.image!r} is not on this node"
                            raise ImageNotFound(msg) from exc
                        raise
                else:
                    self._start_new(client, existing, spec)
                    return str(existing.id)
            if existing.status != "running":
                self._make_cgroups(spec)
                self._launch(client, existing, spec.sandbox_id)
            return str(existing.id)

    def remove(self, sandbox_id: str) -> bool:
        """Kill and remove the sandbox's container at once, then its cgroups.

        False if there was no container.
        """
        return self._reviving(self._remove, sandbox_id)

    def _remove(self, sandbox_id: str) -> bool:
        name = container_name(sandbox_id)
        with self._mapped(NodeError, f"remove {name}"):
            for attempt in range(REMOVE_ATTEMPTS):
                response = self._client().api.delete(
                    f"/containers/{name}", params={"force": True, "timeout": 0, "volumes": True}
                )
                # A container whose processes were just killed (its TTL) can be caught
                # between running and exited: Podman then answers 500 "could not be
                # stopped ... container state improper". A moment later it goes.
                if response.status_code != 500 or "could not be stopped" not in response.text:
                    break
                time.sleep(0.05 * (attempt + 1))
            existed: bool = response.status_code != 404
            if existed:
                response.raise_for_status()
        self._remove_cgroups(sandbox_id)
        return existed

    def rename(self, old_id: str, new_id: str) -> None:
        """Rename the container of sandbox ``old_id`` to ``new_id``'s name (a claim).

        Podman renames a running container atomically in its database; the labels stay.
        """
        with self._mapped(NodeError, f"rename {container_name(old_id)}"):
            response = self._client().api.post(
                f"/containers/{container_name(old_id)}/rename",
                params={"name": container_name(new_id)},
            )
            response.raise_for_status()

    @property
    def can_rename_cgroups(self) -> bool:
        """A live sandbox's cgroups can be renamed here (cgroup v1, or no limiter)."""
        return self.limiter is None or self.limiter.layout.renamable

    def rename_cgroups(self, old_id: str, new_id: str) -> None:
        """Rename a live sandbox's cgroups (see :meth:`CgroupLimiter.rename`)."""
        if self.limiter is None:
            return
        try:
            self.limiter.rename(old_id, new_id)
        except (OSError, ValueError) as exc:
            raise NodeError(f"rename cgroups of {old_id} to {new_id}: {exc}") from exc

    def update_limits(self, sandbox_id: str, memory_mb: int, pids: int, cpus: float) -> None:
        """Rewrite a live sandbox's limits in its cgroups (Podman's stay as created)."""
        if self.limiter is None:
            return
        try:
            self.limiter.update(sandbox_id, Limits.of(memory_mb, pids, cpus))
        except (OSError, ValueError) as exc:
            raise NodeError(f"limits of {sandbox_id}: {exc}") from exc

    def list_sandboxes(self) -> list[SandboxContainer]:
        """Every container of this node that carries the sandbox label (warm ones too:
        see :attr:`SandboxContainer.warm`)."""
        return self._reviving(self._list_sandboxes)

    def _list_sandboxes(self) -> list[SandboxContainer]:
        with self._mapped(NodeError, "list sandboxes"):
            client = self._client()
            found = []
            for c in client.containers.list(all=True, filters={"label": label.SANDBOX_ID}):
                attrs = c.attrs
                state = str(attrs.get("State", ""))
                oom = False
                if state not in ("running", "created"):
                    # Only a full inspect says whether the kernel OOM-killed it.
                    try:
                        full = self._inspect_if_there(client, c.id)
                    except podman.errors.APIError as exc:
                        # A Podman service killed while removing it leaves a container
                        # listed but not inspectable ("container not known"): list it as
                        # ended, for the reconciler to remove, rather than let it hide
                        # every other container of the node.
                        log.warning("container %s cannot be inspected: %s", c.id[:12], exc)
                        full = {}
                    if full is None:
                        continue  # removed since the listing (a concurrent destroy)
                    oom = bool(full.get("State", {}).get("OOMKilled"))
                box = from_list(attrs, oom)
                found.append(self._with_cgroup_oom(box))
            return found

    def get(self, sandbox_id: str) -> SandboxContainer | None:
        """The sandbox's container, or None."""
        data = self.inspect(sandbox_id)
        return None if data is None else self._with_cgroup_oom(from_inspect(data))

    def _with_cgroup_oom(self, box: SandboxContainer) -> SandboxContainer:
        # Podman cannot see OOM kills in cgroups it did not make: ask ours.
        if box.oom_killed or self.limiter is None or not box.sandbox_id:
            return box
        try:
            killed = self.limiter.oom_kills(box.sandbox_id) > 0
        except (OSError, ValueError):
            return box
        return dataclasses.replace(box, oom_killed=True) if killed else box

    def inspect(self, sandbox_id: str) -> dict[str, Any] | None:
        """Podman's full inspect document of the sandbox's container, or None (also
        when it is removed during the call)."""
        return self._reviving(self._inspect_sandbox, sandbox_id)

    def _inspect_sandbox(self, sandbox_id: str) -> dict[str, Any] | None:
        with self._mapped(NodeError, f"inspect {container_name(sandbox_id)}"):
            return self._inspect_if_there(self._client(), container_name(sandbox_id))

    def logs(self, sandbox_id: str, tail: int | None = None) -> str | None:
        """What the sandbox's PID 1 wrote (stdout and stderr, capped by Podman), or None."""
        with self._mapped(NodeError, f"logs of {container_name(sandbox_id)}"):
            container = self._get(self._client(), container_name(sandbox_id))
            if container is None:
                return None
            chunks = container.logs(stdout=True, stderr=True, tail=tail)
            raw = chunks if isinstance(chunks, bytes) else b"".join(chunks)
            return raw.decode(errors="replace")

    # --- the node's own cgroups ------------------------------------------------------

    def oom_kills(self, sandbox_id: str) -> int:
        """Processes of the sandbox the kernel's OOM killer killed (0 without a limiter)."""
        if self.limiter is None:
            return 0
        try:
            return self.limiter.oom_kills(sandbox_id)
        except (OSError, ValueError) as exc:
            raise NodeError(f"OOM count of {sandbox_id}: {exc}") from exc

    def usage(self, sandbox_id: str) -> Usage:
        """The sandbox's resource use so far, read from its cgroups (before removal)."""
        if self.limiter is None:
            return Usage()
        try:
            return Usage(
                cpu_s=self.limiter.cpu_usage_s(sandbox_id),
                memory_peak_mb=self.limiter.memory_peak_mb(sandbox_id),
                processes=len(self.limiter.pids(sandbox_id)),
                oom_kills=self.limiter.oom_kills(sandbox_id),
            )
        except (OSError, ValueError):
            log.exception("reading the cgroups of %s", sandbox_id)
            return Usage()

    def kill_processes(self, sandbox_id: str) -> int:
        """SIGKILL every process of the sandbox now (from its cgroup), before a
        removal that takes longer; returns how many were signalled."""
        if self.limiter is None:
            return 0
        killed = 0
        for pid in self.limiter.pids(sandbox_id):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed += 1
        return killed

    def cgroup_sandbox_ids(self) -> list[str]:
        """Sandboxes that have cgroups on this node (the reconciler sweeps leftovers)."""
        if self.limiter is None:
            return []
        try:
            return self.limiter.sandbox_ids()
        except OSError as exc:
            raise NodeError(f"list sandbox cgroups: {exc}") from exc

    def remove_cgroups(self, sandbox_id: str) -> bool:
        """Remove a sandbox's cgroups if no process is left in them."""
        return self._remove_cgroups(sandbox_id, wait_s=0.0)

    def _make_cgroups(self, spec: SandboxSpec) -> None:
        if self.limiter is None:
            return
        limits = Limits.of(spec.memory_mb, spec.pids_limit, spec.cpus)
        try:
            self.limiter.create(spec.sandbox_id, limits)
        except (OSError, ValueError) as exc:
            self._remove_cgroups(spec.sandbox_id)
            raise SandboxCreateFailed(f"cgroups of {spec.sandbox_id}: {exc}") from exc

    def _remove_cgroups(self, sandbox_id: str, wait_s: float = 1.0) -> bool:
        if self.limiter is None:
            return True
        try:
            return self.limiter.remove(sandbox_id, wait_s)
        except (OSError, ValueError):
            log.exception("removing the cgroups of %s", sandbox_id)
            return False

    # --- images and the service ----------------------------------------------------

    def image_exists(self, image: str) -> bool:
        """The node can run ``image`` (its own store or the shared layer store)."""
        with self._reading_store(), self._mapped(NodeError, f"look up image {image}"):
            return bool(self._client().images.exists(image))

    def list_images(self) -> list[str]:
        """Names of the images the node can run, ``localhost/`` dropped as users write them."""
        with self._reading_store(), self._mapped(NodeError, "list images"):
            names: set[str] = set()
            for image in self._client().images.list():
                for n in image.attrs.get("Names") or image.tags or ():
                    names.add(n.removeprefix("localhost/"))
            return sorted(names)

    def ping(self) -> bool:
        """The service answers."""
        try:
            return bool(self._client().ping())
        except (podman.errors.APIError, requests.exceptions.RequestException, OSError):
            return False

    def close(self) -> None:
        """Close this thread's client."""
        client = getattr(self._local, "client", None)
        if client is not None:
            client.close()
            self._local.client = None

    # --- internals -----------------------------------------------------------------

    def _client(self) -> podman.PodmanClient:
        client = getattr(self._local, "client", None)
        if client is None:
            client = podman.PodmanClient(base_url=self.socket_url, timeout=self.timeout_s)
            self._local.client = client
        return client

    @staticmethod
    def _get(client: podman.PodmanClient, name: str) -> Any:
        try:
            return client.containers.get(name)
        except podman.errors.NotFound:
            return None

    @staticmethod
    def _inspect(client: podman.PodmanClient, key: str) -> dict[str, Any] | None:
        response = client.api.get(f"/containers/{key}/json")
        if response.status_code == 404:
            return None
        response.raise_for_status()
        data: dict[str, Any] = response.json()
        return data

    def _inspect_if_there(self, client: podman.PodmanClient, key: str) -> dict[str, Any] | None:
        try:
            return self._inspect(client, key)
        except podman.errors.APIError:
            # Podman 4.3 answers for a container removed during the call with a bare
            # 500 ("does not exist in database"), not 404: ask rather than parse.
            if client.api.get(f"/containers/{key}/exists").status_code == 404:
                return None
            raise

    def _start_new(self, client: podman.PodmanClient, container: Any, spec: SandboxSpec) -> None:
        try:
            self._launch(client, container, spec.sandbox_id)
        except Exception:
            # A container that never ran is of no use to a retry: leave no trace.
            # The original error is the one worth reporting.
            with contextlib.suppress(Exception):
                client.api.delete(
                    f"/containers/{spec.container_name}", params={"force": True, "timeout": 0}
                )
            self._remove_cgroups(spec.sandbox_id)
            raise

    def _launch(self, client: podman.PodmanClient, container: Any, sandbox_id: str) -> None:
        """Start the container; with a limiter, inside the sandbox's cgroups.

        ``init`` runs ``runc create``: PID 1 exists but has not exec'd the agent yet.
        Moving it now means nothing of the sandbox ever runs outside its limits.
        """
        if self.limiter is None:
            container.start()
            return
        response = client.api.post(f"/containers/{container.id}/init")
        # 304: already initialized (a retry after a crash between init and start).
        if response.status_code != 304:
            response.raise_for_status()
        info = self._inspect(client, container.id) or {}
        pid = int((info.get("State") or {}).get("Pid") or 0)
        try:
            self.limiter.attach(sandbox_id, pid)
        except (OSError, ValueError) as exc:
            raise SandboxCreateFailed(f"move {sandbox_id} into its cgroups: {exc}") from exc
        container.start()

    @contextmanager
    def _reading_store(self) -> Iterator[None]:
        if self.store_lock is None:
            yield
            return
        with file_lock(self.store_lock, shared=True):
            yield

    @contextmanager
    def _mapped(self, fallback: type[NodeError], what: str) -> Iterator[None]:
        """Turn podman-py and requests errors into :mod:`workers.errors`."""
        try:
            yield
        except NodeError:
            raise
        except podman.errors.APIError as exc:
            if exc.response is None:  # podman-py wraps connection failures this way
                raise PodmanUnavailable(f"{what}: no Podman at {self.socket_url}: {exc}") from exc
            raise fallback(f"{what}: {exc}") from exc
        except requests.exceptions.RequestException as exc:
            raise PodmanUnavailable(f"{what}: no Podman at {self.socket_url}: {exc}") from exc
        except (podman.errors.PodmanError, ValueError, TypeError, KeyError) as exc:
            raise fallback(f"{what}: {exc}") from exc


#: Tries at removing a container caught between running and exited.
REMOVE_ATTEMPTS = 5
