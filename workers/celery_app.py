"""The node's Celery app (``celery -A workers.celery_app``), and giving back the tasks a
dead worker of this node took."""

from __future__ import annotations

import json
import logging

from celery import Celery

from app.config import get_settings
from app.taskqueue import make_celery

log = logging.getLogger(__name__)

celery = make_celery(get_settings(), name="dsec-node")
celery.conf.update(include=["workers.tasks"])


def restore_unacked(queue: str, app: Celery | None = None) -> int:
    """Put back on ``queue`` every task a worker took from it and never acknowledged;
    how many. Only this node's worker consumes its queue, so at its start such a task
    belongs to a worker that died: Redis would hand it out again only after the
    visibility timeout (an hour), and a worker killed while Redis restarts cannot give
    it back itself. Tasks are idempotent, so one the dead worker had half done is
    simply done again."""
    with (app or celery).connection_for_read() as conn:
        channel = conn.default_channel
        qos = channel.qos
        restored = 0
        with channel.conn_or_acquire() as client:
            for tag in client.zrange(qos.unacked_index_key, 0, -1):
                raw = client.hget(qos.unacked_key, tag)
                if raw is None:
                    continue
                try:
                    _message, _exchange, routing_key = json.loads(raw)
                except (ValueError, TypeError):
                    continue
                if routing_key == queue:
                    qos.restore_by_tag(tag, client)
                    restored += 1
    if restored:
        log.warning("queue %s: gave back %d tasks a dead worker had taken", queue, restored)
    return restored
