"""The projector: events topic -> Postgres log + projections, exactly once.

Each poll's batch is appended to ``events``, folded into the projections and the
next offsets recorded, all in ONE transaction. On start the consumer seeks to the
offsets stored in Postgres, so a crash anywhere replays at most an uncommitted
batch, whose effects were rolled back with it. Kafka auto-commit is off and no
consumer group is joined (static assignment), so no rebalance callback can run.
While one batch commits the next is read and decoded, never committed before it.
"""

from __future__ import annotations

import gc
import logging
import signal
import sys
import threading
import time
from collections.abc import Sequence

from sqlalchemy import Connection

from app import heap, metrics
from app.bus import Publisher
from app.config import Settings
from app.consuming import IDLE_POLL_MS, PositionedConsumer, dead_letter
from app.control.keyring import Keyring
from app.control.lanes import BatchOutcome, Lane, Prepared, split_lanes
from app.control.lost_lives import LostLives
from app.control.waiting import Stopped, until_available
from app.db import log as event_log
from app.db import projections, queries, staging
from app.db.engine import engine_for, transaction
from app.db.errors import UNAVAILABLE, savepoint
from app.domain import admission
from app.domain.codec import DeadLetterReason, DecodeError, decode_event
from app.domain.events import Event
from app.domain.proof import KeyInfo, KeyLookup, ProofError, Purpose, Role, verify
from app.domain.records import Record, StoredOffset
from app.domain.trust import EVENT_SENDERS, event_refusal
from app.errors import StorageRefused, first_line
from app.ports import PositionedReader

log = logging.getLogger(__name__)

#: How often the projector makes sure the log has partitions for the coming days.
PARTITION_CHECK_S = 3600.0
#: Records per batch (one transaction) at most: each batch pays ~10 round trips and
#: a commit, which 5,000 events share better than 2,000 (+9% events/s measured).
BATCH_RECORDS = 5000
#: Once records come, how long more are gathered into the same batch (unless it holds
#: GATHER_RECORDS already): at a few hundred events a second, batches of one or two
#: paid a transaction each. The log lags this much more; nothing waits on it.
GATHER_S = 0.1
GATHER_RECORDS = 500
#: The pause before each further read of a gathering batch. Without it each read
#: returned the one or two records of one fetch, and the reads, not the commits, cost
#: most: at ~220 commands/s the projector spent 1.23-1.37 ms per command without it
#: (gathering for 20 or 100 ms) and 0.76-0.86 ms with it, Postgres 1.1 then 0.2-0.4 ms
#: (`bench/throughput.py --commands 2000`, alternating runs).
GATHER_PAUSE_S = 0.01
#: How long a thread may hold the GIL while another wants it (Python's default: 5 ms).
GIL_SWITCH_S = 0.0005


class BatchKeys(KeyLookup):
    """A keyring's answers kept for one batch (a lookup takes a lock and a clock read;
    a batch of 5,000 events names a handful of keys)."""

    def __init__(self, keys: KeyLookup) -> None:
        self._keys = keys
        self._found: dict[str, KeyInfo | None] = {}

    def lookup(self, key_id: str) -> KeyInfo | None:
        try:
            return self._found[key_id]
        except KeyError:
            found = self._found[key_id] = self._keys.lookup(key_id)
            return found

    def current(self, role: Role, subject: str) -> KeyInfo | None:
        return self._keys.current(role, subject)


def admit_event(
    record: Record, keys: KeyLookup, max_bytes: int
) -> tuple[Event, str | None] | DecodeError:
    """One record of the events topic: the event it proves and the node that proved it
    (None: the scheduler), or why it is a dead letter. Pure, and total: whatever bytes
    and headers arrive, it returns. (What the log must hold already for a node's event
    to be admitted is checked as the batch is appended: :meth:`Projector.screen`.)"""
    value = record.value or b""
    try:
        sender = verify(Purpose.EVENT, value, record.headers, keys, EVENT_SENDERS)
        event = decode_event(value, max_bytes)
    except ProofError as proof_error:
        return DecodeError(DeadLetterReason.UNAUTHENTICATED, str(proof_error))
    except DecodeError as exc:
        return exc
    refusal = event_refusal(sender, event)
    if refusal is not None:
        return DecodeError(DeadLetterReason.FORBIDDEN, refusal)
    return event, sender.subject if sender.role == Role.NODE else None


class Projector:
    """Moves events from Kafka into Postgres for a set of partitions."""

    def __init__(
        self,
        settings: Settings,
        partitions: Sequence[int] | None = None,
        name: str = "projector",
        *,
        reader: PositionedReader | None = None,
    ) -> None:
        """Reads ``partitions`` of the events topic (None: all) with a Kafka consumer,
        or with ``reader`` if one is given (a test's, of the partitions it chose)."""
        self.settings = settings
        self.name = name
        if reader is None:
            reader = PositionedConsumer(settings, settings.topic_events, name, partitions)
        self.consumer: PositionedReader = reader
        self.publisher = Publisher(settings)
        self.keys = Keyring.from_settings(settings)
        self._stop = threading.Event()
        #: Batches committed so far (tells failures in a row from isolated ones).
        self._committed = 0
        staging.stage_on_connect(engine_for(settings.database_url))
        stored = until_available(self._prepare_log, name, "postgres", self._stop)
        with transaction(settings.database_url) as conn:
            # Before folding anything new: projections built by other rules are rebuilt.
            folded = projections.ensure_current(conn)
        if folded is not None:
            log.warning(
                "%s: projections were built by other rules; rebuilt from %d events (v%d)",
                name, folded, projections.VERSION,
            )  # fmt: skip
        self.warnings = self.consumer.seek(stored)
        self._partitions_checked = time.monotonic()
        # The rule for lives on lost nodes runs in one projector: the one that reads
        # partition 0 (every projector, were they all to sweep, would send the same ends).
        reads_first = 0 in self.consumer.partitions
        self.lost_lives = LostLives(settings, self.publisher, self.keys) if reads_first else None

    def _prepare_log(self) -> dict[int, StoredOffset]:
        """Tomorrow's partitions made; where this projector stands, as stored."""
        with transaction(self.settings.database_url) as conn:
            event_log.ensure_partitions(conn)
            return event_log.load_offsets(conn, self.name, self.settings.topic_events)

    def _reread_offsets(self) -> dict[int, StoredOffset]:
        return event_log.read_offsets(
            self.settings.database_url, self.name, self.settings.topic_events
        )

    def handle(self, records: list[Record]) -> BatchOutcome:
        """Decode, dead-letter, append and project one batch in one transaction."""
        return self.commit(self.prepare(records))

    def prepare(self, records: list[Record]) -> Prepared:
        """Decode a batch and send its dead letters; nothing is committed yet."""
        outcome = BatchOutcome()
        good: list[event_log.SourcedEvent] = []
        sources: list[Record] = []
        topic_id = self.consumer.topic_id
        max_bytes = self.settings.max_message_bytes
        offsets = outcome.offsets
        # Records are decoded one by one, not as one json array: joined bytes lose
        # each record's boundaries (two broken records can join into one valid event,
        # and a record holding two can make the count match), and one pydantic call
        # for 2,000 records measured 2.34 us a record against 2.50: not worth it.
        # Keys are looked up once per batch and sender, not once per event.
        keys = BatchKeys(self.keys)
        for record in records:
            offsets[record.partition] = record.offset + 1
            taken = admit_event(record, keys, max_bytes)
            if isinstance(taken, DecodeError):
                self._dead(record, taken.reason, taken.detail)
                outcome.dead += 1
                continue
            event, node = taken
            item = event_log.SourcedEvent(
                event, record.topic, topic_id, record.partition, record.offset,
                event_log.payload_json(event), node,
            )  # fmt: skip
            good.append(item)
            sources.append(record)
        if outcome.dead:
            # Dead letters are flushed before the offsets move past them: a crash in
            # between sends a letter twice, never zero times.
            self.publisher.flush()
        return Prepared(good, sources, outcome)

    def _dead(self, record: Record, reason: DeadLetterReason, detail: str) -> None:
        dead_letter(self.publisher, self.settings, self.name, record, reason, detail)
        metrics.DEAD_LETTERS.labels(self.name, reason.value).inc()

    def commit(self, batch: Prepared) -> BatchOutcome:
        """Append and project a prepared batch and move the offsets, in one transaction."""
        outcome = batch.outcome
        try:
            appended = self._commit(batch)
        except StorageRefused as exc:
            # One event the database cannot store (it passed validation, but e.g.
            # jsonb refuses a NUL character) must not stop the log: find it, event by
            # event, and dead-letter it; the others are appended as usual.
            log.warning("%s: batch refused (%s); appending event by event", self.name, exc)
            appended = self._commit_singly(batch)
        outcome.appended = len(appended)
        outcome.duplicates = len(batch.good) - len(appended)
        self._committed += 1
        metrics.EVENTS_APPENDED.inc(outcome.appended)
        metrics.EVENTS_DUPLICATE.inc(outcome.duplicates)
        return outcome

    def screen(self, conn: Connection, batch: Prepared) -> None:
        """Set aside what the log refuses about the batch's sandboxes, given what it
        holds of them (app/domain/admission.py): a node's event about a sandbox not
        placed on it, a second end of a life. They are dead-lettered, and flushed
        before the offsets pass them. Read in the batch's own transaction: every event
        of a sandbox is on its partition, so no other lane moves what is read here."""
        if batch.screened:
            return  # a batch appended again event by event: screened the first time
        batch.screened = True
        good = batch.good
        ends = [i.event.event_id for i in good if admission.is_end(i.event)]
        named = {
            i.event.sandbox_id for i in good
            if i.event.sandbox_id is not None and (i.node is not None or admission.is_end(i.event))
        }  # fmt: skip
        if not named:
            return
        known = queries.admission_facts(conn, named)
        logged = queries.logged_ids(conn, ends) if ends else set()
        verdicts = admission.screen([(i.event, i.node) for i in good], known, logged)
        if not any(verdicts):
            return
        kept: list[event_log.SourcedEvent] = []
        records: list[Record] = []
        for item, record, verdict in zip(good, batch.records, verdicts, strict=True):
            if verdict is None:
                kept.append(item)
                records.append(record)
                continue
            self._dead(record, verdict.reason, verdict.detail)
            batch.outcome.dead += 1
        self.publisher.flush()
        # One line a batch (each letter says why; a flood must not flood the log too).
        log.warning("%s: %d events set aside, first: %s", self.name, len(good) - len(kept),
                    next(v for v in verdicts if v is not None))  # fmt: skip
        batch.good, batch.records = kept, records

    def _commit(self, batch: Prepared) -> list[tuple[event_log.SourcedEvent, int]]:
        with metrics.BATCH_SECONDS.time(), transaction(self.settings.database_url) as conn:
            self.screen(conn, batch)
            appended = event_log.append_and_project(conn, batch.good)
            event_log.save_offsets(
                conn, self.name, self.settings.topic_events, self.consumer.topic_id,
                batch.outcome.offsets,
            )  # fmt: skip
        return appended

    def _commit_singly(self, batch: Prepared) -> list[tuple[event_log.SourcedEvent, int]]:
        appended: list[tuple[event_log.SourcedEvent, int]] = []
        refused: list[tuple[Record, str]] = []
        outcome = batch.outcome
        with transaction(self.settings.database_url) as conn:
            self.screen(conn, batch)
            for item, record in zip(batch.good, batch.records, strict=True):
                try:
                    with savepoint(conn):
                        one = event_log.append_and_project(conn, [item])
                except StorageRefused as exc:
                    refused.append((record, str(exc)[:500]))
                    continue
                appended.extend(one)
            for record, why in refused:
                dead_letter(
                    self.publisher, self.settings, self.name, record,
                    DeadLetterReason.UNSTORABLE, why,
                )  # fmt: skip
                metrics.DEAD_LETTERS.labels(self.name, DeadLetterReason.UNSTORABLE.value).inc()
            self.publisher.flush()  # before the offsets pass them, as above
            event_log.save_offsets(
                conn, self.name, self.settings.topic_events, self.consumer.topic_id, outcome.offsets
            )
        outcome.dead += len(refused)
        return appended

    def _check_partitions(self) -> None:
        if time.monotonic() - self._partitions_checked > PARTITION_CHECK_S:
            with transaction(self.settings.database_url) as conn:
                event_log.ensure_partitions(conn)
            self._partitions_checked = time.monotonic()

    def run_once(self, timeout_ms: int = 200) -> BatchOutcome | None:
        """Poll once and handle what came, start to finish."""
        self._check_partitions()
        records = self.consumer.poll(timeout_ms=timeout_ms, max_records=BATCH_RECORDS)
        return self.handle(records) if records else None

    def _gather(self, records: list[Record]) -> list[Record]:
        """``records`` and what else comes within :data:`GATHER_S`, for one batch."""
        deadline = time.monotonic() + GATHER_S
        while len(records) < GATHER_RECORDS:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                break
            self._stop.wait(GATHER_PAUSE_S)
            more = self.consumer.poll(timeout_ms=left_ms, max_records=BATCH_RECORDS - len(records))
            if not more:
                break
            records = [*records, *more]
        return records

    def run(self) -> None:
        """Until stopped, with the next batches read while the last ones commit.

        Each batch is split into lanes by partition (``partition % lanes``). A lane
        commits its parts one at a time and in order, each in its own transaction on
        its own connection, with up to :data:`~app.control.lanes.LANE_DEPTH` parts
        queued, while other lanes commit theirs and the next batch is read and decoded.
        A partition belongs to one lane, so every guarantee of :meth:`handle` holds per
        partition. A part that fails breaks its lane: the parts queued behind it are not
        committed, and everything is read again from the offsets stored in Postgres.
        """
        log.info("%s: consuming %s", self.name, list(self.consumer.partitions))
        _quiet_gc()
        # A lane whose Postgres answer has come waits for the GIL while the reader
        # decodes: handing it over every 0.5 ms instead of 5 ms measured +8% events/s
        # (one process, two lanes); it changed nothing with one committer.
        sys.setswitchinterval(GIL_SWITCH_S)
        count = self.settings.projector_lanes
        lanes = [Lane(f"{self.name}-lane{n}", self.commit) for n in range(count)]
        failures, committed_then = 0, -1
        try:
            while not self._stop.is_set():
                try:
                    self._check_partitions()
                    # A lane that failed is noticed even if no more records come its way.
                    for lane in lanes:
                        lane.check()
                    if self.lost_lives is not None and self.lost_lives.due():
                        self.lost_lives.sweep()
                    records = self.consumer.poll(timeout_ms=IDLE_POLL_MS, max_records=BATCH_RECORDS)
                    if records:
                        records = self._gather(records)
                        parts = split_lanes(self.prepare(records), len(lanes))
                        for lane, part in zip(lanes, parts, strict=True):
                            if part is not None:
                                lane.submit(part)
                except Exception as exc:
                    # A database outage (down, full, refusing) must not kill the
                    # projector: nothing after each partition's last committed batch was
                    # committed, so it is read again after the seek below; repeated
                    # failures back off, up to 10 s apart.
                    # In a row: no batch committed since the last failure.
                    failures = failures + 1 if self._committed == committed_then else 1
                    committed_then = self._committed
                    if isinstance(exc, UNAVAILABLE):
                        log.warning("%s: waiting for postgres: %s", self.name, first_line(exc))
                    else:
                        log.exception("%s: batch failed; retrying from stored offsets", self.name)
                    # Parts still committing decide the stored offsets: let them settle.
                    for lane in lanes:
                        lane.settle()
                    # Postgres gone (restarting, refusing): wait for it here, with
                    # backoff, rather than die and leave the wait to a supervisor.
                    try:
                        stored = until_available(
                            self._reread_offsets, self.name, "postgres", self._stop, first_s=1.0
                        )
                    except Stopped:
                        break
                    self.consumer.seek(stored)
                    if self._stop.wait(min(0.5 * 2 ** min(failures, 5), 10.0)):
                        break
            for lane in lanes:
                lane.settle()
        finally:
            for lane in lanes:
                lane.close()
        self.consumer.close()
        self.publisher.close()

    def stop(self, *_: object) -> None:
        """Ask the loop to finish after the current batch."""
        self._stop.set()


def _quiet_gc() -> None:
    """Keep the cyclic garbage collector from walking what is alive on purpose.

    At the default thresholds the collector ran ~1,800 times per 100,000 events and
    walked, each time, the start-up heap (~85,000 objects, 10-35 ms for a full pass)
    and the batches in flight, which are alive on purpose: ~12 tracked objects per
    record, two batches of up to BATCH_RECORDS at once. That cost 8-18 us of an
    event's 60-90. The start-up heap is frozen out of every pass, and a young pass
    waits for more net allocations than two batches hold, so it finds garbage, not
    batches; cycles (an exception's traceback) are still collected, and bounded.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(50 * BATCH_RECORDS, 10, 10)


def main(settings: Settings, partitions: Sequence[int] | None = None) -> None:
    """Run a projector process until SIGTERM."""
    metrics.serve(settings.metrics_port, settings.metrics_host)
    projector = Projector(settings, partitions)
    signal.signal(signal.SIGTERM, projector.stop)
    signal.signal(signal.SIGINT, projector.stop)
    heap.settle()
    projector.run()
