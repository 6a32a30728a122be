"""How a node tells the world: events to the log, replies to a waiting trainer.

Workers never write Postgres: every fact they know travels through Kafka.
"""

from __future__ import annotations

import threading

from app.bus import Publisher
from app.codec import encode
from app.config import Settings
from app.domain.events import EventBase
from app.domain.replies import ReplyBase
from app.domain.requests import ReplyTo


class Outlet:
    """The node's one Kafka producer (thread-safe, created on first use)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._publisher: Publisher | None = None
        self._lock = threading.Lock()

    @property
    def publisher(self) -> Publisher:
        with self._lock:
            if self._publisher is None:
                self._publisher = Publisher(self.settings)
            return self._publisher

    def event(self, event: EventBase) -> None:
        """Append a fact to the events topic, keyed by its subject."""
        self.publisher.publish(self.settings.topic_events, event.key, encode(event))

    def reply(self, reply_to: ReplyTo | None, reply: ReplyBase) -> None:
        """Answer the trainer, if one waits."""
        if reply_to is not None:
            self.publisher.publish(
                reply_to.topic, reply.sandbox_id, encode(reply), partition=reply_to.partition
            )

    def flush(self) -> None:
        """Wait until everything sent is acknowledged."""
        self.publisher.flush()
