"""A sandbox made on a node: cold, or claimed from the warm pool (workers/warm_pool.py),
its agent called home, restored from a trajectory if asked, then announced.

A create is idempotent: the sandbox id names the container and its events carry ids
derived from the request id. It is refused before anything is made when its trainer
gave up on it, when it asks for network the node does not give, or when the node's
disk is too full; a create that fails leaves nothing behind.
"""

from __future__ import annotations

import logging
import shutil
import time
from contextlib import AbstractContextManager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from app.config import Settings
from app.domain.base import StopReason, derived_id, utcnow
from app.domain.direct import SandboxKey
from app.domain.egress import EgressSecret
from app.domain.events import SandboxStarted, StartedPayload
from app.domain.hub_access import HubReference
from app.domain.replies import SandboxReady
from app.domain.requests import CreateSandbox, Exec
from workers.agent.pool import AgentPool
from workers.command_record import command_completed
from workers.containers import label
from workers.containers.port import ContainerDriver
from workers.containers.spec import SandboxSpec
from workers.courier import Courier
from workers.deadlines import Deadlines, Due
from workers.errors import EgressDisabled, ImageNotFound, NoSpace, StaleCreate
from workers.failures import AGENT_WAIT_S, Failures, envelope
from workers.lifecycle import Lifecycle
from workers.state_port import RouteStore
from workers.tally import NodeTally

if TYPE_CHECKING:
    from workers.host.egress import EgressFence
    from workers.warm_pool import WarmPool

log = logging.getLogger(__name__)

#: How long a create waits for the in-sandbox agent to call home.
AGENT_CONNECT_S = 15.0
#: Each replayed command of a trajectory restore gets this long.
RESTORE_COMMAND_TIMEOUT_S = 300.0


class ImageSource(Protocol):
    """Where a node gets an image it lacks (workers/host/hub_client.py: the hub)."""

    def pull(self, image: str, refresh: bool = True) -> float:
        """Bring ``image`` into the node's store; raise ImageNotFound if it cannot."""
        ...

    def pinned(self, image: str, digest: str) -> float:
        """Make the store's ``image`` the content ``digest`` (its first push)."""
        ...

    def holds(self, image: str, digest: str) -> bool:
        """Whether the store's ``image`` is the content ``digest`` already (no pull)."""
        ...

    def forget(self, image: str) -> None:
        """``image`` may be gone from the store (check it again before trusting it)."""
        ...

    def used(self, image: str) -> None:
        """A create names ``image`` (recently used images are evicted last)."""
        ...

    def snapshot(
        self, base: str, workspace: Path, ref: HubReference, login: tuple[str, str]
    ) -> None:
        """Build ``base`` plus a sandbox's /workspace as ``ref`` and push it to the hub."""
        ...


class CreateHost(Protocol):
    """What a create needs of its node (:class:`workers.handlers.Node` is one)."""

    node_id: str
    settings: Settings
    driver: ContainerDriver
    agents: AgentPool
    courier: Courier
    failures: Failures
    deadlines: Deadlines
    tally: NodeTally
    routes: RouteStore
    #: Warm containers a create claims; None: always cold.
    warm: WarmPool | None
    #: Where an image the node lacks comes from; None: nowhere.
    images: ImageSource | None
    #: Why sandbox egress is not fenced here (None: it is).
    egress_unfenced: str | None
    egress: EgressFence | None
    egress_unenforced: str | None
    agent_dir: Path
    sandbox_root: Path

    def run_dir(self, sandbox_id: str) -> Path: ...
    def busy(self, sandbox_id: str) -> AbstractContextManager[None]: ...


def room_shortage(path: Path, min_free_mb: int) -> str | None:
    """Why the filesystem of ``path`` (or of its nearest existing parent) is too full
    to keep ``min_free_mb`` free, or None."""
    while not path.exists() and path != path.parent:
        path = path.parent
    free_mb = shutil.disk_usage(path).free // 2**20
    if free_mb >= min_free_mb:
        return None
    return f"{path} has {free_mb} MiB free, below the {min_free_mb} MiB kept free"


class Creation:
    """Makes one node's sandboxes; ``ends`` removes what a failed create left and stops
    a sandbox whose restore broke."""

    def __init__(self, node: CreateHost, ends: Lifecycle) -> None:
        self.node = node
        self.ends = ends

    def check_fresh(self, request: CreateSandbox) -> None:
        """Raise :class:`StaleCreate` for a create sent longer ago than
        ``request_max_age_s``: its trainer has given up waiting (the gate refuses such a
        request at the door; this is one that waited in a dead worker's hands)."""
        max_age_s = self.node.settings.request_max_age_s
        waited = (utcnow() - request.sent_at).total_seconds()
        if waited > max_age_s:
            raise StaleCreate(
                f"sent {waited:.0f}s ago, longer than DSEC_REQUEST_MAX_AGE_S"
                f" ({max_age_s:g}s): no one waits for it"
            )

    def check_room(self) -> None:
        """Raise :class:`NoSpace` while the node's disk has less free than
        ``node_min_free_mb``: a create refused with that reason beats one that fills
        the disk and breaks the sandboxes already there."""
        node = self.node
        short = room_shortage(node.sandbox_root.parent, node.settings.node_min_free_mb)
        if short is not None:
            raise NoSpace(f"node {node.node_id}: {short} (DSEC_NODE_MIN_FREE_MB)")

    def spec_for(self, request: CreateSandbox) -> SandboxSpec:
        """The container a create asks for, with the node's mounts and labels."""
        expires = utcnow() + timedelta(seconds=request.ttl_s)
        return SandboxSpec(
            sandbox_id=request.sandbox_id,
            image=request.image,
            cpus=request.cpus,
            memory_mb=request.memory_mb,
            pids_limit=request.pids_limit,
            disk_mb=request.disk_mb,
            network=request.network is True,
            egress=request.egress,
            env=dict(request.env),
            labels={
                label.SANDBOX_ID: request.sandbox_id,
                label.TENANT: request.tenant,
                label.JOB: request.job_id,
                label.EXPIRES: expires.isoformat(),
                label.NODE: self.node.node_id,
            },
            agent_bin_dir=self.node.agent_dir,
            run_dir=self.node.run_dir(request.sandbox_id),
        )

    def create(
        self,
        request: CreateSandbox,
        restore: list[str | list[str]] | None = None,
        key: SandboxKey | None = None,
        secrets: tuple[EgressSecret, ...] = (),
        image_digest: str | None = None,
    ) -> None:
        """Create and start the sandbox, wait for its agent, say so.

        ``restore``: a trajectory's commands, replayed in order into the fresh sandbox
        before the trainer hears it is ready (rebuilding a lost sandbox's state).
        ``key``: its direct route (app/domain/direct.py), kept before the trainer
        hears the sandbox is ready, so its first direct command finds it.
        ``secrets``: the tenant's egress secrets its allowlist reaches (the node's
        proxy adds them on the way out: workers/egress_proxy.py).
        ``image_digest``: what a tenant's image name means (its first push).
        """
        with self.node.busy(request.sandbox_id):
            self._create(request, restore or [], key, secrets, image_digest)

    def _create(
        self,
        request: CreateSandbox,
        restore: list[str | list[str]],
        key: SandboxKey | None,
        secrets: tuple[EgressSecret, ...],
        image_digest: str | None,
    ) -> None:
        node = self.node
        began = time.monotonic()
        spec = self.spec_for(request)
        try:
            self.check_fresh(request)
            if spec.network and not node.settings.allow_egress:
                raise EgressDisabled(
                    f"node {node.node_id} gives no sandbox network (DSEC_ALLOW_EGRESS=false)"
                )
            if spec.network and node.egress_unfenced is not None:
                raise EgressDisabled(
                    f"node {node.node_id} cannot fence sandbox network off its own"
                    f" addresses ({node.egress_unfenced}): refused rather than unfenced"
                )
            if spec.egress is not None and node.egress is None:
                raise EgressDisabled(
                    f"node {node.node_id} cannot enforce egress allowlists"
                    f" ({node.egress_unenforced}): refused rather than unfenced"
                )
            self.check_room()
            # A claim hands a pre-started container over; None: start one cold. A warm
            # container of a tenant's image serves only if the name still holds the
            # content it was first pushed as (the cold path replaces it otherwise).
            warm = node.warm if node.warm is not None and node.warm.matches(spec) else None
            if warm is not None and image_digest is not None:
                held = node.images is not None and node.images.holds(spec.image, image_digest)
                warm = warm if held else None
            claimed = warm.claim(spec) if warm is not None else None
            if claimed is None:
                spec.run_dir.mkdir(parents=True, exist_ok=True, mode=0o755)
                node.agents.register(request.sandbox_id, spec.run_dir)
                container_id = self._start_cold(spec, image_digest)
            else:
                container_id = claimed
            agent = node.agents.connection(request.sandbox_id, AGENT_CONNECT_S)
            agent.ping()
            if spec.egress is not None and node.egress is not None:
                # The agent's pid is the container's init (AgentPool checks): its netns.
                node.egress.attach(request.sandbox_id, agent.peer_pid, spec.egress, secrets)
        except Exception as exc:
            node.failures.fail(request, exc)
            if node.warm is not None:
                node.warm.abandon(request.sandbox_id)
            self.ends.discard(request.sandbox_id)
            return
        node.courier.event(
            SandboxStarted(
                event_id=request.event_of("started"),
                **envelope(request, node.node_id),
                payload=StartedPayload(
                    request_id=request.request_id,
                    container_id=container_id,
                    warm=claimed is not None,
                    image_digest=image_digest if claimed is None else None,
                ),
            )
        )
        node.deadlines.watch(
            Due(label.expires_at(spec.labels) or utcnow(), request.sandbox_id, request.tenant,
                request.job_id)
        )  # fmt: skip
        if restore and not (self._finish_claim(request) and self._restore(request, restore)):
            return
        if key is not None:
            node.routes.keep(request.sandbox_id, key)
        node.courier.reply(
            request.reply_to,
            SandboxReady(
                request_id=request.request_id, sandbox_id=request.sandbox_id,
                node_id=node.node_id, direct=key is not None,
            ),
        )  # fmt: skip
        # A claimed container's rename is most of a claim's time: the trainer does not
        # wait for it (its commands go through the agent, which has the sandbox's name).
        self._finish_claim(request)
        node.tally.created(claimed is not None, time.monotonic() - began)

    def _finish_claim(self, request: CreateSandbox) -> bool:
        """Give a claimed warm container the sandbox's name (nothing for a cold one);
        False if that failed and the sandbox was ended."""
        if self.node.warm is None:
            return True
        try:
            self.node.warm.finish(request.sandbox_id)
        except Exception as exc:
            log.exception("%s: its warm container could not be renamed", request.sandbox_id)
            self.ends.stop(
                request.sandbox_id, request.tenant, request.job_id, StopReason.FAILED,
                f"its warm container could not be renamed: {exc}",
            )  # fmt: skip
            return False
        return True

    def _start_cold(self, spec: SandboxSpec, digest: str | None) -> str:
        """A new container; an image the node lacks is pulled first where it can be
        (``digest``: a tenant's image is the content its name was first pushed as)."""
        node = self.node
        images = node.images
        if images is not None:
            images.used(spec.image)
            took = images.pinned(spec.image, digest) if digest is not None else 0.0
            if took:
                node.tally.pulled(took)
        try:
            return node.driver.create_and_start(spec)
        except ImageNotFound:
            if images is None:
                raise
        if digest is not None:
            images.forget(spec.image)  # evicted since it was checked
            took = images.pinned(spec.image, digest)
        else:
            took = images.pull(spec.image)
        node.tally.pulled(took)
        return node.driver.create_and_start(spec)

    def _restore(self, request: CreateSandbox, commands: list[str | list[str]]) -> bool:
        """Replay a trajectory's commands into the new sandbox; False if it broke."""
        node = self.node
        for i, command in enumerate(commands):
            replay = Exec(
                request_id=derived_id(request.request_id, f"restore:{i}"),
                sandbox_id=request.sandbox_id,
                tenant=request.tenant,
                job_id=request.job_id,
                actor=f"restore of {request.restore_trajectory}",
                command=command,
                timeout_s=RESTORE_COMMAND_TIMEOUT_S,
            )
            try:
                argv = ["/bin/sh", "-c", command] if isinstance(command, str) else command
                with node.agents.using(request.sandbox_id, AGENT_WAIT_S) as conn:
                    result = conn.exec(argv, timeout_s=RESTORE_COMMAND_TIMEOUT_S)
            except Exception as exc:
                node.failures.fail(request, exc)
                self.ends.stop(
                    request.sandbox_id, request.tenant, request.job_id, StopReason.FAILED,
                    f"restore of {request.restore_trajectory} broke at command {i}: {exc}",
                )  # fmt: skip
                return False
            node.courier.event(
                command_completed(replay, result, node.node_id, node.settings.step_output_bytes)
            )
        return True
