"""The node: one node's sandboxes, what its handlers share, and its public face.

Celery tasks (workers/tasks.py), the inbox (workers/inbox.py), the upkeep thread and
the warm pool call :class:`Node`; it holds what every handler shares (the driver, the
agents, the courier, the Redis claims, the sandboxes in a transition) and hands each
request to the collaborator that does the work, each seeing the node through a
protocol of what it needs:

- :mod:`workers.creation`: creates, warm or cold, and their trajectory restores;
- :mod:`workers.lifecycle`: freezes, thaws, deadlines, destroys and every Stopped;
- :mod:`workers.exec_path`: commands, from their claim to their answer;
- :mod:`workers.file_ops`: files into and out of a sandbox;
- :mod:`workers.failures`: a request's failure, told to the log and its trainer.

Every handler is idempotent: the sandbox id names the container, events carry ids
derived from the request id, and an exec's request id is claimed in Redis before it
runs, so a redelivered task never runs a command twice.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from app.config import Settings
from app.credentials import Credential
from app.domain.base import utcnow
from app.domain.direct import SandboxKey
from app.domain.egress import EgressSecret
from app.domain.events import PortExposed, PortPayload
from app.domain.replies import Done
from app.domain.requests import (
    CreateSandbox,
    DestroySandbox,
    Exec,
    ExposePort,
    FreezeSandbox,
    KillCommand,
    ReadFile,
    SnapshotSandbox,
    ThawSandbox,
    WriteFile,
)
from workers.agent.pool import AgentPool
from workers.agent.waiter import RoundBatch, Waiter
from workers.commands import Commands, Job
from workers.containers.port import ContainerDriver
from workers.containers.spec import AGENT_SOCKET_NAME
from workers.courier import Courier
from workers.creation import Creation, ImageSource
from workers.deadlines import Deadlines, Due
from workers.errors import EgressDisabled
from workers.exec_path import Activity, ExecPath
from workers.failures import Failed, Failures, envelope
from workers.file_ops import FileOps
from workers.lifecycle import Lifecycle
from workers.memory_state import InMemoryRoutes
from workers.snapshots import Snapshots
from workers.state_port import ClaimStore, RouteStore, StepStore
from workers.tally import NodeTally, NoNodeTally

if TYPE_CHECKING:
    from workers.host.egress import EgressFence
    from workers.ports import PortProxy
    from workers.warm_pool import WarmPool

#: How long a transition's end is remembered for the reconciler: longer than a listing
#: takes, even one made while Podman removes thousands of containers.
ENDED_KEPT_S = 300.0


class Node:
    """One node's sandboxes: Podman, their agents and what the node tells the log."""

    def __init__(
        self,
        settings: Settings,
        node_id: str,
        driver: ContainerDriver,
        agents: AgentPool,
        credential: Credential,
        courier: Courier,
        claims: ClaimStore,
        steps: StepStore,
        tally: NodeTally | None = None,
        routes: RouteStore | None = None,
    ) -> None:
        """The node's adapters come built (``workers/main.py`` is where): its
        container driver, its sandboxes' agents, its courier to Kafka, and its exec
        claims, step guard and direct routes (in Redis)."""
        self.settings = settings
        #: Where the node counts what it does (the worker's main: its metrics).
        self.tally: NodeTally = tally or NoNodeTally()
        self.node_id = node_id
        self.driver = driver
        self.agents = agents
        #: What this node proves its events with, and checks its tasks against.
        self.credential = credential
        self.courier = courier
        self.steps = steps
        self.claims = claims
        #: The sandboxes' direct routes and the revoked credentials (app/domain/direct.py).
        self.routes: RouteStore = routes if routes is not None else InMemoryRoutes()
        self.sandbox_root = settings.state_dir / "nodes" / node_id / "sandboxes"
        self.agent_dir = settings.state_dir / "agent"
        # Sandboxes being created or destroyed right now: the reconciler leaves them
        # alone, or it would see a half-made or half-removed container as failed.
        self._busy: set[str] = set()
        self._busy_lock = threading.Lock()
        # When each recent transition ended (monotonic), oldest first: a reconciler's
        # listing shows a sandbox as it was when the listing began, and one destroyed
        # since must not get its listener back (nor a second end).
        self._ended: dict[str, float] = {}
        #: When the reconciler first saw each sandbox the OOM killer hit while a command
        #: ran there (monotonic; workers/upkeep.py, its thread alone).
        self.oom_seen: dict[str, float] = {}
        #: When the last transition ended (monotonic): the warm pool refills after a lull.
        self.last_transition = 0.0
        #: Warm containers creates claim (workers/warm_pool.py); None: always cold.
        self.warm: WarmPool | None = None
        #: Where images the node lacks come from (the hub); None: nowhere.
        self.images: ImageSource | None = None
        #: Why this node's sandboxes could not be fenced off the node's own addresses
        #: (workers/host/setup.py); None: fenced. Creates asking for network are then
        #: refused: fail closed.
        self.egress_unfenced: str | None = None
        #: Each allowlisted sandbox's interface and firewall share (workers/host/egress.py);
        #: None: this node cannot enforce allowlists, for ``egress_unenforced``.
        self.egress: EgressFence | None = None
        self.egress_unenforced: str | None = "not set up"
        #: The proxy of its sandboxes' exposed ports (workers/ports.py); None: none.
        self.ports: PortProxy | None = None
        #: What the node saw happen in each sandbox, for the last state its Stopped
        #: records (kept in memory: a restarted worker knows less, and says so).
        self.activity: dict[str, Activity] = {}
        #: A request's failure, told to the log and its trainer.
        self.failures = Failures(node_id, self.courier, driver, agents, self.tally)
        #: Waits on the agents' answers to commands started without a thread.
        self.waiter = Waiter()
        #: Commands answered, told to the claims once per round of the waiter's answers.
        self.answered: RoundBatch[str] = self.waiter.batch(claims.answered_many)
        #: Commands in flight, off the Celery pool (workers/commands.py).
        self.commands = Commands(
            self.courier,
            settings.node_max_commands,
            settings.node_max_commands_per_tenant,
            self.tally,
        )
        #: Ends each sandbox at its TTL deadline (started by the worker's main).
        self.deadlines = Deadlines(self.expire)
        self.lifecycle = Lifecycle(self)
        self.creation = Creation(self, self.lifecycle)
        self.execs = ExecPath(self, self.lifecycle)
        self.files = FileOps(node_id, self.courier, self.failures)
        self.snapshots = Snapshots(self)

    @contextmanager
    def busy(self, sandbox_id: str) -> Iterator[None]:
        """Mark a sandbox as in a lifecycle transition."""
        with self._busy_lock:
            self._busy.add(sandbox_id)
        try:
            yield
        finally:
            self.release(sandbox_id)

    def mark_busy(self, sandbox_id: str) -> bool:
        """Mark a sandbox as in a lifecycle transition unless it already is in one;
        False if it was. Checked and marked under one lock: a deadline's removal never
        starts while a create or destroy of the sandbox runs."""
        with self._busy_lock:
            if sandbox_id in self._busy:
                return False
            self._busy.add(sandbox_id)
            return True

    def release(self, sandbox_id: str) -> None:
        """A sandbox's lifecycle transition ended."""
        now = time.monotonic()
        with self._busy_lock:
            self._busy.discard(sandbox_id)
            self.last_transition = now
            self._ended.pop(sandbox_id, None)
            self._ended[sandbox_id] = now
            while self._ended:
                oldest = next(iter(self._ended))
                if now - self._ended[oldest] <= ENDED_KEPT_S:
                    break
                del self._ended[oldest]

    def ended_after(self, sandbox_id: str, since: float) -> bool:
        """A transition of the sandbox ended after ``since`` (monotonic), as far back
        as :data:`ENDED_KEPT_S`."""
        with self._busy_lock:
            return self._ended.get(sandbox_id, -1.0) > since

    def busy_ids(self) -> set[str]:
        """Sandboxes in a lifecycle transition now (being created count as running)."""
        with self._busy_lock:
            return set(self._busy)

    def is_busy(self, sandbox_id: str) -> bool:
        """In a lifecycle transition now."""
        with self._busy_lock:
            return sandbox_id in self._busy

    def run_dir(self, sandbox_id: str) -> Path:
        """Host-owned directory mounted read-only at /.dsec/run in the sandbox: named
        after the sandbox, or after a digest of its id where the agent's socket path
        would not fit AF_UNIX's 107 bytes (ids may have 63 characters)."""
        plain = self.sandbox_root / sandbox_id
        if len(os.fsencode(plain / AGENT_SOCKET_NAME)) < 108:
            return plain
        return self.sandbox_root / f"h-{hashlib.sha256(sandbox_id.encode()).hexdigest()[:24]}"

    # --- what the collaborators do ----------------------------------------------

    def create(
        self,
        request: CreateSandbox,
        restore: list[str | list[str]] | None = None,
        key: SandboxKey | None = None,
        secrets: tuple[EgressSecret, ...] = (),
        image_digest: str | None = None,
    ) -> None:
        """Create and start the sandbox, wait for its agent, say so (``restore``: a
        trajectory's commands replayed into it first; ``key``: its direct route;
        ``secrets``: headers its allowlisted requests carry; ``image_digest``: what
        a tenant's image name means)."""
        self.creation.create(request, restore, key, secrets, image_digest)

    def freeze(self, request: FreezeSandbox) -> None:
        """Stop every process of the sandbox but its agent (SIGSTOP), keeping state."""
        self.lifecycle.freeze(request)

    def thaw(self, request: ThawSandbox) -> None:
        """Let a frozen sandbox's processes run again (SIGCONT)."""
        self.lifecycle.thaw(request)

    def snapshot(self, request: SnapshotSandbox, login: tuple[str, str] | None) -> None:
        """Keep the sandbox's files as an image of its tenant, in the hub."""
        self.snapshots.snapshot(request, login)

    def expose(self, request: ExposePort) -> None:
        """Open a port of the sandbox at a URL (workers/ports.py); answered with it."""
        if self.ports is None:
            self.failures.fail(request, EgressDisabled(f"node {self.node_id} serves no ports"))
            return
        pid = self.failures.by_agent(request, lambda conn: conn.peer_pid)
        if isinstance(pid, Failed):
            return
        try:
            url = self.ports.expose(request.sandbox_id, pid, request.port, request.ttl_s)
        except ValueError as exc:
            self.failures.fail(request, exc)
            return
        self.courier.event(
            PortExposed(
                event_id=request.event_of("exposed"),
                **envelope(request, self.node_id),
                payload=PortPayload(
                    request_id=request.request_id, actor=request.actor, port=request.port,
                    expires_at=utcnow() + timedelta(seconds=request.ttl_s),
                ),
            )
        )  # fmt: skip
        self.courier.reply(
            request.reply_to,
            Done(request_id=request.request_id, sandbox_id=request.sandbox_id, detail=url),
        )

    def expire(self, due: Due) -> bool:
        """The sandbox's time is up: kill its processes now, remove it on a reaper
        thread. False if it is in another transition (asked again shortly)."""
        return self.lifecycle.expire(due)

    def destroy(self, request: DestroySandbox) -> None:
        """Destroy on request; a second destroy is answered without a second Stopped."""
        self.lifecycle.destroy(request)

    def exec(self, request: Exec) -> None:
        """Run one command, at most once per request id, on the calling thread."""
        self.execs.exec(request)

    def admit_exec(self, request: Exec, reply_key: bytes | None = None) -> Job | None:
        """Claim an exec and return what is left to do; None if it ran already."""
        return self.execs.admit_exec(request, reply_key)

    def admit_execs(
        self, commands: list[tuple[Exec, bytes | None]]
    ) -> list[tuple[Exec, bytes | None, Job]]:
        """Claim several execs in one round trip; those left to do, with their jobs."""
        return self.execs.admit_execs(commands)

    def answer_interrupted(self) -> int:
        """Answer (``interrupted``) the commands a previous worker left unanswered."""
        return self.execs.answer_interrupted()

    def kill_command(self, request: KillCommand) -> None:
        """Kill a command of this sandbox that was claimed here and has not ended."""
        self.execs.kill_command(request)

    def write_file(self, request: WriteFile) -> None:
        """Write a file through the agent (which refuses links and traversal)."""
        self.files.write_file(request)

    def read_file(self, request: ReadFile) -> None:
        """Read a file through the agent."""
        self.files.read_file(request)
