"""The scheduler process: Kafka and Postgres around the :class:`Dispatcher`.

Several scheduler processes share ``dsec.requests`` by partition. Each holds one
Postgres session (:class:`app.db.partition_locks.OwnerSession`) with a lock per
partition it owns, reads those partitions from offsets it commits on that same
session, and every second or so takes its fair share of partitions (gives extra
ones back after saving their offsets, claims free ones: those of a scheduler that
died are free as soon as Postgres sees its session end).

Every scheduler follows all of ``dsec.events`` (heartbeats, placements, endings,
freezes), so it always knows every sandbox and every node's room, and can take a
partition over at any moment. On start it recovers nodes and live sandboxes from
the projections and the projector's offsets read in one snapshot, then reads the
events after those offsets. Requests after the last saved offset are decided again
after a crash or a takeover; the dispatcher's derived event ids and the nodes'
claims of request ids make that harmless.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from datetime import timedelta

from sqlalchemy import Connection, text

from app import bus, heap, kafka_admin, metrics
from app.config import Settings
from app.consuming import IDLE_POLL_MS, BusWatch, PositionedConsumer, dead_letter, key_partition
from app.control.dispatch import NAME, Dispatcher, LiveSandbox
from app.control.egress_secrets import StoredSecrets
from app.control.follower import HEARTBEAT_TIMEOUT
from app.control.image_digests import StoredDigests
from app.control.image_shares import StoredShares
from app.control.keyring import Keyring
from app.control.lost_inboxes import FOLLOW_S, LostInboxes
from app.control.outbox import Outbox
from app.control.sending import send_outbox
from app.control.stored_quotas import StoredQuotas
from app.control.waiting import until_available
from app.db import handled, queries
from app.db import log as event_log
from app.db.engine import transaction
from app.db.errors import UNAVAILABLE
from app.db.partition_locks import OwnerSession, OwnershipLost
from app.db.trajectory import PostgresTrajectoryLog
from app.domain.base import utcnow
from app.domain.partition_share import rebalance
from app.domain.records import Record, StoredOffset
from app.errors import AccessDenied
from app.partition_cache import PartitionCache
from app.ports import PositionedReader
from app.taskqueue import CeleryTaskQueue

log = logging.getLogger(__name__)

#: How often handled request ids older than the freshness window are pruned.
PRUNE_S = 60.0
#: How often a scheduler looks at who owns which partition (claims, gives back).
REBALANCE_S = 1.0
#: How long a round waits for requests. A request ends the wait at once; the wait
#: sets how often the scheduler runs its timers (node silence, lives, leases, waiting
#: creates), which count in seconds, and how late it sees an event that came
#: meanwhile. 50 ms made the idle scheduler cost 5 % of a core.
REQUEST_WAIT_MS = 250
#: The wait once no request came for :data:`QUIET_AFTER_S`: an idle scheduler wakes
#: every 2 s (each round's polls also wake its Kafka clients' threads). Events
#: alone do not count: a node's heartbeat every few seconds would keep it busy.
QUIET_WAIT_MS = IDLE_POLL_MS
QUIET_AFTER_S = 2.0
#: How long the broker holds the scheduler's empty fetches: shorter than the others'
#: 5 s, as it has run since 63bfb99. 5 s, tried once its consumers reconnect to move,
#: bought nothing measurable idle (0.34 against 0.37 % of a core for the scheduler),
#: and test_kafka_cluster's two-brokers-down case took 36-38 s against 24-41 s with
#: 2 s: no clear cost, no gain, so the tested value stays.
FETCH_WAIT_MS = 2000
#: Events followed per read. A round that read this many is behind the log and waits
#: for nothing: an idle scheduler at one round a second would follow at most this many
#: events a second, where a unit's nodes log ~40,000.
EVENTS_PER_READ = 2000
#: The projector whose offsets say where the recovered projections stand.
PROJECTOR = "projector"


def round_wait_ms(events_read: int, quiet: bool, creates_waiting: bool) -> int:
    """How long a round waits for requests: not at all while the events it read fill a
    read (it is behind the log), long while it is quiet and no create waits for room,
    else :data:`REQUEST_WAIT_MS`."""
    if events_read >= EVENTS_PER_READ:
        return 0
    return QUIET_WAIT_MS if quiet and not creates_waiting else REQUEST_WAIT_MS


class BrokerPartitions:
    """The gate's partition counts (:class:`app.domain.partition_counts.PartitionCounts`)
    from this scheduler's Kafka clients: the requests topic as its consumer reads it,
    replies topics as the producer's metadata knows them, cached briefly."""

    def __init__(self, publisher: bus.Publisher, requests: Callable[[], int]) -> None:
        self._requests = requests
        self._replies = PartitionCache(lambda: publisher)

    def requests(self) -> int:
        return self._requests()

    def replies(self, topic: str) -> int | None:
        return self._replies(topic)


class Scheduler:
    """Places sandboxes on nodes and routes requests to them."""

    def __init__(
        self,
        settings: Settings,
        heartbeat_timeout: timedelta = HEARTBEAT_TIMEOUT,
        *,
        events: PositionedReader | None = None,
        requests: PositionedReader | None = None,
    ) -> None:
        """Reads the events and requests topics with Kafka consumers, or with the
        readers given (a test's: ``events`` of every partition, ``requests`` of none,
        as the partitions it owns are assigned to it)."""
        self.settings = settings
        self.keyring = Keyring.from_settings(settings)
        self.publisher = bus.Publisher(settings)
        digests = StoredDigests.from_settings(settings)
        self.dispatcher = Dispatcher(
            settings, self.keyring, BrokerPartitions(self.publisher, lambda: self.partition_count),
            heartbeat_timeout, PostgresTrajectoryLog(settings.database_url),
            metrics.SchedulerTally(), StoredQuotas.from_settings(settings),
            StoredShares.from_settings(settings).readers,
            StoredSecrets.from_settings(settings).for_sandbox,
            digests.digest_of, digests.deleted,
        )  # fmt: skip
        self.placement = self.dispatcher.placement
        # Every tenant's replies topic exists before its first answer is sent (a send to
        # a missing topic blocks on metadata).
        self._tenants = self.keyring.tenants()
        #: Node inbox topics known to exist (see _ensure_inboxes).
        self._inboxes: set[str] = set()
        #: The inboxes of lost nodes, read to answer their trainers' direct commands.
        self.lost_inboxes = LostInboxes(settings)
        #: Revoked key ids the nodes were told of (see _tell_revoked).
        self._told_revoked: set[str] = set()
        self._ensure_replies(self._tenants, platform=True)
        self._topics_checked = time.monotonic()
        self._pruned = time.monotonic()
        self.tasks = CeleryTaskQueue(settings)
        self._stopping = threading.Event()
        self.events: PositionedReader = events if events is not None else PositionedConsumer(
            settings, settings.topic_events, f"{NAME} (events)", fetch_max_wait_ms=FETCH_WAIT_MS
        )  # fmt: skip
        # The projections as of the projector's offsets, then the events after them:
        # nothing the log holds is missed or applied twice, placements of a scheduler
        # that died a moment ago included.
        self.events.seek(until_available(self._recover, NAME, "postgres", self._stopping))
        self.dispatcher.replaying = True
        self._catch_up()
        self.dispatcher.replaying = False
        self.requests: PositionedReader = requests if requests is not None else PositionedConsumer(
            settings, settings.topic_requests, NAME, partitions=[], fetch_max_wait_ms=FETCH_WAIT_MS
        )  # fmt: skip
        self.owner = OwnerSession(settings.database_url, NAME, settings.topic_requests)
        self.dispatcher.leases.keeps = self._keeps_lease
        self._rebalanced = 0.0
        #: When the last round had records to handle (events or requests).
        self._busy_at = time.monotonic()
        # A node's silence counts only from when the log last began committing writes
        # again (its heartbeats wait in transit while it does not), and from now on:
        # they may not have reached a scheduler that was not running.
        self.bus_watch = BusWatch(settings, settings.topic_probe)
        until_available(self._rebalance, NAME, "postgres", self._stopping)

    def _stored_offsets(self) -> dict[int, StoredOffset]:
        return event_log.read_offsets(
            self.settings.database_url, NAME, self.settings.topic_requests
        )

    # --- state ------------------------------------------------------------------

    def _recover(self) -> dict[int, StoredOffset]:
        """Nodes (alive and lost) and live sandboxes as the projections last saw them,
        whichever scheduler placed them, which of those sandboxes a lapsed lease left
        frozen and since when (from the log), and the projector's offsets in
        ``dsec.events`` those projections stand at (one snapshot)."""
        with transaction(self.settings.database_url) as conn:
            # One snapshot: the projector commits its projections and its offsets in
            # one transaction, so what is read here is exactly the events before them.
            conn.execute(text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ"))
            projected = event_log.load_offsets(conn, PROJECTOR, self.settings.topic_events)
            alive = queries.alive_nodes(conn)
            lost = queries.lost_nodes(conn)
            rows = queries.live_sandboxes(conn)
            ids = [r.sandbox_id for r in rows]
            frozen = queries.frozen_now(conn, ids)
            created_by = queries.created_by(conn, ids)
            window = timedelta(seconds=self.settings.request_max_age_s)
            seen = handled.load(conn, utcnow() - window)
        for one in seen:
            self.dispatcher.gate.remember(one)
        self.dispatcher.recover(
            ((row.node_id, row) for row in alive),
            (
                LiveSandbox(
                    sandbox_id=row.sandbox_id, node_id=row.node_id, cpus=row.cpus or 0.0,
                    memory_mb=row.memory_mb or 0, tenant=row.tenant, job_id=row.job_id,
                    labels=row.labels or {}, frozen=row.sandbox_id in frozen,
                    request_id=created_by.get(row.sandbox_id), requested_at=row.requested_at,
                    started=row.started_at is not None, frozen_at=frozen.get(row.sandbox_id),
                )
                for row in rows
            ),
            ((row.node_id, row, row.last_heartbeat_at) for row in lost),
        )  # fmt: skip
        return projected

    def _flush(self, out: Outbox) -> None:
        for record, exc in out.dead:
            dead_letter(self.publisher, self.settings, NAME, record, exc.reason, exc.detail)
            metrics.DEAD_LETTERS.labels(NAME, exc.reason.value).inc()
        send_outbox(
            out, self.publisher, self.tasks, self.settings.topic_events,
            self.keyring.scheduler.secret, self._ensure_inboxes,
        )  # fmt: skip

    def _ensure_replies(self, tenants: set[str], *, platform: bool = False) -> None:
        """Make the replies topics of ``tenants`` that are missing, where this
        scheduler's principal may. One it may not make (deleted behind the platform's
        back; an operator's `dsec up` or `dsec tenant create` makes it) is warned
        about, never fatal: a scheduler that died of it at every start served nobody."""
        try:
            kafka_admin.ensure_topics(self.settings, tenants, platform=platform, check=False)
        except AccessDenied as exc:
            log.warning(
                "%s: a topic is missing and only an operator may make it (`dsec up`): %s;"
                " requests whose answers go there are not answered until it exists",
                NAME, str(exc)[:300],
            )  # fmt: skip

    @property
    def partition_count(self) -> int:
        """Partitions of the requests topic, as the broker's metadata has them."""
        return len(self.requests.all_partitions)

    def _ensure_inboxes(self, topics: set[str]) -> None:
        """Make nodes' inbox topics that this process has not seen exist yet (a send to
        a missing topic would block on metadata). `dsec node add` makes a node's
        inbox with its credential; this covers a node added while a scheduler runs."""
        missing = topics - self._inboxes
        if missing:
            prefix = f"{self.settings.topic_prefix}.node."
            kafka_admin.ensure_topics(
                self.settings, nodes=[t.removeprefix(prefix) for t in missing],
                platform=False, check=False,
            )  # fmt: skip
            self._inboxes |= missing

    def run_once(self) -> None:
        """Follow events, retry waiting creates, handle new requests, save offsets."""
        out = Outbox()
        events = self._poll_events()
        for record in events:
            self.dispatcher.observe(out, record)
        bus_since = self.bus_watch.since
        if bus_since is not None:  # no node is silent while the bus itself is
            self.dispatcher.check_nodes(out, bus_since)
        self.dispatcher.check_lives(out)
        self.dispatcher.check_leases(out)
        self.dispatcher.retry_pending(out)
        self.dispatcher.log_samples(out)
        quiet = time.monotonic() - self._busy_at > QUIET_AFTER_S
        wait_ms = round_wait_ms(len(events), quiet, bool(self.dispatcher.pending))
        records = self.requests.poll(timeout_ms=wait_ms, max_records=500)
        if records:
            self._busy_at = time.monotonic()
            # Events that came during the wait first: the requests meet the view as of
            # their arrival (a node registered meanwhile takes its share of creates).
            for record in self._poll_events():
                self.dispatcher.observe(out, record)
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
        for record in self.lost_inboxes.poll(self._lost_nodes()):
            self.dispatcher.answer_for_lost(out, record)
        self._flush(out)
        # A waiting create holds its partition's stored offset back, so a restart
        # reads it again instead of losing it.
        for pending in self.dispatcher.pending:
            if pending.partition in offsets:
                offsets[pending.partition] = min(offsets[pending.partition], pending.offset)
        gate = self.dispatcher.gate
        try:
            if offsets or gate.unsaved:
                unsaved = list(gate.unsaved)

                def write(conn: Connection) -> None:
                    # The ids with the offsets past them: a scheduler that reads a
                    # request again at the same place handles it again; one read
                    # anywhere else is a replay.
                    handled.save(conn, unsaved)
                    event_log.save_offsets(
                        conn, NAME, self.settings.topic_requests, self.requests.topic_id, offsets
                    )

                # Fenced: committed only while this session holds every partition saved.
                self.owner.save(write, set(offsets) | {h.partition for h in unsaved})
                gate.unsaved.clear()
            if time.monotonic() - self._rebalanced >= REBALANCE_S:
                self._rebalance()
        except OwnershipLost as exc:
            self._lose_everything(exc)
            raise
        self._housekeeping()

    # --- partition ownership ------------------------------------------------------

    def _lost_nodes(self) -> list[str]:
        """Lost nodes whose inboxes this scheduler answers for: those heard from in
        the last hour whose id falls on a partition it owns."""
        since = utcnow() - timedelta(seconds=FOLLOW_S)
        return [
            node.node_id
            for node in self.placement.nodes.values()
            if not node.alive
            and node.last_seen is not None
            and node.last_seen >= since
            and key_partition(node.node_id, self.partition_count) in self.owner.owned
        ]

    def _keeps_lease(self, lease_id: str) -> bool:
        """A lease's renewals are keyed by its id: the owner of that partition hears
        them, and only it may decide the lease lapsed."""
        return key_partition(lease_id, self.partition_count) in self.owner.owned

    def _rebalance(self) -> None:
        """Claim free partitions up to the fair share, or give extra ones back.

        Called at a batch boundary, after the batch's offsets and handled ids are
        saved: a partition given back is stored exactly as far as it was handled."""
        self._rebalanced = time.monotonic()
        if not self.owner.is_open:
            self.owner.open()
        holders = self.owner.holders()
        free = set(range(self.partition_count)) - holders.partitions.keys()
        plan = rebalance(self.owner.owned, free, self.partition_count, len(holders.members))
        if plan.release:
            self.dispatcher.drop_pending(plan.release)
            for partition in plan.release:
                self.owner.release(partition)
        claimed = [p for p in plan.claim if self.owner.try_claim(p)]
        reading = set(self.requests.partitions)
        if self.owner.owned == reading:
            return
        # Owned but not read yet: claimed now, or in a round that failed half way.
        new = self.owner.owned - reading
        if new:
            # Their previous owner's last placements are in the log before its last
            # offsets were committed: read the log to its end before their requests.
            self._catch_up()
            window = timedelta(seconds=self.settings.request_max_age_s)
            with transaction(self.settings.database_url) as conn:
                seen = handled.load(conn, utcnow() - window)
            for one in seen:
                if one.partition in new:
                    self.dispatcher.gate.remember(one)
            self.dispatcher.leases.restart_clocks(
                lambda lease_id: key_partition(lease_id, self.partition_count) in new,
                time.monotonic(),
            )
        self.requests.reassign(self.owner.owned, self._stored_offsets())
        log.info(
            "scheduler: owns partitions %s of %s (%d schedulers; claimed %s, gave back %s)",
            sorted(self.owner.owned), self.settings.topic_requests, len(holders.members),
            claimed, list(plan.release),
        )  # fmt: skip

    def _lose_everything(self, exc: Exception) -> None:
        """The owner session failed: whatever it held is another's to take now. Read
        nothing more until partitions are claimed again (from their stored offsets)."""
        log.warning("scheduler: lost its partitions: %s", exc)
        self.owner.close()
        self.dispatcher.drop_pending(range(self.partition_count))
        # Ids handled since the last commit are the next owner's to record: whoever
        # reads their records again (this scheduler included) handles them anew.
        gate = self.dispatcher.gate
        for one in gate.unsaved:
            gate.handled.pop((one.key_id, one.request_id), None)
        gate.unsaved.clear()
        self.requests.reassign([], {})
        self._rebalanced = 0.0

    def _catch_up(self) -> None:
        """Follow ``dsec.events`` up to its end as of now."""
        ends = self.events.ends()
        out = Outbox()
        while not self._stopping.is_set() and any(
            self.events.position(partition) < end for partition, end in ends.items()
        ):
            for record in self.events.poll(timeout_ms=100, max_records=EVENTS_PER_READ):
                self.dispatcher.observe(out, record)
        self._flush(out)

    def _learn_ended(self, records: list[Record]) -> None:
        """Which sandboxes named by this batch (a request's key is its sandbox id)
        ended before this scheduler's memory: one query per batch, so an id is never
        given a second life after a restart either."""
        keys = {r.key.decode(errors="replace") for r in records if r.key}
        unknown = self.dispatcher.unknown_ids(keys)
        if not unknown:
            return
        with transaction(self.settings.database_url) as conn:
            rows = queries.ended_among(conn, unknown)
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
                self._ensure_replies(tenants)
                self._tenants = tenants
            self._tell_revoked()

    def _tell_revoked(self) -> None:
        """Tell the nodes of credentials revoked since this scheduler last told them
        (all of them, once, after its start: a node keeps what it was told)."""
        revoked = self.keyring.revoked()
        new = revoked - self._told_revoked
        if new:
            out = Outbox()
            self.dispatcher.tell_revoked(out, new)
            self._flush(out)
            self._told_revoked = revoked

    def _poll_events(self) -> list[Record]:
        return self.events.poll(timeout_ms=0, max_records=EVENTS_PER_READ)

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
        # Its partitions are free for the others at once (offsets were saved with the
        # last batch).
        self.owner.close()
        self.requests.close()
        self.events.close()
        self.lost_inboxes.close()
        self.bus_watch.stop()
        self.publisher.close()

    def stop(self, *_: object) -> None:
        """Finish after the current batch."""
        self._stopping.set()


def main(settings: Settings) -> None:
    """Run the scheduler until SIGTERM."""
    port = settings.scheduler_metrics_port
    metrics.serve(settings.metrics_port + 1 if port is None else port, settings.metrics_host)
    scheduler = Scheduler(settings)
    metrics.watch_placement(lambda: scheduler.placement.nodes.values())
    signal.signal(signal.SIGTERM, scheduler.stop)
    signal.signal(signal.SIGINT, scheduler.stop)
    heap.settle()
    scheduler.run()
