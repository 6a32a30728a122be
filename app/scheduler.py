"""The scheduler process: Kafka and Postgres around the :class:`Dispatcher`.

It reads ``dsec.requests`` from offsets it keeps in Postgres and follows
``dsec.events`` from its end for node heartbeats and sandbox endings. On start it
recovers nodes and live sandboxes from the projections. Requests after the last
saved offset are decided again after a crash; the dispatcher's derived event ids make
that harmless.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from datetime import timedelta

from kafka.consumer.fetcher import ConsumerRecord
from sqlalchemy import select, text

from app import bus, metrics
from app.config import Settings
from app.consuming import PositionedConsumer, dead_letter
from app.db import log as event_log
from app.db.engine import transaction
from app.db.tables import nodes, sandboxes
from app.db.trajectory import PostgresTrajectoryLog
from app.dispatch import HEARTBEAT_TIMEOUT, NAME, Dispatcher, LiveSandbox, Outbox
from app.domain.sandbox_state import LIVE
from app.taskqueue import make_celery

log = logging.getLogger(__name__)

# Sandboxes whose last freeze-or-thaw in the log is a freeze.
_FROZEN_NOW = text(
    """
    SELECT sandbox_id FROM (
        SELECT DISTINCT ON (sandbox_id) sandbox_id, type FROM events
        WHERE sandbox_id = ANY(:ids) AND type IN ('SandboxFrozen', 'SandboxThawed')
        ORDER BY sandbox_id, position DESC
    ) AS last WHERE type = 'SandboxFrozen'
    """
)


class Scheduler:
    """Places sandboxes on nodes and routes requests to them."""

    def __init__(
        self, settings: Settings, heartbeat_timeout: timedelta = HEARTBEAT_TIMEOUT
    ) -> None:
        self.settings = settings
        self.dispatcher = Dispatcher(
            settings, heartbeat_timeout, PostgresTrajectoryLog(settings.database_url)
        )
        self.placement = self.dispatcher.placement
        self.publisher = bus.Publisher(settings)
        self.celery = make_celery(settings)
        self._stopping = threading.Event()
        self._recover()
        self.requests = PositionedConsumer(settings, settings.topic_requests, NAME)
        with transaction(settings.database_url) as conn:
            stored = event_log.load_offsets(conn, NAME, settings.topic_requests)
        self.requests.seek(stored)
        self.events = bus.make_consumer(
            settings, fetch_max_wait_ms=settings.background_fetch_max_wait_ms
        )
        event_parts = bus.partitions(self.events, settings.topic_events)
        self.events.assign(event_parts)
        # From the true end (see bus.high_watermarks): the broker's own answer can lie a
        # few records short, and old endings would be applied to the recovered state.
        for tp, end in bus.high_watermarks(settings, event_parts).items():
            self.events.seek(tp, end)

    # --- state ------------------------------------------------------------------

    def _recover(self) -> None:
        """Nodes and live sandboxes as the projections last saw them, and which of
        those sandboxes a lapsed lease left frozen (from the log)."""
        with transaction(self.settings.database_url) as conn:
            alive = conn.execute(select(nodes).where(nodes.c.state == "alive")).all()
            rows = conn.execute(
                select(sandboxes).where(sandboxes.c.state.in_([s.value for s in LIVE]))
            ).all()
            frozen = set(conn.execute(_FROZEN_NOW, {"ids": [r.sandbox_id for r in rows]}).scalars())
        self.dispatcher.recover(
            ((row.node_id, row) for row in alive),
            (
                LiveSandbox(
                    sandbox_id=row.sandbox_id, node_id=row.node_id, cpus=row.cpus or 0.0,
                    memory_mb=row.memory_mb or 0, tenant=row.tenant, job_id=row.job_id,
                    labels=row.labels or {}, frozen=row.sandbox_id in frozen,
                )
                for row in rows
            ),
        )  # fmt: skip

    def _flush(self, out: Outbox) -> None:
        for record, exc in out.dead:
            dead_letter(self.publisher, self.settings, NAME, record, exc.reason, exc.detail)
            metrics.DEAD_LETTERS.labels(NAME, exc.reason.value).inc()
        for key, value in out.events:
            self.publisher.publish(self.settings.topic_events, key, value)
        for reply_to, key, value in out.replies:
            self.publisher.publish(reply_to.topic, key, value, partition=reply_to.partition)
        if out.events or out.replies:
            # Lifecycle events are acknowledged before any node hears of the sandbox,
            # so Scheduled precedes Started in the sandbox's partition.
            self.publisher.flush()
        for task, queue, args in out.tasks:
            self.celery.send_task(task, args=args, queue=queue)

    def run_once(self) -> None:
        """Follow events, retry waiting creates, handle new requests, save offsets."""
        out = Outbox()
        for record in self._poll_events():
            self.dispatcher.observe(out, record)
        self.dispatcher.check_nodes(out)
        self.dispatcher.check_leases(out)
        self.dispatcher.retry_pending(out)
        records = self.requests.poll(timeout_ms=50, max_records=500)
        offsets: dict[int, int] = {}
        for record in records:
            self.dispatcher.handle(out, record)
            offsets[record.partition] = record.offset + 1
        self._flush(out)
        # A waiting create holds its partition's stored offset back, so a restart
        # reads it again instead of losing it.
        for pending in self.dispatcher.pending:
            if pending.partition in offsets:
                offsets[pending.partition] = min(offsets[pending.partition], pending.offset)
        if offsets:
            with transaction(self.settings.database_url) as conn:
                event_log.save_offsets(
                    conn, NAME, self.settings.topic_requests, self.requests.topic_id, offsets
                )

    def _poll_events(self) -> list[ConsumerRecord]:
        batches = self.events.poll(timeout_ms=0, max_records=2000)
        return [r for records in batches.values() for r in records]

    def run(self) -> None:
        """Until stopped."""
        log.info(
            "scheduler: %d nodes, %d live sandboxes recovered",
            len(self.placement.nodes),
            len(self.placement.allocations),
        )
        while not self._stopping.is_set():
            try:
                self.run_once()
            except Exception:
                log.exception("scheduler: batch failed")
                time.sleep(1.0)
        self.requests.close()
        self.events.close()
        self.publisher.close()

    def stop(self, *_: object) -> None:
        """Finish after the current batch."""
        self._stopping.set()


def main(settings: Settings) -> None:
    """Run the scheduler until SIGTERM."""
    metrics.serve(settings.metrics_port + 1)
    scheduler = Scheduler(settings)
    signal.signal(signal.SIGTERM, scheduler.stop)
    signal.signal(signal.SIGINT, scheduler.stop)
    scheduler.run()
