"""Celery tasks of a node: validate the request again, hand it to the node.

A body that does not validate is logged and dropped (the scheduler only sends what
it validated, so this means version skew), never retried into a loop.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from app import metrics
from app.codec import peek
from app.domain.base import FailReason, derived_id
from app.domain.events import FailedPayload, SandboxFailed
from app.domain.replies import ErrorReply
from app.domain.requests import (
    CreateSandbox,
    DestroySandbox,
    Exec,
    FreezeSandbox,
    ReadFile,
    ReplyTo,
    ThawSandbox,
    WriteFile,
)
from app.taskqueue import NodeTask
from workers import runtime
from workers.celery_app import celery

log = logging.getLogger(__name__)
R = TypeVar("R", bound=BaseModel)


def _refuse(task: NodeTask, body: str, exc: ValidationError) -> None:
    """Say why a task could not be read, so nobody waits for it forever.

    The scheduler only sends what it validated, so this is version skew between the
    scheduler and this node (deploy nodes before the scheduler).
    """
    raw = peek(body.encode())
    detail = f"node cannot read this {task.value} task (version skew?): {exc.errors()[:3]}"
    log.error("%s", detail)
    metrics.TASKS.labels(task.value, "invalid").inc()
    sandbox_id = raw.get("sandbox_id")
    try:
        request_id = uuid.UUID(str(raw.get("request_id")))
    except ValueError:
        return
    if not isinstance(sandbox_id, str):
        return
    node = runtime.node()
    node.outlet.event(
        SandboxFailed(
            event_id=derived_id(request_id, "failed"),
            sandbox_id=sandbox_id,
            node_id=node.node_id,
            tenant=str(raw.get("tenant") or "unknown")[:128],
            job_id=str(raw.get("job_id") or "default")[:128],
            payload=FailedPayload(
                request_id=request_id,
                request_type=str(raw.get("type", "unknown")),
                reason=FailReason.INCOMPATIBLE,
                detail=detail[:1000],
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
        detail=detail[:1000],
    )
    node.outlet.reply(reply_to, reply)


def _run(task: NodeTask, model: type[R], body: str, handler: Callable[[R], None]) -> None:
    try:
        request = model.model_validate_json(body)
    except ValidationError as exc:
        _refuse(task, body, exc)
        return
    try:
        handler(request)
    except Exception:
        log.exception("%s failed", task)
        metrics.TASKS.labels(task.value, "error").inc()
        raise
    metrics.TASKS.labels(task.value, "ok").inc()


@celery.task(name=NodeTask.CREATE)
def create(body: str, restore: str | None = None) -> None:
    """Create and start a sandbox (replaying a trajectory's commands, if given)."""
    commands: list[str | list[str]] = json.loads(restore) if restore else []
    _run(NodeTask.CREATE, CreateSandbox, body, lambda r: runtime.node().create(r, commands))


@celery.task(name=NodeTask.EXEC)
def exec_command(body: str) -> None:
    """Run a command in a sandbox."""
    _run(NodeTask.EXEC, Exec, body, runtime.node().exec)


@celery.task(name=NodeTask.WRITE_FILE)
def write_file(body: str) -> None:
    """Write a file into a sandbox."""
    _run(NodeTask.WRITE_FILE, WriteFile, body, runtime.node().write_file)


@celery.task(name=NodeTask.READ_FILE)
def read_file(body: str) -> None:
    """Read a file from a sandbox."""
    _run(NodeTask.READ_FILE, ReadFile, body, runtime.node().read_file)


@celery.task(name=NodeTask.FREEZE)
def freeze(body: str) -> None:
    """Freeze a sandbox (its trainer's lease lapsed, or it was asked)."""
    _run(NodeTask.FREEZE, FreezeSandbox, body, runtime.node().freeze)


@celery.task(name=NodeTask.THAW)
def thaw(body: str) -> None:
    """Thaw a frozen sandbox."""
    _run(NodeTask.THAW, ThawSandbox, body, runtime.node().thaw)


@celery.task(name=NodeTask.DESTROY)
def destroy(body: str) -> None:
    """Destroy a sandbox."""
    _run(NodeTask.DESTROY, DestroySandbox, body, runtime.node().destroy)
