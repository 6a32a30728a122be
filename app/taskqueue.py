"""The Celery side of the contract between the scheduler and the node workers (the
tasks themselves, sealed: :mod:`app.domain.node_tasks`). Every node consumes one queue,
``node.<id>``, for lifecycle and exec alike, with a threads pool: Podman and the
in-sandbox agent are I/O, and one process keeps the agents' connections in one
place. Tasks are idempotent and short (long work is the sandbox's, not the task's).
"""

from __future__ import annotations

import redis
from celery import Celery

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
        # leaves room for a slow create without duplicating it.
        broker_transport_options={"visibility_timeout": 3600},
        task_ignore_result=True,
        worker_send_task_events=True,
        task_send_sent_event=True,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
    )
    return celery


def check_broker(settings: Settings) -> None:
    """Redis, the nodes' task queue, answers; :class:`ServiceUnavailable` if not."""
    try:
        redis.Redis.from_url(settings.celery_broker_url, socket_timeout=5).ping()
    except redis.RedisError as exc:
        raise ServiceUnavailable(f"Redis (the nodes' task queue) does not answer: {exc}") from exc
