"""Celery tasks of a node: check the scheduler's seal, validate the request again,
hand it to the node.

A task whose seal does not hold under this node's key was not sent by the scheduler
(someone wrote to Redis, or to another node's queue): it is refused, counted and
dead-lettered, and nothing is done. A body that does not validate is logged and
answered as version skew, never retried into a loop.
"""

from __future__ import annotations

import base64
import json
import logging
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import ValidationError

from app.domain.base import MAX_DETAIL, FailReason, event_id
from app.domain.codec import DeadLetterReason, encode, peek
from app.domain.dead_letter import DeadLetter
from app.domain.direct import SandboxKey
from app.domain.events import FailedPayload, SandboxFailed
from app.domain.node_tasks import (
    NODE_WORK,
    VIA_INBOX,
    WORK_OF_TASK,
    NodeTask,
    NodeWork,
    Opened,
    unseal,
)
from app.domain.replies import ErrorReply
from app.domain.requests import (
    CreateSandbox,
    Exec,
    ReplyTo,
    RequestBase,
)
from workers import runtime
from workers.celery_app import celery
from workers.commands import Job, Running

log = logging.getLogger(__name__)
R = TypeVar("R", bound=RequestBase)


def _refuse(task: NodeTask, body: str, exc: ValidationError, opened: Opened) -> None:
    """Say why a task could not be read, so nobody waits for it forever.

    The scheduler only sends what it validated, so this is version skew between the
    scheduler and this node (deploy nodes before the scheduler).
    """
    raw = peek(body.encode())
    detail = f"node cannot read this {task.value} task (version skew?): {exc.errors()[:3]}"
    log.error("%s", detail)
    runtime.node().tally.task(task.value, "invalid")
    sandbox_id = raw.get("sandbox_id")
    try:
        request_id = uuid.UUID(str(raw.get("request_id")))
    except ValueError:
        return
    if not isinstance(sandbox_id, str):
        return
    node = runtime.node()
    node.courier.event(
        SandboxFailed(
            event_id=event_id(request_id, str(raw.get("actor") or ""), "failed"),
            sandbox_id=sandbox_id,
            node_id=node.node_id,
            tenant=str(raw.get("tenant") or "unknown")[:128],
            job_id=str(raw.get("job_id") or "default")[:128],
            payload=FailedPayload(
                request_id=request_id,
                request_type=str(raw.get("type", "unknown")),
                reason=FailReason.INCOMPATIBLE,
                detail=detail[:MAX_DETAIL],
            ),
        )
    )
    try:
        reply_to = ReplyTo.model_validate(raw.get("reply_to"))
    except ValidationError:
        return
    reply = ErrorReply(
        request_id=request_id,
        sandbox_id=sandbox_id,
        reason=FailReason.INCOMPATIBLE.value,
        detail=detail[:MAX_DETAIL],
    )
    with node.courier.answering(request_id, opened.reply_key):
        node.courier.reply(reply_to, reply)


def _unsealed(task: NodeTask, args: tuple[str, ...]) -> Opened | None:
    """The task if the scheduler sealed it, as this task, for this node; else refuse
    it (and answer nobody: what is not proven cannot settle a trainer's request)."""
    node = runtime.node()
    cred = node.credential
    opened = unseal(task, list(args), cred.key_id, cred.secret)
    if isinstance(opened, Opened):
        return opened
    log.error("refusing a %s task: %s", task.value, opened)
    node.tally.task(task.value, "unproven")
    node.tally.forged(f"node {node.node_id}", "task")
    raw = json.dumps(list(args)).encode()
    kept = raw[: node.settings.max_message_bytes // 2]
    letter = DeadLetter(
        consumer=f"node {node.node_id}",
        topic=node.settings.node_queue(node.node_id),
        partition=0,
        offset=-1,
        reason=DeadLetterReason.UNAUTHENTICATED.value,
        detail=f"{task.value}: {opened}"[:MAX_DETAIL],
        original_b64=base64.b64encode(kept).decode(),
        original_size=len(raw),
        original_truncated=len(kept) < len(raw),
        key=None,
    )
    node.courier.publisher.publish(
        node.settings.topic_dead_letters, "", encode(letter), partition=0
    )
    return None


def _run(
    task: NodeTask,
    model: type[R],
    args: tuple[str, ...],
    handler: Callable[[R, Opened], None],
) -> None:
    opened = _unsealed(task, args)
    if opened is None:
        return
    body = opened.envelope.request
    try:
        request = model.model_validate_json(body)
    except ValidationError as exc:
        _refuse(task, body, exc, opened)
        return
    request_id, scope = request.request_id, request.scope
    node = runtime.node()
    # Lifecycle and file tasks are idempotent: one cut short by the worker's death is
    # done again by the next worker (redo_interrupted), not left to Celery's
    # redelivery an hour later. Commands have their own record (workers/redis_state.py).
    held = task not in VIA_INBOX
    try:
        if held:
            node.claims.hold(scope, task.value, list(args))
        with node.courier.answering(request_id, opened.reply_key):
            handler(request, opened)
    except Exception:
        log.exception("%s failed", task)
        node.tally.task(task.value, "error")
        raise
    finally:
        if held:
            node.claims.answered(scope)
    node.tally.task(task.value, "ok")


def _start_command(request: Exec, opened: Opened) -> None:
    start_command(request, opened.reply_key)


def start_command(request: Exec, reply_key: bytes | None) -> None:
    """Claim a command and start it off the calling thread (answered under
    ``reply_key``), whichever route it came by."""
    job = runtime.node().admit_exec(request, reply_key)
    if job is not None:
        _submit(request, reply_key, job)


def start_commands(commands: list[tuple[Exec, bytes | None]]) -> None:
    """Claim commands read together in one round trip, and start them in order (one
    that cannot be started does not hold back the others)."""
    for request, reply_key, job in runtime.node().admit_execs(commands):
        try:
            _submit(request, reply_key, job)
        except Exception:
            log.exception("starting command %s failed", request.request_id)


def _submit(request: Exec, reply_key: bytes | None, job: Job) -> None:
    """Hand a claimed command to the node's commands, answered under ``reply_key``."""
    runtime.node().commands.submit(
        Running(request.request_id, request.sandbox_id, request.tenant), reply_key, job
    )


def _key(request: CreateSandbox, opened: Opened) -> SandboxKey | None:
    """The direct route's key the scheduler handed over with a create, if it did."""
    key_id = opened.envelope.sandbox_key_id
    if opened.sandbox_key is None or key_id is None:
        return None
    return SandboxKey(key_id, opened.sandbox_key, request.tenant, request.actor or request.tenant)


#: What the node does with each task's request (the kinds and their requests:
#: :data:`app.domain.node_tasks.NODE_WORK`).
HANDLERS: dict[NodeTask, Callable[[Any, Opened], None]] = {
    NodeTask.CREATE: lambda r, o: runtime.node().create(
        r, o.envelope.restore or [], _key(r, o), o.secrets, o.envelope.image_digest
    ),
    NodeTask.EXEC: _start_command,
    NodeTask.KILL_COMMAND: lambda r, _e: runtime.node().kill_command(r),
    NodeTask.WRITE_FILE: lambda r, _e: runtime.node().write_file(r),
    NodeTask.READ_FILE: lambda r, _e: runtime.node().read_file(r),
    NodeTask.FREEZE: lambda r, _e: runtime.node().freeze(r),
    NodeTask.THAW: lambda r, _e: runtime.node().thaw(r),
    NodeTask.SNAPSHOT: lambda r, o: runtime.node().snapshot(r, o.hub_login),
    NodeTask.EXPOSE: lambda r, _e: runtime.node().expose(r),
    NodeTask.DESTROY: lambda r, _e: runtime.node().destroy(r),
}


def _do(task: NodeTask, args: tuple[str, ...]) -> None:
    _run(task, WORK_OF_TASK[task].request, args, HANDLERS[task])


def perform(task: NodeTask, args: tuple[str, ...]) -> None:
    """Carry out a task that came on the node's inbox (workers/inbox.py) exactly as
    its Celery task would; raises :class:`KeyError` for a task the inbox does not take."""
    if task not in VIA_INBOX:
        raise KeyError(task)
    _do(task, args)


def carry_out(task: str, args: tuple[str, ...]) -> None:
    """Carry out a task taken from the node's queue (``task``: its wire name) exactly
    as its Celery task would: how a task queue other than Celery's (the in-memory one
    of unit tests) hands the node its work. :class:`ValueError` for an unknown task."""
    _do(NodeTask(task), args)


def redo_interrupted() -> int:
    """Do again the lifecycle and file tasks a previous worker of this node took and
    never finished (it died): all of them are idempotent, and their trainers wait."""
    claims = runtime.node().claims
    held = claims.held()
    for field, (task, args) in held:
        try:
            _do(NodeTask(task), tuple(args))
        except Exception:  # logged by _run; the others must still be done
            continue
        claims.answered(field)  # done (kept under another field by an older worker)
    return len(held)


def _register(work: NodeWork) -> None:
    """The Celery task of ``work``, under its own name."""

    def run(*args: str) -> None:
        _do(work.task, args)

    run.__name__ = run.__qualname__ = work.task.name.lower()
    run.__doc__ = work.summary
    celery.task(name=work.task.value)(run)


for _work in NODE_WORK:
    _register(_work)
