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
import uuid
from datetime import timedelta

from kafka.consumer.fetcher import ConsumerRecord
from sqlalchemy import select, text

from app import bus, metrics
from app.config import Settings
from app.consuming import PositionedConsumer, dead_letter
from app.db import handled
from app.db import log as event_log
from app.db.engine import transaction
from app.db.tables import nodes, sandboxes
from app.db.trajectory import PostgresTrajectoryLog
from app.dispatch import HEARTBEAT_TIMEOUT, NAME, Dispatcher, LiveSandbox, Outbox
from app.domain.base import utcnow
from app.domain.proof import SCHEDULER_KEY_ID, Purpose, headers
from app.domain.sandbox_state import LIVE, SandboxState
from app.keyring import Keyring
from app.taskqueue import make_celery
from app.waiting import UNAVAILABLE, until_available

log = logging.getLogger(__name__)

#: States of a sandbox that lived and ended (a rejected create never lived: its id
#: may be asked for again).
ENDED = (SandboxState.STOPPED, SandboxState.FAILED)

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
# The create request behind each live sandbox (a redelivered create is a no-op).
_CREATED_BY = text(
    """
    SELECT sandbox_id, (payload->>'request_id')::uuid AS request_id FROM events
    WHERE sandbox_id = ANY(:ids) AND type = 'SandboxRequested'
    """
)
#: How often handled request ids older than the freshness window are pruned.
PRUNE_S = 60.0


class Scheduler:
    """Places sandboxes on nodes and routes requests to them."""

    def __init__(
        self, settings: Settings, heartbeat_timeout: timedelta = HEARTBEAT_TIMEOUT
    ) -> None:
        self.settings = settings
        self.keyring = Keyring.from_settings(settings)
        self.dispatcher = Dispatcher(
            settings, self.keyring, heartbeat_timeout, PostgresTrajectoryLog(settings.database_url)
        )
        self.placement = self.dispatcher.placement
        # Every tenant's replies topic exists before its first answer is sent (a send to
        # a missing topic blocks on metadata).
        self._tenants = self.keyring.tenants()
        bus.ensure_topics(settings, self._tenants)
        self._topics_checked = time.monotonic()
        self._pruned = time.monotonic()
        self.publisher = bus.Publisher(settings)
        self.celery = make_celery(settings)
        self._stopping = threading.Event()
        until_available(self._recover, NAME, "postgres", self._stopping)
        self.requests = PositionedConsumer(settings, settings.topic_requests, NAME)
        self.requests.seek(until_available(self._stored_offsets, NAME, "postgres", self._stopping))
        self.events = bus.make_consumer(
            settings, fetch_max_wait_ms=settings.background_fetch_max_wait_ms
        )
        event_parts = bus.partitions(self.events, settings.topic_events)
        self.events.assign(event_parts)
        # From the true end (see bus.high_watermarks): the broker's own answer can lie a
        # few records short, and old endings would be applied to the recovered state.
        for tp, end in bus.high_watermarks(settings, event_parts).items():
            self.events.seek(tp, end)
        self._event_parts = event_parts
        self._events_incarnation = bus.Incarnation(self.events, settings.topic_events)

    def _stored_offsets(self) -> dict[int, event_log.StoredOffset]:
        return event_log.read_offsets(
            self.settings.database_url, NAME, self.settings.topic_requests
        )

    # --- state ------------------------------------------------------------------

    def _recover(self) -> None:
        """Nodes and live sandboxes as the projections last saw them, and which of
        those sandboxes a lapsed lease left frozen (from the log)."""
        with transaction(self.settings.database_url) as conn:
            alive = conn.execute(select(nodes).where(nodes.c.state == "alive")).all()
            rows = conn.execute(
                select(sandboxes).where(sandboxes.c.state.in_([s.value for s in LIVE]))
            ).all()
            ids = [r.sandbox_id for r in rows]
            frozen = set(conn.execute(_FROZEN_NOW, {"ids": ids}).scalars())
            created_by: dict[str, uuid.UUID] = {
                r.sandbox_id: r.request_id for r in conn.execute(_CREATED_BY, {"ids": ids})
            }
            window = timedelta(seconds=self.settings.request_max_age_s)
            seen = handled.load(conn, utcnow() - window)
        for request_id, partition, offset, at in seen:
            self.dispatcher.gate.remember(request_id, partition, offset, at)
        self.dispatcher.recover(
            ((row.node_id, row) for row in alive),
            (
                LiveSandbox(
                    sandbox_id=row.sandbox_id, node_id=row.node_id, cpus=row.cpus or 0.0,
                    memory_mb=row.memory_mb or 0, tenant=row.tenant, job_id=row.job_id,
                    labels=row.labels or {}, frozen=row.sandbox_id in frozen,
                    request_id=created_by.get(row.sandbox_id),
                )
                for row in rows
            ),
        )  # fmt: skip

    def _flush(self, out: Outbox) -> None:
        for record, exc in out.dead:
            dead_letter(self.publisher, self.settings, NAME, record, exc.reason, exc.detail)
            metrics.DEAD_LETTERS.labels(NAME, exc.reason.value).inc()
        secret = self.keyring.scheduler.secret
        for key, value in out.events:
            proof = headers(Purpose.EVENT, SCHEDULER_KEY_ID, secret, value)
            self.publisher.publish(self.settings.topic_events, key, value, headers=proof)
        for reply_to, key, value, proof in out.replies:
            self.publisher.publish(
                reply_to.topic, key, value, partition=reply_to.partition, headers=proof
            )
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
        try:
            self._learn_ended(records)
        except Exception:
            # Nothing of the batch was handled: read it again next time (Postgres
            # gone must delay these requests, never drop them).
            self.requests.rewind(records)
            raise
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
        gate = self.dispatcher.gate
        if offsets or gate.unsaved:
            with transaction(self.settings.database_url) as conn:
                # The ids with the offsets past them: a restarted scheduler that reads a
                # request again at the same place handles it again; one read anywhere
                # else is a replay.
                handled.save(conn, gate.unsaved)
                event_log.save_offsets(
                    conn, NAME, self.settings.topic_requests, self.requests.topic_id, offsets
                )
            gate.unsaved.clear()
        self._housekeeping()

    def _learn_ended(self, records: list[ConsumerRecord]) -> None:
        """Which sandboxes named by this batch (a request's key is its sandbox id)
        ended before this scheduler's memory: one query per batch, so an id is never
        given a second life after a restart either."""
        keys = {r.key.decode(errors="replace") for r in records if r.key}
        unknown = self.dispatcher.unknown_ids(keys)
        if not unknown:
            return
        with transaction(self.settings.database_url) as conn:
            rows = conn.execute(
                select(sandboxes.c.sandbox_id, sandboxes.c.end_reason, sandboxes.c.tenant).where(
                    sandboxes.c.sandbox_id.in_(unknown),
                    sandboxes.c.state.in_([s.value for s in ENDED]),
                )
            ).all()
        for row in rows:
            self.dispatcher.note_ended(row.sandbox_id, row.end_reason or "ended", row.tenant)

    def _housekeeping(self) -> None:
        """Forget request ids older than the freshness window; make new tenants' topics."""
        now = time.monotonic()
        if now - self._pruned > PRUNE_S:
            self._pruned = now
            cutoff = utcnow() - 2 * timedelta(seconds=self.settings.request_max_age_s)
            self.dispatcher.gate.forget_before(cutoff)
            with transaction(self.settings.database_url) as conn:
                handled.prune(conn, cutoff)
        if now - self._topics_checked > 5.0:
            self._topics_checked = now
            tenants = self.keyring.tenants()
            if tenants - self._tenants:
                bus.ensure_topics(self.settings, tenants)
                self._tenants = tenants

    def _poll_events(self) -> list[ConsumerRecord]:
        if self._events_incarnation.changed():  # the broker came back empty
            log.warning("scheduler: the events topic is new: following it from its beginning")
            self.events.seek_to_beginning(*self._event_parts)
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
            except UNAVAILABLE as exc:
                log.warning("scheduler: batch waits for a backing service: %s", exc)
                self._stopping.wait(1.0)
            except Exception:
                log.exception("scheduler: batch failed")
                self._stopping.wait(1.0)
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
