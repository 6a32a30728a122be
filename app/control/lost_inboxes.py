"""The inboxes of nodes declared lost, read by a scheduler so that trainers' direct
commands (app/domain/direct.py) sent there are answered: the node will not read them,
and its sandboxes ended with it. :meth:`Dispatcher.answer_for_lost` decides; this
adapter only reads.

A scheduler reads the inbox of a lost node whose id falls on a requests partition it
owns (one reader per node among several schedulers), from the freshness window
before it started reading (older commands are stale for anyone), for
:data:`FOLLOW_S` after the node was last heard from. While no node is lost, no
consumer exists: an idle stack pays nothing for it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from kafka import KafkaConsumer, TopicPartition
from kafka.errors import KafkaError

from app import bus
from app.config import Settings
from app.domain.records import Record

log = logging.getLogger(__name__)

#: How long after a lost node was last heard from its inbox is still read. A direct
#: command sent to one of its sandboxes later waits out its timeout.
FOLLOW_S = 3600.0
#: How long the broker may hold a fetch of these inboxes when nothing comes.
FETCH_WAIT_MS = 5000
#: How long finding the end of a newly followed inbox may take.
POSITION_TIMEOUT_MS = 10_000


class LostInboxes:
    """One consumer over the inboxes of the lost nodes a scheduler answers for."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._consumer: KafkaConsumer | None = None
        self._topics: set[str] = set()

    def poll(self, nodes: Iterable[str]) -> list[Record]:
        """What came on the inboxes of ``nodes`` since the last poll (none waited for)."""
        topics = {self._settings.node_topic(node) for node in nodes}
        if topics != self._topics:
            self._follow(topics)
        if self._consumer is None:
            return []
        try:
            batches = self._consumer.poll(timeout_ms=0, max_records=500)
        except KafkaError as exc:
            log.warning("scheduler: reading lost nodes' inboxes: %s", exc)
            return []
        return [record for records in batches.values() for record in records]

    def _follow(self, topics: set[str]) -> None:
        if not topics:
            self.close()
            return
        if self._consumer is None:
            # A held fetch is answered as soon as a record comes: the long wait costs
            # a trainer nothing, and an idle stack little while a node stays lost.
            self._consumer = bus.make_consumer(self._settings, fetch_max_wait_ms=FETCH_WAIT_MS)
        new = [TopicPartition(t, 0) for t in sorted(topics - self._topics)]
        kept = [TopicPartition(t, 0) for t in sorted(topics & self._topics)]
        self._consumer.assign(kept + new)
        since_ms = int((time.time() - self._settings.request_max_age_s) * 1000)
        try:
            found = self._consumer.offsets_for_times({tp: since_ms for tp in new}) if new else {}
        except KafkaError as exc:
            log.warning("scheduler: finding where lost nodes' inboxes start: %s", exc)
            found = {}
        for tp in new:
            at = found.get(tp)
            if at is not None:
                self._consumer.seek(tp, at.offset)
            else:
                self._consumer.seek_to_end(tp)
                # Fixed now, not at some later poll: the end resolved lazily, after a
                # trainer's command came, would pass over that command unanswered.
                try:
                    self._consumer.position(tp, timeout_ms=POSITION_TIMEOUT_MS)
                except KafkaError as exc:
                    log.warning("scheduler: the end of %s: %s", tp.topic, exc)
        self._topics = topics
        log.info("scheduler: answering for the inboxes of lost nodes %s", sorted(topics))

    def close(self) -> None:
        """Let go of every inbox."""
        if self._consumer is not None:
            self._consumer.close()
        self._consumer = None
        self._topics = set()
