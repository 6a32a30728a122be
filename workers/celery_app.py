"""The node's Celery app (``celery -A workers.celery_app``)."""

from __future__ import annotations

from app.config import get_settings
from app.taskqueue import make_celery

celery = make_celery(get_settings(), name="dsec-node")
celery.conf.update(include=["workers.tasks"])
