"""The projector: events topic -> Postgres log + projections, exactly once.

Each poll's batch is appended to ``events``, folded into the projections and the
next offsets recorded, all in ONE transaction. On start the consumer seeks to the
offsets stored in Postgres, so a crash anywhere replays at most an uncommitted
batch, whose effects were rolled back with it. Kafka auto-commit is off and no
consumer group is joined (static assignment), so no rebalance callback can run.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kafka.consumer.fetcher import ConsumerRecord
from sqlalchemy.exc import DBAPIError

from app import metrics
from app.bus import Publisher
from app.codec import DeadLetterReason, DecodeError, decode_event
from app.config import Settings
from app.consuming import PositionedConsumer, dead_letter
from app.db import log as event_log
from app.db import projections
from app.db.engine import transaction
from app.errors import StorageRefused

log = logging.getLogger(__name__)

#: How often the projector makes sure the log has partitions for the coming days.
PARTITION_CHECK_S = 3600.0


@dataclass
class BatchOutcome:
    """What one batch did."""

    appended: int = 0
    duplicates: int = 0
    dead: int = 0
    offsets: dict[int, int] = field(default_factory=dict)


class Projector:
    """Moves events from Kafka into Postgres for a set of partitions."""

    def __init__(
        self, settings: Settings, partitions: Sequence[int] | None = None, name: str = "projector"
    ) -> None:
        self.settings = settings
        self.name = name
        self.consumer = PositionedConsumer(settings, settings.topic_events, name, partitions)
        self.publisher = Publisher(settings)
        self._stop = threading.Event()
        with transaction(settings.database_url) as conn:
            event_log.ensure_partitions(conn)
            stored = event_log.load_offsets(conn, name, settings.topic_events)
        self.warnings = self.consumer.seek(stored)
        self._partitions_checked = time.monotonic()

    def handle(self, records: list[ConsumerRecord]) -> BatchOutcome:
        """Decode, dead-letter, append and project one batch in one transaction."""
        outcome = BatchOutcome()
        good: list[event_log.SourcedEvent] = []
        sources: dict[int, ConsumerRecord] = {}
        for record in records:
            outcome.offsets[record.partition] = record.offset + 1
            try:
                event = decode_event(record.value or b"", self.settings.max_message_bytes)
            except DecodeError as exc:
                dead_letter(
                    self.publisher, self.settings, self.name, record, exc.reason, exc.detail
                )
                metrics.DEAD_LETTERS.labels(self.name, exc.reason.value).inc()
                outcome.dead += 1
                continue
            item = event_log.SourcedEvent(
                event, record.topic, self.consumer.topic_id, record.partition, record.offset
            )
            good.append(item)
            sources[id(item)] = record
        if outcome.dead:
            # Dead letters are flushed before the offsets move past them: a crash in
            # between sends a letter twice, never zero times.
            self.publisher.flush()
        try:
            appended = self._commit(good, outcome.offsets)
        except StorageRefused as exc:
            # One event the database cannot store (it passed validation, but e.g.
            # jsonb refuses a NUL character) must not stop the log: find it, event by
            # event, and dead-letter it; the others are appended as usual.
            log.warning("%s: batch refused (%s); appending event by event", self.name, exc)
            appended = self._commit_singly(good, outcome, sources)
        outcome.appended = len(appended)
        outcome.duplicates = len(good) - len(appended)
        metrics.EVENTS_APPENDED.inc(outcome.appended)
        metrics.EVENTS_DUPLICATE.inc(outcome.duplicates)
        return outcome

    def _commit(
        self, good: list[event_log.SourcedEvent], offsets: dict[int, int]
    ) -> list[tuple[event_log.SourcedEvent, int]]:
        with metrics.BATCH_SECONDS.time(), transaction(self.settings.database_url) as conn:
            appended = event_log.append(conn, good)
            projections.apply_batch(conn, [(item.event, position) for item, position in appended])
            event_log.save_offsets(
                conn, self.name, self.settings.topic_events, self.consumer.topic_id, offsets
            )
        return appended

    def _commit_singly(
        self,
        good: list[event_log.SourcedEvent],
        outcome: BatchOutcome,
        sources: dict[int, ConsumerRecord],
    ) -> list[tuple[event_log.SourcedEvent, int]]:
        appended: list[tuple[event_log.SourcedEvent, int]] = []
        refused: list[tuple[event_log.SourcedEvent, str]] = []
        with transaction(self.settings.database_url) as conn:
            for item in good:
                savepoint = conn.begin_nested()
                try:
                    one = event_log.append(conn, [item])
                    projections.apply_batch(conn, [(e.event, p) for e, p in one])
                except DBAPIError as exc:
                    savepoint.rollback()
                    refused.append((item, str(exc.orig)[:500]))
                    continue
                savepoint.commit()
                appended.extend(one)
            for item, why in refused:
                dead_letter(
                    self.publisher, self.settings, self.name, sources[id(item)],
                    DeadLetterReason.UNSTORABLE, why,
                )  # fmt: skip
                metrics.DEAD_LETTERS.labels(self.name, DeadLetterReason.UNSTORABLE.value).inc()
            self.publisher.flush()  # before the offsets pass them, as above
            event_log.save_offsets(
                conn, self.name, self.settings.topic_events, self.consumer.topic_id, outcome.offsets
            )
        outcome.dead += len(refused)
        return appended

    def run_once(self, timeout_ms: int = 200) -> BatchOutcome | None:
        """Poll once and handle what came."""
        if time.monotonic() - self._partitions_checked > PARTITION_CHECK_S:
            with transaction(self.settings.database_url) as conn:
                event_log.ensure_partitions(conn)
            self._partitions_checked = time.monotonic()
        records = self.consumer.poll(timeout_ms=timeout_ms)
        return self.handle(records) if records else None

    def run(self) -> None:
        """Until stopped."""
        log.info("%s: consuming %s", self.name, [tp.partition for tp in self.consumer.partitions])
        while not self._stop.is_set():
            try:
                self.run_once()
            except Exception:
                # A database outage must not kill the projector: nothing was
                # committed, so the batch is read again after the seek below.
                log.exception("%s: batch failed; retrying from stored offsets", self.name)
                time.sleep(1.0)
                with transaction(self.settings.database_url) as conn:
                    stored = event_log.load_offsets(conn, self.name, self.settings.topic_events)
                self.consumer.seek(stored)
        self.consumer.close()
        self.publisher.close()

    def stop(self, *_: object) -> None:
        """Ask the loop to finish after the current batch."""
        self._stop.set()


def main(settings: Settings, partitions: Sequence[int] | None = None) -> None:
    """Run a projector process until SIGTERM."""
    metrics.serve(settings.metrics_port)
    projector = Projector(settings, partitions)
    signal.signal(signal.SIGTERM, projector.stop)
    signal.signal(signal.SIGINT, projector.stop)
    projector.run()
