"""A sandbox's life on a node after its create (workers/creation.py): frozen and
thawed, ended at its deadline or on request, and what its Stopped records of how it
stood.

Each step is idempotent: the sandbox id names the container and events carry ids
derived from the request id, so a destroy done twice appends one Stopped. While a
step runs the sandbox is marked busy on its node, and the reconciler leaves it alone.
"""

from __future__ import annotations

import logging
import shutil
import signal
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from app.domain.base import StopReason, derived_id, utcnow
from app.domain.events import (
    FreezePayload,
    LastState,
    SandboxFrozen,
    SandboxStopped,
    SandboxThawed,
    StoppedPayload,
)
from app.domain.lives import RECONCILER
from app.domain.replies import Done
from app.domain.requests import DestroySandbox, FreezeSandbox, RequestBase, ThawSandbox
from workers.agent.connection import AgentConnection
from workers.agent.pool import AgentPool
from workers.containers.port import ContainerDriver
from workers.containers.spec import AGENT_BIN_MOUNT
from workers.courier import Courier
from workers.deadlines import Deadlines, Due
from workers.errors import NodeError
from workers.exec_path import Activity
from workers.failures import Failed, Failures, envelope
from workers.state_port import RouteStore
from workers.tally import NodeTally

if TYPE_CHECKING:
    from workers.host.egress import EgressFence
    from workers.ports import PortProxy

log = logging.getLogger(__name__)

#: Namespace of ids for facts the node finds on its own (no request behind them).
_NS = uuid.uuid5(uuid.NAMESPACE_URL, "dsec-node")


class LifeHost(Protocol):
    """What a sandbox's lifecycle needs of its node (:class:`workers.handlers.Node` is
    one)."""

    node_id: str
    driver: ContainerDriver
    agents: AgentPool
    courier: Courier
    failures: Failures
    deadlines: Deadlines
    routes: RouteStore
    egress: EgressFence | None
    tally: NodeTally
    ports: PortProxy | None
    #: What the node saw happen in each sandbox, for the last state its Stopped records.
    activity: dict[str, Activity]

    def run_dir(self, sandbox_id: str) -> Path: ...
    def busy(self, sandbox_id: str) -> AbstractContextManager[None]: ...
    def mark_busy(self, sandbox_id: str) -> bool: ...
    def release(self, sandbox_id: str) -> None: ...


class Lifecycle:
    """Freezes, thaws and ends one node's sandboxes."""

    def __init__(self, node: LifeHost) -> None:
        self.node = node
        # Removals of expired sandboxes: their processes are already dead, the
        # container's removal must not hold up the next deadline.
        self._reaper = ThreadPoolExecutor(max_workers=4, thread_name_prefix="dsec-ttl")

    # --- freeze and thaw --------------------------------------------------------

    def freeze(self, request: FreezeSandbox) -> None:
        """Stop every process of the sandbox but its agent (SIGSTOP), keeping state."""
        self._signal_all(request, "STOP", SandboxFrozen, request.reason)

    def thaw(self, request: ThawSandbox) -> None:
        """Let a frozen sandbox's processes run again (SIGCONT)."""
        self._signal_all(request, "CONT", SandboxThawed, "thawed")

    def _signal_all(
        self,
        request: FreezeSandbox | ThawSandbox,
        signal_name: str,
        event_type: type[SandboxFrozen] | type[SandboxThawed],
        reason: str,
    ) -> None:
        # kill(-1) from a child of the agent reaches every process of the sandbox
        # except PID 1 (the agent, which must keep answering) and the caller itself.
        # Portable: no freezer cgroup needed, works on cgroup v1 and v2 alike. An agent
        # of protocol 3 sends it from the request's own handler process (a busybox
        # child would stop its handler too, and the answer with it).
        def send(conn: AgentConnection) -> None:
            if conn.concurrent:
                conn.signal_all(getattr(signal, f"SIG{signal_name}"))
            else:
                argv = [f"{AGENT_BIN_MOUNT}/busybox", "kill", f"-{signal_name}", "-1"]
                conn.exec(argv, timeout_s=10)

        node = self.node
        if isinstance(node.failures.by_agent(request, send), Failed):
            return
        seen = node.activity.setdefault(request.sandbox_id, Activity())
        seen.frozen = event_type is SandboxFrozen
        node.routes.frozen(request.sandbox_id, seen.frozen)
        node.courier.event(
            event_type(
                **envelope(request, node.node_id),
                payload=FreezePayload(
                    reason=reason, request_id=request.request_id, actor=request.actor
                ),
            )
        )
        node.courier.reply(
            request.reply_to,
            Done(request_id=request.request_id, sandbox_id=request.sandbox_id, detail=reason),
        )

    # --- end --------------------------------------------------------------------

    def discard(self, sandbox_id: str) -> bool:
        """Remove the container, its agent listener and run dir; True if it existed."""
        existed = False
        try:
            existed = self.node.driver.remove(sandbox_id)
        except NodeError:
            log.exception("removing %s", sandbox_id)
        self.node.agents.unregister(sandbox_id)
        if self.node.egress is not None:
            self.node.egress.detach(sandbox_id)
        if self.node.ports is not None:
            self.node.ports.close(sandbox_id)
        shutil.rmtree(self.node.run_dir(sandbox_id), ignore_errors=True)
        return existed

    def stop(
        self,
        sandbox_id: str,
        tenant: str,
        job_id: str,
        reason: StopReason,
        detail: str = "",
        request: RequestBase | None = None,
        ended_at: datetime | None = None,
    ) -> None:
        """End a sandbox for ``reason`` and append Stopped with how it stood;
        ``ended_at``: when it ended, if before now (its TTL deadline)."""
        self.node.deadlines.cancel(sandbox_id)
        last_state = self._last_state(sandbox_id)  # before its cgroups go
        if last_state.egress_refused is not None:
            self.node.tally.egress_refused(last_state.egress_refused)
        self.discard(sandbox_id)
        try:
            self.node.routes.ended(sandbox_id, reason.value)
        except NodeError:  # Redis away: its route is refused once the container is gone
            log.exception("marking the direct route of %s ended", sandbox_id)
        self.node.courier.event(
            SandboxStopped(
                event_id=derived_id(
                    request.request_id if request else _NS, f"{sandbox_id}:stopped"
                ),
                occurred_at=ended_at or utcnow(),
                sandbox_id=sandbox_id,
                node_id=self.node.node_id,
                tenant=tenant,
                job_id=job_id,
                payload=StoppedPayload(
                    reason=reason,
                    detail=detail,
                    request_id=request.request_id if request else None,
                    actor=request.actor if request else None,
                    last_state=last_state,
                ),
            )
        )

    def _last_state(self, sandbox_id: str) -> LastState:
        usage = self.node.driver.usage(sandbox_id)
        seen = self.node.activity.pop(sandbox_id, None)
        egress = self.node.egress
        return LastState(
            observed_by="node",
            cpu_s=usage.cpu_s,
            memory_peak_mb=usage.memory_peak_mb,
            processes=usage.processes,
            oom_kills=usage.oom_kills,
            commands=seen.commands if seen else None,
            last_command=seen.last_command if seen else None,
            last_exit_code=seen.last_exit_code if seen else None,
            frozen=seen.frozen if seen else None,
            egress_refused=egress.refused(sandbox_id) if egress is not None else None,
            egress_refused_sample=egress.refused_sample(sandbox_id) if egress is not None else None,
        )

    def expire(self, due: Due) -> bool:
        """The sandbox's time is up (on the deadlines thread): kill every process of
        it now, remove it on a reaper thread. False if it is in another transition
        (asked again shortly)."""
        if not self.node.mark_busy(due.sandbox_id):
            return False
        try:
            killed = self.node.driver.kill_processes(due.sandbox_id)
            self._reaper.submit(self._reap, due)
        except BaseException:
            self.node.release(due.sandbox_id)
            raise
        late_ms = (utcnow() - due.at).total_seconds() * 1000
        log.info(
            "%s: time to live reached, %d processes killed %.1f ms after the deadline",
            due.sandbox_id, killed, late_ms,
        )  # fmt: skip
        return True

    def _reap(self, due: Due) -> None:
        try:
            if self.node.agents.is_registered(due.sandbox_id):
                self.stop(
                    due.sandbox_id, due.tenant, due.job_id, StopReason.TTL,
                    "time to live reached", ended_at=due.at,
                )  # fmt: skip
        except Exception:
            log.exception("removing %s after its deadline", due.sandbox_id)
        finally:
            self.node.release(due.sandbox_id)

    def destroy(self, request: DestroySandbox) -> None:
        """Destroy on request; a second destroy is answered without a second Stopped.

        An orphan's destroy (the scheduler's reconciler: a container no open life
        holds) states no end either: the life it had ended in the log already, or it
        never was one, and a life ends once (app/domain/admission.py)."""
        node = self.node
        with node.busy(request.sandbox_id):
            # One inspect, not a listing: at thousands of sandboxes a listing per destroy
            # made destroys quadratic (3/s at 500 sandboxes here).
            known = node.driver.get(request.sandbox_id) is not None
            if known and request.actor == RECONCILER:
                self.node.deadlines.cancel(request.sandbox_id)
                self.node.activity.pop(request.sandbox_id, None)
                self.discard(request.sandbox_id)
            elif known:
                self.stop(
                    request.sandbox_id,
                    request.tenant,
                    request.job_id,
                    StopReason(request.reason),
                    f"destroyed by {request.actor}",
                    request,
                )
        node.courier.reply(
            request.reply_to,
            Done(
                request_id=request.request_id,
                sandbox_id=request.sandbox_id,
                detail="destroyed" if known else "already gone",
            ),
        )
