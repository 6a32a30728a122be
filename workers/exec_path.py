"""The exec path on a node: a command from its claim to its answer.

An exec is claimed by its request id in Redis before it runs (:meth:`ExecPath.admit_exec`),
so a redelivered task never runs a command twice; a trajectory step is claimed too,
and a second request for it waits for the first one's result. The command runs
through the sandbox's agent, its output streamed to the trainer if asked, and ends
in a CommandCompleted for the log and an ExecOutput for the trainer. Also here: a
KillCommand, the commands a previous worker left unanswered, and a sandbox the
kernel's OOM killer hit.
"""

from __future__ import annotations

import base64
import itertools
import logging
import shlex
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial
from typing import Protocol

from app.config import Settings
from app.domain.base import StopReason, utcnow
from app.domain.replies import Done, ExecOutput, OutputChunk
from app.domain.requests import Exec, KillCommand
from app.domain.trajectory import RecordedStep
from workers.agent.errors import AgentError, AgentProtocolError, AgentTimeout
from workers.agent.messages import AgentExecResult, Response
from workers.agent.messages import Output as AgentOutput
from workers.agent.pool import AgentPool
from workers.agent.waiter import RoundBatch, Waiter
from workers.command_record import command_completed, exec_args, killed_result, oom_suspect
from workers.commands import Commands, Finish, Job, Running
from workers.containers.port import ContainerDriver
from workers.courier import Courier
from workers.errors import CommandInterrupted, NodeError, StaleCommand
from workers.failures import AGENT_WAIT_S, Failures
from workers.state_port import ClaimStore, StepStore
from workers.tally import NodeTally

log = logging.getLogger(__name__)

#: Largest stdin (base64) a command started without a thread carries: its request is
#: written on the inbox's thread, and a write that fills the socket would wait there.
INLINE_STDIN_B64 = 64 * 1024


class CommandKilled(AgentError):
    """A KillCommand reached the command before it started."""


@dataclass
class Activity:
    """What a node saw happen in one sandbox."""

    commands: int = 0
    last_command: str | None = None
    last_exit_code: int | None = None
    frozen: bool = False


class ExecHost(Protocol):
    """What the exec path needs of its node (:class:`workers.handlers.Node` is one)."""

    node_id: str
    settings: Settings
    driver: ContainerDriver
    agents: AgentPool
    #: Waits on the answers of the commands started without a thread.
    waiter: Waiter
    #: Commands answered, told to the claims (per round where the waiter answered).
    answered: RoundBatch[str]
    courier: Courier
    claims: ClaimStore
    steps: StepStore
    commands: Commands
    failures: Failures
    tally: NodeTally
    #: What the node saw happen in each sandbox, for the last state its Stopped records.
    activity: dict[str, Activity]

    def busy(self, sandbox_id: str) -> AbstractContextManager[None]: ...


class Ender(Protocol):
    """Ends a sandbox the OOM killer hit (:class:`workers.lifecycle.Lifecycle` is one)."""

    def stop(
        self, sandbox_id: str, tenant: str, job_id: str, reason: StopReason, detail: str = ""
    ) -> None: ...


class ExecPath:
    """Runs one node's commands, at most once per request id."""

    def __init__(self, node: ExecHost, ends: Ender) -> None:
        self.node = node
        self.ends = ends

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
        if not self._fresh(request):
            return None
        return self._job(request, self.node.claims.claim(request, reply_key))

    def admit_execs(
        self, commands: list[tuple[Exec, bytes | None]]
    ) -> list[tuple[Exec, bytes | None, Job]]:
        """:meth:`admit_exec` for several commands read together, claimed in one round
        trip to Redis: those left to do, in order, each with its reply key and job."""
        fresh = [(request, key) for request, key in commands if self._fresh(request)]
        if len(fresh) == 1:
            claimed = [self.node.claims.claim(*fresh[0])]
        else:
            claimed = self.node.claims.claim_many(fresh) if fresh else []
        admitted = []
        for (request, key), won in zip(fresh, claimed, strict=True):
            job = self._job(request, won)
            if job is not None:
                admitted.append((request, key, job))
        return admitted

    def _fresh(self, request: Exec) -> bool:
        """True if the command may still run; a stale one is answered as such."""
        max_age_s = self.node.settings.request_max_age_s
        waited = (utcnow() - request.sent_at).total_seconds()
        if waited > max_age_s:
            # Its claim may be gone by now: running it could run it twice.
            self.node.failures.fail(request, StaleCommand(
                f"sent {waited:.0f}s ago, longer than DSEC_REQUEST_MAX_AGE_S"
                f" ({max_age_s:g}s): no one waits for it"
            ))  # fmt: skip
            return False
        return True

    def _job(self, request: Exec, claimed: bool) -> Job | None:
        """What is left to do for a command once its claim is known (None: it ran)."""
        if not claimed:
            log.info("exec %s already ran on this node; skipping", request.request_id)
            return None
        traj, step = request.trajectory_id, request.step
        replayed = (
            traj is not None
            and step is not None
            and not self.node.steps.claim(request.tenant, traj, step, str(request.request_id))
        )
        return _ExecJob(self, request, replayed)

    def answer_interrupted(self) -> int:
        """Answer the commands a previous worker of this node claimed and never
        answered: its agent connections died with it, and the agents killed those
        commands. Each gets a failure (reason ``interrupted``), never a second run."""
        stranded = self.node.claims.unanswered()
        for field, (request, key) in stranded:
            with self.node.courier.answering(request.request_id, key):
                self._exec_failed(
                    request,
                    CommandInterrupted(
                        f"the worker of node {self.node.node_id} stopped while command"
                        f" {request.request_id} ran or waited; the command was killed"
                    ),
                )
            self.node.claims.answered(field)
        return len(stranded)

    def kill_command(self, request: KillCommand) -> None:
        """Kill a command of this sandbox that was claimed here and has not ended; its
        own reply says ``killed``. A command of another sandbox is not found, whoever
        owns it: the scheduler checked the sandbox's owner, not the command's."""
        running = self.node.commands.find(request.sandbox_id, request.command_id)
        if running is not None:
            running.kill(request.actor or request.tenant)
        self.node.courier.reply(
            request.reply_to,
            Done(
                request_id=request.request_id,
                sandbox_id=request.sandbox_id,
                detail="killed" if running is not None else "not running",
            ),
        )

    def _run_exec(self, request: Exec, running: Running) -> None:
        started = time.monotonic()
        try:
            with self.node.agents.using(request.sandbox_id, AGENT_WAIT_S) as conn:
                if not running.attach(conn):
                    raise CommandKilled
                result = conn.exec(
                    **exec_args(request),
                    on_output=self._streamer(request, running) if request.stream_output else None,
                )
        except Exception as exc:
            self._exec_ended(request, running, None, exc, started)
            return
        self._exec_ended(request, running, result, None, started)

    def begin_exec(self, request: Exec, running: Running, finish: Finish) -> bool:
        """Start a command without a thread of its own: its request written to an idle
        connection of its agent here, its answer waited on by the node's one waiter
        thread, which then calls ``finish`` with the rest (record and answer it). False
        (nothing done) where a thread serves better: no idle connection right now (the
        thread waits for the agent's next), a large stdin (a write that may wait), or
        an agent too old to stream a streamed command."""
        if len(request.stdin_b64) > INLINE_STDIN_B64:
            return False
        agents = self.node.agents
        conn = agents.hold_idle(request.sandbox_id)
        if conn is None:
            return False
        if not conn.concurrent or not running.attach(conn):
            agents.release(request.sandbox_id, conn)
            return False
        agent_request, wait = conn.exec_request(**exec_args(request), stream=request.stream_output)
        started = time.monotonic()

        def answered(response: Response | None, error: AgentError | None) -> None:
            agents.release(request.sandbox_id, conn)
            result = response if isinstance(response, AgentExecResult) else None
            if result is None and error is None:
                error = AgentProtocolError(f"agent answered an exec with {response!r}")
            ended = partial(self._exec_ended, request, running, result, error, started)
            rest = partial(finish, ended)
            if result is not None and oom_suspect(result):
                # Its end may stop the sandbox through Podman (seconds): not on the
                # thread that answers every other command of the node.
                threading.Thread(target=rest, name="dsec-command-oom", daemon=True).start()
            else:
                rest()

        self.node.waiter.watch(
            conn,
            agent_request,
            wait,
            answered,
            self._streamer(request, running) if request.stream_output else None,
        )
        return True

    def _exec_ended(
        self,
        request: Exec,
        running: Running,
        result: AgentExecResult | None,
        error: Exception | None,
        started: float,
    ) -> None:
        """Record and answer a command whose agent answered (``result``) or did not
        (``error``): a failure, unless a kill broke its connection."""
        killed_by: str | None = None
        if result is None:
            killed_by = running.killed_by  # the kill broke its connection
            if killed_by is None:
                self._exec_failed(request, error or AgentError("no answer"))
                return
            result = killed_result(running, time.monotonic() - started)
        self._exec_done(request, result, killed_by)

    def _exec_failed(self, request: Exec, exc: Exception) -> None:
        """Answer a command that did not run to its end; its trajectory step is free
        again, so a retry may run it."""
        traj, step = request.trajectory_id, request.step
        if traj is not None and step is not None:
            self.node.steps.release(request.tenant, traj, step)
        self.node.failures.fail(request, exc)

    def _exec_done(
        self, request: Exec, result: AgentExecResult, killed_by: str | None = None
    ) -> None:
        """Record and answer a command that ran (``killed_by``: ended by that kill)."""
        node = self.node
        completed = command_completed(
            request, result, node.node_id, node.settings.step_output_bytes, killed_by
        )
        # What a replay of this step answers: kept here until the log has it.
        recorded = RecordedStep.of(completed.payload)
        if recorded is not None and request.trajectory_id is not None:
            node.steps.record(request.tenant, request.trajectory_id, recorded)
        node.courier.event(completed)
        seen = node.activity.setdefault(request.sandbox_id, Activity())
        seen.commands += 1
        command = (
            request.command if isinstance(request.command, str) else shlex.join(request.command)
        )
        seen.last_command, seen.last_exit_code = command[:200], result.exit_code
        if killed_by is None and oom_suspect(result):
            self._end_if_oom(request)
        node.courier.reply_with_data(
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

    def _streamer(self, request: Exec, running: Running) -> Callable[[AgentOutput], None]:
        """Pass a running command's output to its trainer as OutputChunk replies, and
        keep it: a killed command answers with what it streamed."""
        seq = itertools.count()

        def send(output: AgentOutput) -> None:
            (running.stdout if output.stream == 1 else running.stderr).extend(output.data)
            self.node.courier.reply(
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

    def _replay_claimed_step(self, request: Exec, traj: str, step: int) -> None:
        """A step another request already ran (or runs): answer with its result."""
        node = self.node
        recorded = node.steps.wait(request.tenant, traj, step, request.timeout_s + AGENT_WAIT_S)
        if recorded is None:
            node.failures.fail(
                request,
                AgentTimeout(f"trajectory {traj} step {step} is claimed but has no result yet"),
            )
            return
        event, reply = recorded.replay(request, node_id=node.node_id)
        node.courier.event(event)
        node.courier.reply(request.reply_to, reply)

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
            kills = self.node.driver.oom_kills(request.sandbox_id)
        except NodeError:
            log.exception("reading the OOM count of %s", request.sandbox_id)
            return
        if kills:
            with self.node.busy(request.sandbox_id):
                self.ends.stop(
                    request.sandbox_id,
                    request.tenant,
                    request.job_id,
                    StopReason.OOM,
                    f"out of memory: the kernel killed {kills} process(es)",
                )


class _ExecJob:
    """A claimed command: run on a thread of its own (called), or started without one
    (:meth:`begin`); either way its claim is answered once it ends."""

    def __init__(self, path: ExecPath, request: Exec, replayed: bool) -> None:
        self._path = path
        self._request = request
        self._replayed = replayed
        self._claimed_at = time.monotonic()

    def __call__(self, running: Running) -> None:
        request = self._request
        try:
            if self._replayed:
                assert request.trajectory_id is not None and request.step is not None
                self._path._replay_claimed_step(request, request.trajectory_id, request.step)
            else:
                self._path._run_exec(request, running)
        finally:
            self._answered()

    def begin(self, running: Running, finish: Finish) -> bool:
        """Start it without a thread (:meth:`ExecPath.begin_exec`); a step answered
        from another request's run waits for that one: on a thread."""
        if self._replayed:
            return False

        def rest(work: Callable[[], None]) -> None:
            def answered() -> None:
                try:
                    work()
                finally:
                    self._answered()

            finish(answered)

        return self._path.begin_exec(self._request, running, rest)

    def _answered(self) -> None:
        node = self._path.node
        node.answered.add(self._request.scope)
        node.tally.executed(time.monotonic() - self._claimed_at)
