"""The Celery side of the contract between the scheduler and the node workers (the
tasks themselves, sealed: :mod:`app.domain.node_tasks`). Every node consumes one queue,
``node.<id>``, for lifecycle and exec alike, with a threads pool: Podman and the
in-sandbox agent are I/O, and one process keeps the agents' connections in one
place. Tasks are idempotent and short (long work is the sandbox's, not the task's).
"""

from __future__ import annotations

from collections.abc import Sequence

import redis
from celery import Celery
from kombu.connection import Connection
from kombu.entity import Queue

from app.config import Settings
from app.errors import ServiceUnavailable


def make_celery(settings: Settings, name: str = "dsec") -> Celery:
    """A Celery app configured the same way on both sides of the queue."""
    celery = Celery(name, broker=settings.celery_broker_url)
    celery.conf.update(
        task_serializer="json",
        accept_content=["json"],
        # acks_late + reject_on_worker_lost: a task whose worker dies is delivered
        # again instead of vanishing; tasks are idempotent, so a repeat is harmless.
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        # Tasks take seconds at most; an hour before Redis redelivers an unacked task
        # leaves room for a slow create without duplicating it. (A longer BRPOP than
        # kombu's 1 s saved an idle worker little and made every worker stop wait
        # for it: 5 s cost each stop ~4 s.)
        broker_transport_options={"visibility_timeout": 3600},
        task_ignore_result=True,
        worker_send_task_events=True,
        task_send_sent_event=True,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
    )
    return celery


class CeleryTaskQueue:
    """The task queue port (:class:`app.ports.TaskQueue`) over Celery and Redis: tasks
    are sent as Celery messages, so a node worker consumes them; :meth:`take` reads one
    as a worker would (operators' tools and the contract suite)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.celery = make_celery(settings)

    def send(self, task: str, queue: str, args: Sequence[str]) -> None:
        self.celery.send_task(task, args=list(args), queue=queue)

    def take(self, queue: str, wait_s: float = 1.0) -> tuple[str, list[str]] | None:
        # kombu is untyped: Connection and Queue are plain calls to it.
        with Connection(self.settings.celery_broker_url) as conn:  # type: ignore[no-untyped-call]
            simple = conn.SimpleQueue(Queue(queue, routing_key=queue))  # type: ignore[no-untyped-call]
            try:
                message = simple.get(block=True, timeout=wait_s)
            except simple.Empty:
                return None
            finally:
                simple.close()
            message.ack()
        args, _kwargs, _embed = message.decode()
        return str(message.headers["task"]), [str(a) for a in args]


def check_broker(settings: Settings) -> None:
    """Redis, the nodes' task queue, answers; :class:`ServiceUnavailable` if not."""
    try:
        redis.Redis.from_url(settings.celery_broker_url, socket_timeout=5).ping()
    except redis.RedisError as exc:
        raise ServiceUnavailable(f"Redis (the nodes' task queue) does not answer: {exc}") from exc
