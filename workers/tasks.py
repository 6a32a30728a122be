"""Celery tasks of a node: validate the request again, hand it to the node.

A body that does not validate is logged and dropped (the scheduler only sends what
it validated, so this means version skew), never retried into a loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from app import metrics
from app.domain.requests import CreateSandbox, DestroySandbox, Exec, ReadFile, WriteFile
from app.taskqueue import NodeTask
from workers import runtime
from workers.celery_app import celery

log = logging.getLogger(__name__)
R = TypeVar("R", bound=BaseModel)


def _run(task: NodeTask, model: type[R], body: str, handler: Callable[[R], None]) -> None:
    try:
        request = model.model_validate_json(body)
    except ValidationError as exc:
        log.error("%s: invalid task body dropped: %s", task, exc)
        metrics.TASKS.labels(task.value, "invalid").inc()
        return
    try:
        handler(request)
    except Exception:
        log.exception("%s failed", task)
        metrics.TASKS.labels(task.value, "error").inc()
        raise
    metrics.TASKS.labels(task.value, "ok").inc()


@celery.task(name=NodeTask.CREATE)
def create(body: str) -> None:
    """Create and start a sandbox."""
    _run(NodeTask.CREATE, CreateSandbox, body, runtime.node().create)


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


@celery.task(name=NodeTask.DESTROY)
def destroy(body: str) -> None:
    """Destroy a sandbox."""
    _run(NodeTask.DESTROY, DestroySandbox, body, runtime.node().destroy)
