"""What a node does for each request. Celery tasks are thin wrappers over this.

Every handler is idempotent: the sandbox id names the container, events carry ids
derived from the request id, and an exec's request id is claimed in Redis before it
runs, so a redelivered task never runs a command twice.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import logging
import os
import shlex
import shutil
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from app import metrics
from app.config import Settings
from app.domain.base import FailReason, StopReason, derived_id, utcnow
from app.domain.events import (
    CommandCompleted,
    CommandPayload,
    FailedPayload,
    FilePayload,
    FileRead,
    FileWritten,
    FreezePayload,
    LastState,
    SandboxFailed,
    SandboxFrozen,
    SandboxStarted,
    SandboxStopped,
    SandboxThawed,
    StartedPayload,
    StoppedPayload,
)
from app.domain.replies import (
    Done,
    ErrorReply,
    ExecOutput,
    FileContent,
    OutputChunk,
    SandboxReady,
)
from app.domain.requests import (
    CreateSandbox,
    DestroySandbox,
    Exec,
    FreezeSandbox,
    KillCommand,
    ReadFile,
    RequestBase,
    ThawSandbox,
    WriteFile,
)
from app.domain.trajectory import RecordedStep
from app.sdk.credentials import Credential
from workers import label
from workers.agent.client import AgentConnection, AgentPool
from workers.agent.errors import AgentError, AgentRefused, AgentTimeout, AgentUnavailable
from workers.agent.protocol import AgentExecResult
from workers.agent.protocol import Output as AgentOutput
from workers.commands import Commands, Job, Running
from workers.container_port import ContainerDriver
from workers.deadlines import Deadlines, Due
from workers.errors import ImageNotFound, NodeError, NoSpace, SandboxCreateFailed, StaleCreate
from workers.events_out import Outlet
from workers.redis_state import Claims, StepGuard, connect
from workers.sandbox_spec import AGENT_BIN_MOUNT, AGENT_SOCKET_NAME, SandboxSpec

if TYPE_CHECKING:
    from workers.warm_pool import WarmPool

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Bytes of each output stream copied into the audit event.
AUDIT_HEAD = 256
#: How long a create waits for the in-sandbox agent to call home.
AGENT_CONNECT_S = 15.0
#: Each replayed command of a trajectory restore gets this long.
RESTORE_COMMAND_TIMEOUT_S = 300.0
#: How long an exec waits for a sandbox's agent (reconnecting after a worker restart).
AGENT_WAIT_S = 10.0


class EgressDisabled(SandboxCreateFailed, PermissionError):
    """A sandbox asked for network on a node that gives none (``allow_egress`` off)."""


class CommandKilled(AgentError):
    """A KillCommand reached the command before it started."""


class CommandInterrupted(NodeError):
    """The node's worker stopped while the command ran (its agent killed it)."""


def _killed_result(running: Running, duration_s: float) -> AgentExecResult:
    """What a killed command answers: SIGKILL, and the output it streamed."""
    return AgentExecResult(
        exit_code=-signal.SIGKILL,
        stdout=bytes(running.stdout),
        stderr=bytes(running.stderr),
        duration_s=duration_s,
    )


def _audit_head(data: bytes) -> str:
    """The start of a command's output as text for the log.

    NUL becomes U+FFFD: Postgres' jsonb refuses ``\\u0000``, and one such event would
    stop the projector (a sandbox printing /proc/*/cmdline did).
    """
    return data[:AUDIT_HEAD].decode(errors="replace").replace("\x00", "\ufffd")


def room_shortage(path: Path, min_free_mb: int) -> str | None:
    """Why the filesystem of ``path`` (or of its nearest existing parent) is too full
    to keep ``min_free_mb`` free, or None."""
    while not path.exists() and path != path.parent:
        path = path.parent
    free_mb = shutil.disk_usage(path).free // 2**20
    if free_mb >= min_free_mb:
        return None
    return f"{path} has {free_mb} MiB free, below the {min_free_mb} MiB kept free"


def _reason_for(exc: Exception) -> FailReason:
    if isinstance(exc, CommandInterrupted):
        return FailReason.INTERRUPTED
    if isinstance(exc, EgressDisabled):
        return FailReason.REFUSED
    if isinstance(exc, NoSpace) or "no space left on device" in str(exc).lower():
        return FailReason.NO_SPACE
    if isinstance(exc, ImageNotFound):
        return FailReason.IMAGE_NOT_FOUND
    if isinstance(exc, AgentTimeout | StaleCreate):
        return FailReason.TIMEOUT
    if isinstance(exc, AgentRefused):
        return FailReason.REFUSED
    if isinstance(exc, AgentUnavailable):
        return FailReason.AGENT_UNAVAILABLE
    if isinstance(exc, NodeError | AgentError):
        return FailReason.RUNTIME_ERROR
    return FailReason.INTERNAL


class _Failed(Enum):
    """What :meth:`Node._by_agent` returns once it has answered its request with the
    failure."""

    ANSWERED = "answered"


@dataclass
class Activity:
    """What a node saw happen in one sandbox."""

    commands: int = 0
    last_command: str | None = None
    last_exit_code: int | None = None
    frozen: bool = False


class Node:
    """One node's sandboxes: Podman, their agents and what the node tells the log."""

    def __init__(
        self,
        settings: Settings,
        node_id: str,
        driver: ContainerDriver,
        agents: AgentPool,
        credential: Credential,
    ) -> None:
        self.settings = settings
        self.node_id = node_id
        self.driver = driver
        self.agents = agents
        #: What this node proves its events with, and checks its tasks against.
        self.credential = credential
        self.outlet = Outlet(settings, credential)
        store = connect(settings.celery_broker_url)
        self.steps = StepGuard(store)
        self.claims = Claims(store, node_id)
        self.sandbox_root = settings.state_dir / "nodes" / node_id / "sandboxes"
        self.agent_dir = settings.state_dir / "agent"
        # Sandboxes being created or destroyed right now: the reconciler leaves them
        # alone, or it would see a half-made or half-removed container as failed.
        self._busy: set[str] = set()
        self._busy_lock = threading.Lock()
        #: When the last transition ended (monotonic): the warm pool refills after a lull.
        self.last_transition = 0.0
        #: Warm containers creates claim (workers/warm_pool.py); None: always cold.
        self.warm: WarmPool | None = None
        # What the node saw happen in each sandbox, for the last state its Stopped
        # records (kept in memory: a restarted worker knows less, and says so).
        self._activity: dict[str, Activity] = {}
        #: Commands in flight, off the Celery pool (workers/commands.py).
        self.commands = Commands(
            self.outlet, settings.node_max_commands, settings.node_max_commands_per_tenant
        )
        #: Ends each sandbox at its TTL deadline (started by the worker's main).
        self.deadlines = Deadlines(self.expire)
        # Removals of expired sandboxes: their processes are already dead, the
        # container's removal must not hold up the next deadline.
        self._reaper = ThreadPoolExecutor(max_workers=4, thread_name_prefix="dsec-ttl")

    @contextmanager
    def busy(self, sandbox_id: str) -> Iterator[None]:
        """Mark a sandbox as in a lifecycle transition."""
        with self._busy_lock:
            self._busy.add(sandbox_id)
        try:
            yield
        finally:
            self._release(sandbox_id)

    def busy_ids(self) -> set[str]:
        """Sandboxes in a lifecycle transition now (being created count as running)."""
        with self._busy_lock:
            return set(self._busy)

    def is_busy(self, sandbox_id: str) -> bool:
        """In a lifecycle transition now."""
        with self._busy_lock:
            return sandbox_id in self._busy

    # --- helpers ----------------------------------------------------------------

    def run_dir(self, sandbox_id: str) -> Path:
        """Host-owned directory mounted read-only at /.dsec/run in the sandbox: named
        after the sandbox, or after a digest of its id where the agent's socket path
        would not fit AF_UNIX's 107 bytes (ids may have 63 characters)."""
        plain = self.sandbox_root / sandbox_id
        if len(os.fsencode(plain / AGENT_SOCKET_NAME)) < 108:
            return plain
        return self.sandbox_root / f"h-{hashlib.sha256(sandbox_id.encode()).hexdigest()[:24]}"

    def _fail(self, request: RequestBase, exc: Exception) -> None:
        reason = _reason_for(exc)
        detail = str(exc)[:1000] or type(exc).__name__
        if reason == FailReason.AGENT_UNAVAILABLE and request.type != "CreateSandbox":
            # No agent: most often the sandbox itself is gone (its memory limit killed
            # PID 1); say that, and why, rather than blame the agent.
            ended = self._why_not_running(request.sandbox_id)
            if ended is not None:
                reason, detail = FailReason.SANDBOX_NOT_RUNNING, ended
        log.warning("%s %s failed: %s: %s", request.type, request.sandbox_id, reason, detail)
        metrics.REFUSALS.labels("node", reason.value).inc()
        self.outlet.event(
            SandboxFailed(
                event_id=derived_id(request.request_id, "failed"),
                **self._envelope(request),
                payload=FailedPayload(
                    request_id=request.request_id,
                    request_type=request.type,
                    reason=reason,
                    detail=detail,
                ),
            )
        )
        self.outlet.reply(
            request.reply_to,
            ErrorReply(
                request_id=request.request_id,
                sandbox_id=request.sandbox_id,
                reason=reason.value,
                detail=detail,
            ),
        )

    def _why_not_running(self, sandbox_id: str) -> str | None:
        """Why the sandbox's container no longer runs; None if it does."""
        try:
            box = self.driver.get(sandbox_id)
        except NodeError:
            return None
        if box is None:
            return f"sandbox {sandbox_id} is gone"
        if box.running:
            return None
        if box.oom_killed:
            return f"sandbox {sandbox_id} ended: out of memory (OOM kill)"
        return f"sandbox {sandbox_id} ended: its container exited with {box.exit_code}"

    def _envelope(self, request: RequestBase) -> dict[str, str]:
        """The envelope of an event this node records about a request's sandbox."""
        return {
            "sandbox_id": request.sandbox_id,
            "node_id": self.node_id,
            "tenant": request.tenant,
            "job_id": request.job_id,
        }

    # --- lifecycle --------------------------------------------------------------

    def check_fresh(self, request: CreateSandbox) -> None:
        """Raise :class:`StaleCreate` for a create sent longer ago than
        ``request_max_age_s``: its trainer has given up waiting (the gate refuses such a
        request at the door; this is one that waited in a dead worker's hands)."""
        waited = (utcnow() - request.sent_at).total_seconds()
        if waited > self.settings.request_max_age_s:
            raise StaleCreate(
                f"sent {waited:.0f}s ago, longer than DSEC_REQUEST_MAX_AGE_S"
                f" ({self.settings.request_max_age_s:g}s): no one waits for it"
            )

    def check_room(self) -> None:
        """Raise :class:`NoSpace` while the node's disk has less free than
        ``node_min_free_mb``: a create refused with that reason beats one that fills
        the disk and breaks the sandboxes already there."""
        short = room_shortage(self.sandbox_root.parent, self.settings.node_min_free_mb)
        if short is not None:
            raise NoSpace(f"node {self.node_id}: {short} (DSEC_NODE_MIN_FREE_MB)")

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
            network=request.network,
            env=dict(request.env),
            labels={
                label.SANDBOX_ID: request.sandbox_id,
                label.TENANT: request.tenant,
                label.JOB: request.job_id,
                label.EXPIRES: expires.isoformat(),
                label.NODE: self.node_id,
            },
            agent_bin_dir=self.agent_dir,
            run_dir=self.run_dir(request.sandbox_id),
        )

    def create(self, request: CreateSandbox, restore: list[str | list[str]] | None = None) -> None:
        """Create and start the sandbox, wait for its agent, say so.

        ``restore``: a trajectory's commands, replayed in order into the fresh sandbox
        before the trainer hears it is ready (rebuilding a lost sandbox's state).
        """
        with self.busy(request.sandbox_id):
            self._create(request, restore or [])

    def _create(self, request: CreateSandbox, restore: list[str | list[str]]) -> None:
        began = time.monotonic()
        spec = self.spec_for(request)
        try:
            self.check_fresh(request)
            if spec.network and not self.settings.allow_egress:
                raise EgressDisabled(
                    f"node {self.node_id} gives no sandbox network (DSEC_ALLOW_EGRESS=false)"
                )
            self.check_room()
            # A claim hands a pre-started container over; None: start one cold.
            claimed = self.warm.claim(spec) if self.warm is not None else None
            if claimed is None:
                spec.run_dir.mkdir(parents=True, exist_ok=True, mode=0o755)
                self.agents.register(request.sandbox_id, spec.run_dir)
                container_id = self.driver.create_and_start(spec)
            else:
                container_id = claimed
            self.agents.connection(request.sandbox_id, AGENT_CONNECT_S).ping()
        except Exception as exc:
            self._fail(request, exc)
            self._discard(request.sandbox_id)
            return
        self.outlet.event(
            SandboxStarted(
                event_id=derived_id(request.request_id, "started"),
                **self._envelope(request),
                payload=StartedPayload(
                    request_id=request.request_id,
                    container_id=container_id,
                    warm=claimed is not None,
                ),
            )
        )
        self.deadlines.watch(
            Due(label.expires_at(spec.labels) or utcnow(), request.sandbox_id, request.tenant,
                request.job_id)
        )  # fmt: skip
        if restore and not self._restore(request, restore):
            return
        self.outlet.reply(
            request.reply_to,
            SandboxReady(
                request_id=request.request_id, sandbox_id=request.sandbox_id, node_id=self.node_id
            ),
        )
        metrics.CREATE_SECONDS.labels(str(claimed is not None).lower()).observe(
            time.monotonic() - began
        )

    def _restore(self, request: CreateSandbox, commands: list[str | list[str]]) -> bool:
        """Replay a trajectory's commands into the new sandbox; False if it broke."""
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
                with self.agents.using(request.sandbox_id, AGENT_WAIT_S) as conn:
                    result = conn.exec(argv, timeout_s=RESTORE_COMMAND_TIMEOUT_S)
            except Exception as exc:
                self._fail(request, exc)
                self.stop(
                    request.sandbox_id, request.tenant, request.job_id, StopReason.FAILED,
                    f"restore of {request.restore_trajectory} broke at command {i}: {exc}",
                )  # fmt: skip
                return False
            self.outlet.event(self._completed(replay, result))
        return True

    def _discard(self, sandbox_id: str) -> bool:
        """Remove the container, its agent listener and run dir; True if it existed."""
        existed = False
        try:
            existed = self.driver.remove(sandbox_id)
        except NodeError:
            log.exception("removing %s", sandbox_id)
        self.agents.unregister(sandbox_id)
        shutil.rmtree(self.run_dir(sandbox_id), ignore_errors=True)
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
        self.deadlines.cancel(sandbox_id)
        last_state = self._last_state(sandbox_id)  # before its cgroups go
        self._discard(sandbox_id)
        self.outlet.event(
            SandboxStopped(
                event_id=derived_id(
                    request.request_id if request else _NS, f"{sandbox_id}:stopped"
                ),
                occurred_at=ended_at or utcnow(),
                sandbox_id=sandbox_id,
                node_id=self.node_id,
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
        usage = self.driver.usage(sandbox_id)
        seen = self._activity.pop(sandbox_id, None)
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
        )

    def _saw(self, sandbox_id: str) -> Activity:
        return self._activity.setdefault(sandbox_id, Activity())

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

        if isinstance(self._by_agent(request, send), _Failed):
            return
        self._saw(request.sandbox_id).frozen = event_type is SandboxFrozen
        self.outlet.event(
            event_type(
                **self._envelope(request),
                payload=FreezePayload(
                    reason=reason, request_id=request.request_id, actor=request.actor
                ),
            )
        )
        self.outlet.reply(
            request.reply_to,
            Done(request_id=request.request_id, sandbox_id=request.sandbox_id, detail=reason),
        )

    def expire(self, due: Due) -> bool:
        """The sandbox's time is up (on the deadlines thread): kill every process of
        it now, remove it on a reaper thread. False if it is in another transition
        (asked again shortly)."""
        with self._busy_lock:
            if due.sandbox_id in self._busy:
                return False
            self._busy.add(due.sandbox_id)
        try:
            killed = self.driver.kill_processes(due.sandbox_id)
            self._reaper.submit(self._reap, due)
        except BaseException:
            self._release(due.sandbox_id)
            raise
        late_ms = (utcnow() - due.at).total_seconds() * 1000
        log.info(
            "%s: time to live reached, %d processes killed %.1f ms after the deadline",
            due.sandbox_id, killed, late_ms,
        )  # fmt: skip
        return True

    def _reap(self, due: Due) -> None:
        try:
            if self.agents.is_registered(due.sandbox_id):
                self.stop(
                    due.sandbox_id, due.tenant, due.job_id, StopReason.TTL,
                    "time to live reached", ended_at=due.at,
                )  # fmt: skip
        except Exception:
            log.exception("removing %s after its deadline", due.sandbox_id)
        finally:
            self._release(due.sandbox_id)

    def _release(self, sandbox_id: str) -> None:
        with self._busy_lock:
            self._busy.discard(sandbox_id)
            self.last_transition = time.monotonic()

    def destroy(self, request: DestroySandbox) -> None:
        """Destroy on request; a second destroy is answered without a second Stopped."""
        with self.busy(request.sandbox_id):
            # One inspect, not a listing: at thousands of sandboxes a listing per destroy
            # made destroys quadratic (3/s at 500 sandboxes here).
            known = self.driver.get(request.sandbox_id) is not None
            if known:
                self.stop(
                    request.sandbox_id,
                    request.tenant,
                    request.job_id,
                    StopReason(request.reason),
                    f"destroyed by {request.actor}",
                    request,
                )
        self.outlet.reply(
            request.reply_to,
            Done(
                request_id=request.request_id,
                sandbox_id=request.sandbox_id,
                detail="destroyed" if known else "already gone",
            ),
        )

    # --- work inside a sandbox --------------------------------------------------

    def exec(self, request: Exec) -> None:
        """Run one command through the sandbox's agent, at most once per request id
        (claim and run on the calling thread)."""
        job = self.admit_exec(request)
        if job is not None:
            job(Running(request.request_id, request.sandbox_id, request.tenant))

    def admit_exec(self, request: Exec, reply_key: bytes | None = None) -> Job | None:
        """Claim an exec (on the task's thread: a worker that dies before this gets the
        task again) and return what is left to do, the command itself or the answer of
        a step another request runs; None if this request ran already. Until that job
        ends the command is recorded as in flight (see :meth:`answer_interrupted`)."""
        if not self.claims.claim(request, reply_key):
            log.info("exec %s already ran on this node; skipping", request.request_id)
            return None
        traj, step = request.trajectory_id, request.step
        replayed = (
            traj is not None
            and step is not None
            and not self.steps.claim(request.tenant, traj, step, str(request.request_id))
        )

        claimed_at = time.monotonic()

        def answering(running: Running) -> None:
            try:
                if replayed:
                    assert traj is not None and step is not None
                    self._answer_claimed_step(request, traj, step)
                else:
                    self._run_exec(request, running)
            finally:
                self.claims.answered(request.request_id)
                metrics.EXEC_SECONDS.observe(time.monotonic() - claimed_at)

        return answering

    def answer_interrupted(self) -> int:
        """Answer the commands a previous worker of this node claimed and never
        answered: its agent connections died with it, and the agents killed those
        commands. Each gets a failure (reason ``interrupted``), never a second run."""
        stranded = self.claims.unanswered()
        for request, key in stranded:
            with self.outlet.answering(request.request_id, key):
                self._exec_failed(
                    request,
                    CommandInterrupted(
                        f"the worker of node {self.node_id} stopped while command"
                        f" {request.request_id} ran or waited; the command was killed"
                    ),
                )
            self.claims.answered(request.request_id)
        return len(stranded)

    def kill_command(self, request: KillCommand) -> None:
        """Kill a command of this sandbox that was claimed here and has not ended; its
        own reply says ``killed``. A command of another sandbox is not found, whoever
        owns it: the scheduler checked the sandbox's owner, not the command's."""
        running = self.commands.find(request.command_id)
        found = running is not None and running.sandbox_id == request.sandbox_id
        if found:
            assert running is not None
            running.kill(request.actor or request.tenant)
        self.outlet.reply(
            request.reply_to,
            Done(
                request_id=request.request_id,
                sandbox_id=request.sandbox_id,
                detail="killed" if found else "not running",
            ),
        )

    def _run_exec(self, request: Exec, running: Running) -> None:
        argv = (
            ["/bin/sh", "-c", request.command]
            if isinstance(request.command, str)
            else request.command
        )
        started = time.monotonic()
        killed_by: str | None = None
        try:
            with self.agents.using(request.sandbox_id, AGENT_WAIT_S) as conn:
                if not running.attach(conn):
                    raise CommandKilled
                result = conn.exec(
                    argv,
                    env=dict(request.env) or None,
                    cwd=request.cwd,
                    timeout_s=request.timeout_s,
                    max_output=request.max_output_bytes,
                    stdin=base64.b64decode(request.stdin_b64),
                    on_output=self._streamer(request, running) if request.stream_output else None,
                )
        except Exception as exc:
            killed_by = running.killed_by  # the kill broke its connection
            if killed_by is None:
                self._exec_failed(request, exc)
                return
            result = _killed_result(running, time.monotonic() - started)
        self._exec_done(request, result, killed_by)

    def _exec_failed(self, request: Exec, exc: Exception) -> None:
        """Answer a command that did not run to its end; its trajectory step is free
        again, so a retry may run it."""
        traj, step = request.trajectory_id, request.step
        if traj is not None and step is not None:
            self.steps.release(request.tenant, traj, step)
        self._fail(request, exc)

    def _exec_done(
        self, request: Exec, result: AgentExecResult, killed_by: str | None = None
    ) -> None:
        """Record and answer a command that ran (``killed_by``: ended by that kill)."""
        completed = self._completed(request, result, killed_by)
        # What a replay of this step answers: kept here until the log has it.
        recorded = RecordedStep.of(completed.payload)
        if recorded is not None and request.trajectory_id is not None:
            self.steps.record(request.tenant, request.trajectory_id, recorded)
        self.outlet.event(completed)
        seen = self._saw(request.sandbox_id)
        seen.commands += 1
        command = (
            request.command if isinstance(request.command, str) else shlex.join(request.command)
        )
        seen.last_command, seen.last_exit_code = command[:200], result.exit_code
        if result.exit_code == -signal.SIGKILL and not result.timed_out and killed_by is None:
            self._end_if_oom(request)
        self.outlet.reply_with_data(
            request.reply_to,
            ExecOutput(
                request_id=request.request_id,
                sandbox_id=request.sandbox_id,
                exit_code=result.exit_code,
                stdout_b64="",
                stderr_b64="",
                duration_ms=result.duration_s * 1000,
                timed_out=result.timed_out,
                stdout_truncated=result.stdout_truncated,
                stderr_truncated=result.stderr_truncated,
                killed=killed_by is not None,
            ),
            {"stdout": result.stdout, "stderr": result.stderr},
        )

    def _completed(
        self, request: Exec, result: AgentExecResult, killed_by: str | None = None
    ) -> CommandCompleted:
        """The log's record of one command that ran. A trajectory command's carries the
        outputs its replays answer with, each cut to what the log keeps
        (``step_output_bytes``: an event must stay within the log's message size)."""
        truncated = result.stdout_truncated or result.stderr_truncated
        stdout_b64 = stderr_b64 = None
        if request.trajectory_id is not None:
            cap = self.settings.step_output_bytes
            truncated |= len(result.stdout) > cap or len(result.stderr) > cap
            stdout_b64 = base64.b64encode(result.stdout[:cap]).decode()
            stderr_b64 = base64.b64encode(result.stderr[:cap]).decode()
        return CommandCompleted(
            event_id=derived_id(request.request_id, "completed"),
            **self._envelope(request),
            payload=CommandPayload(
                request_id=request.request_id,
                actor=request.actor,
                command=request.command,
                exit_code=result.exit_code,
                duration_ms=result.duration_s * 1000,
                stdout_bytes=len(result.stdout),
                stderr_bytes=len(result.stderr),
                stdout_head=_audit_head(result.stdout),
                stderr_head=_audit_head(result.stderr),
                timed_out=result.timed_out,
                truncated=truncated,
                killed_by=killed_by,
                trajectory_id=request.trajectory_id,
                step=request.step,
                stdout_b64=stdout_b64,
                stderr_b64=stderr_b64,
            ),
        )

    def _streamer(self, request: Exec, running: Running) -> Callable[[AgentOutput], None]:
        """Pass a running command's output to its trainer as OutputChunk replies, and
        keep it: a killed command answers with what it streamed."""
        seq = itertools.count()

        def send(output: AgentOutput) -> None:
            (running.stdout if output.stream == 1 else running.stderr).extend(output.data)
            self.outlet.reply(
                request.reply_to,
                OutputChunk(
                    request_id=request.request_id,
                    sandbox_id=request.sandbox_id,
                    seq=next(seq),
                    stream="stdout" if output.stream == 1 else "stderr",
                    data_b64=base64.b64encode(output.data).decode(),
                ),
            )

        return send

    def _answer_claimed_step(self, request: Exec, traj: str, step: int) -> None:
        """A step another request already ran (or runs): answer with its result."""
        recorded = self.steps.wait(request.tenant, traj, step, request.timeout_s + AGENT_WAIT_S)
        if recorded is None:
            self._fail(
                request,
                AgentTimeout(f"trajectory {traj} step {step} is claimed but has no result yet"),
            )
            return
        event, reply = recorded.answer(request, node_id=self.node_id)
        self.outlet.event(event)
        self.outlet.reply(request.reply_to, reply)

    def _end_if_oom(self, request: Exec) -> None:
        """End the sandbox (reason oom) once the kernel's OOM killer has hit it.

        Runs after CommandCompleted and before the reply: the trainer still gets the
        killed command's result (-9), and whatever it sends next (a destroy, say) finds
        the sandbox already stopped instead of racing this stop into a second Stopped.
        The reconciler checks the same counter every round (an OOM in a background
        process) and stops with the same event id, so the log holds one Stopped
        whichever comes first.
        """
        try:
            kills = self.driver.oom_kills(request.sandbox_id)
        except NodeError:
            log.exception("reading the OOM count of %s", request.sandbox_id)
            return
        if kills:
            with self.busy(request.sandbox_id):
                self.stop(
                    request.sandbox_id,
                    request.tenant,
                    request.job_id,
                    StopReason.OOM,
                    f"out of memory: the kernel killed {kills} process(es)",
                )

    def write_file(self, request: WriteFile) -> None:
        """Write a file through the agent (which refuses links and traversal)."""
        data = base64.b64decode(request.data_b64)
        size = self._by_agent(request, lambda c: c.write_file(request.path, data, request.mode))
        if isinstance(size, _Failed):
            return
        self._file_moved(request, size)
        self.outlet.reply(
            request.reply_to,
            Done(
                request_id=request.request_id, sandbox_id=request.sandbox_id, detail=f"{size} bytes"
            ),
        )

    def read_file(self, request: ReadFile) -> None:
        """Read a file through the agent."""
        read = self._by_agent(request, lambda c: c.read_file(request.path, request.max_bytes))
        if isinstance(read, _Failed):
            return
        data, truncated = read
        self._file_moved(request, len(data))
        self.outlet.reply_with_data(
            request.reply_to,
            FileContent(
                request_id=request.request_id,
                sandbox_id=request.sandbox_id,
                data_b64="",
                truncated=truncated,
            ),
            {"data": data},
        )

    def _file_moved(self, request: WriteFile | ReadFile, size: int) -> None:
        """Record that a file crossed the sandbox's boundary."""
        written = isinstance(request, WriteFile)
        kind: type[FileWritten] | type[FileRead] = FileWritten if written else FileRead
        self.outlet.event(
            kind(
                event_id=derived_id(request.request_id, "written" if written else "read"),
                **self._envelope(request),
                payload=FilePayload(
                    request_id=request.request_id, actor=request.actor, path=request.path, size=size
                ),
            )
        )

    def _by_agent(self, request: RequestBase, work: Callable[[AgentConnection], T]) -> T | _Failed:
        """What ``work`` returns, done with the sandbox's agent (waited for while it
        reconnects); if anything fails, the request is answered with the failure and
        :data:`_Failed.ANSWERED` returned."""
        try:
            with self.agents.using(request.sandbox_id, AGENT_WAIT_S) as conn:
                return work(conn)
        except Exception as exc:
            self._fail(request, exc)
            return _Failed.ANSWERED


#: Namespace of ids for facts the node finds on its own (no request behind them).
_NS = uuid.uuid5(uuid.NAMESPACE_URL, "dsec-node")
