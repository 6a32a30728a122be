"""A sandbox's files kept as an image of its tenant (``sandbox.snapshot(name)``).

A sandbox's root is read-only: what it changed lives in its /workspace (a tmpfs), so
a snapshot is its image plus one layer holding that /workspace, built in the shared
store and pushed to the hub under the owner's namespace with the one-repository login
the scheduler sealed for this node (app/domain/hub_access.py, tickets). Forks are
creates of that image: on this host they start from the store at once; elsewhere
nodes pull it.

The workspace is read from the host, through the sandbox's root as its init process
sees it (``/proc/<pid>/root``), while every other process of the sandbox is stopped
(SIGSTOP, as a freeze): nothing in it can swap a directory for a symlink between the
reader's look and its step, and symlinks are archived as links, never followed (a
link to / read from the host would be the host's /). Devices, fifos and sockets are
left out; setuid and setgid bits are dropped.
"""

from __future__ import annotations

import logging
import signal
import tarfile
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from app.config import Settings
from app.domain.hub_access import HubReference, tenant_repository
from app.domain.replies import Done
from app.domain.requests import SnapshotSandbox
from workers.agent.pool import AgentPool
from workers.containers.port import ContainerDriver
from workers.containers.spec import WORKDIR
from workers.courier import Courier
from workers.errors import NodeError, SandboxNotRunning
from workers.failures import AGENT_WAIT_S, Failures
from workers.host.layer_store import store_conf_dir

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from workers.creation import ImageSource

log = logging.getLogger(__name__)

#: Mode bits a snapshot keeps (no setuid, setgid).
_KEPT_MODE = 0o1777


class SnapshotHost(Protocol):
    """What a snapshot needs of its node (:class:`workers.handlers.Node` is one)."""

    node_id: str
    settings: Settings
    driver: ContainerDriver
    agents: AgentPool
    courier: Courier
    failures: Failures
    images: ImageSource | None

    def busy(self, sandbox_id: str) -> AbstractContextManager[None]: ...


def _member(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    """What of one entry a snapshot keeps: files, directories and links, without
    setuid or setgid bits; None drops it."""
    if not (info.isreg() or info.isdir() or info.issym() or info.islnk()):
        return None
    info.mode &= _KEPT_MODE
    return info


def archive_workspace(root: Path, out: Path) -> int:
    """Archive ``root`` (a sandbox's /workspace seen from the host) into ``out``;
    returns the bytes of regular files kept."""
    kept = 0
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT, dereference=False) as tar:
        for child in sorted(root.iterdir()):
            tar.add(child, arcname=child.name, recursive=True, filter=_member)
        kept = sum(m.size for m in tar.getmembers() if m.isreg())
    return kept


class Snapshots:
    """Takes one node's snapshots."""

    def __init__(self, node: SnapshotHost) -> None:
        self.node = node

    def snapshot(self, request: SnapshotSandbox, login: tuple[str, str] | None) -> None:
        """Keep the sandbox's /workspace on its image as the tenant's image and answer
        ``done`` with its name; a failure is answered with its reason."""
        node = self.node
        began = time.monotonic()
        try:
            repository = tenant_repository(request.tenant, request.name)
            if repository is None or login is None or node.images is None:
                raise NodeError("this snapshot has no hub login or no hub to go to")
            ref = HubReference(repository, request.tag)
            with node.busy(request.sandbox_id):
                box = node.driver.get(request.sandbox_id)
                if box is None or not box.running or box.pid is None:
                    raise SandboxNotRunning(f"sandbox {request.sandbox_id} is not running")
                tmp = store_conf_dir(node.settings) / "tmp"
                with tempfile.TemporaryDirectory(dir=tmp, prefix="snapshot-") as staging:
                    tar = Path(staging) / "workspace.tar"
                    self._archive(request, Path(f"/proc/{box.pid}/root{WORKDIR}"), tar)
                    node.images.snapshot(box.image, tar, ref, login)
        except Exception as exc:
            node.failures.fail(request, exc)
            return
        took = time.monotonic() - began
        node.courier.reply(
            request.reply_to,
            Done(request_id=request.request_id, sandbox_id=request.sandbox_id, detail=str(ref)),
        )
        log.info("snapshot of %s as %s in %.2f s", request.sandbox_id, ref, took)

    def _archive(self, request: SnapshotSandbox, workspace: Path, out: Path) -> None:
        """The workspace archived while the sandbox's processes are stopped."""
        with self.node.agents.using(request.sandbox_id, AGENT_WAIT_S) as conn:
            if not conn.concurrent:
                raise NodeError("this sandbox's agent is too old to stop its processes")
            conn.signal_all(signal.SIGSTOP)
            try:
                archive_workspace(workspace, out)
            finally:
                conn.signal_all(signal.SIGCONT)
