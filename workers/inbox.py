"""The node's inbox: commands straight from the scheduler, on the node's own topic.

A command through Celery cost more than the command itself: the scheduler's publish
to Redis, the worker's fetch, ack and task events, and Flower reading every event.
The data plane (Exec, KillCommand: see ``VIA_INBOX``) therefore comes on one Kafka
topic per node, ``<prefix>.node.<node id>`` (one partition, so in the order the
scheduler decided), sealed for this node exactly as a Celery task is, and is carried
out by the same code (``workers.tasks.perform``). Lifecycle stays on Celery.

Trainers write here too: a command proven under its sandbox's key comes straight from
its trainer (the direct route, ``workers/direct.py``), told apart by the credential
header only a trainer's record carries.

Exactly once: claiming a command is the same Redis ``SET NX`` as through Celery, so a
record read twice (after a restart) never runs twice. The position is kept in Redis
after each batch's claims, so a restart re-reads at most one batch.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from redis import Redis

from app.config import Settings
from app.consuming import IDLE_POLL_MS, dead_letter
from app.domain.codec import DeadLetterReason
from app.domain.direct import DirectRules
from app.domain.node_tasks import NodeTask, read_inbox_record
from app.domain.proof import HEADER_KEY, header
from app.domain.records import Record
from app.domain.requests import Exec
from app.errors import ServiceUnavailable
from app.ports import PositionedReader
from workers import direct, runtime, tasks
from workers.courier import Courier
from workers.errors import RedisFailed
from workers.redis_state import InboxPosition
from workers.tally import NodeTally

log = logging.getLogger(__name__)

#: Most records carried out per poll (each is a claim and a thread start: cheap).
BATCH = 500
#: Longest the inbox waits for the node's first reconcile round before reading.
READY_WAIT_S = 60.0


class Inbox:
    """Reads a node's inbox topic on a thread of its own and carries out its tasks."""

    def __init__(
        self,
        settings: Settings,
        node_id: str,
        courier: Courier,
        store: Redis,
        open_topic: Callable[[], PositionedReader],
        tally: NodeTally,
        rules: DirectRules,
    ) -> None:
        """``open_topic`` opens a reader of every partition of the node's inbox topic
        (again after the broker was away; the node's root opens a Kafka consumer);
        ``store`` keeps how far the node has read it; ``rules`` are what a direct
        command is checked against."""
        self.settings = settings
        self.node_id = node_id
        self.topic = settings.node_topic(node_id)
        self.name = f"inbox {node_id}"
        self._courier = courier
        self._tally = tally
        self._rules = rules
        self._position = InboxPosition(store, node_id)
        self._open_topic = open_topic
        self._stopping = threading.Event()
        self._ready: threading.Event | None = None
        self._thread = threading.Thread(target=self._run, name="dsec-inbox", daemon=True)

    def start(self, ready: threading.Event | None = None) -> None:
        """Read the topic in the background once ``ready`` is set (at most
        :data:`READY_WAIT_S` later): after a restart, not before the node listens again
        for the agents of the sandboxes it has, or their commands would find none. The
        topic is the platform's to make, with the node's credential (`dsec node add`):
        a node may read it, not create it."""
        self._ready = ready
        self._thread.start()

    def stop(self) -> None:
        """Stop after the current batch."""
        self._stopping.set()

    def _run(self) -> None:
        if self._ready is not None and not self._ready.wait(READY_WAIT_S):
            log.warning("%s: the node's first round is slow; reading anyway", self.name)
        while not self._stopping.is_set():
            try:
                self._serve()
            except (ServiceUnavailable, RedisFailed) as exc:
                log.warning("%s: waiting for the broker or Redis: %s", self.name, exc)
                self._tally.waiting(self.name, "broker", True)
                self._stopping.wait(1.0)
            except Exception:
                log.exception("%s: failed; starting over", self.name)
                self._stopping.wait(1.0)

    def _serve(self) -> None:
        consumer = self._open_topic()
        try:
            consumer.seek(self._position.stored())
            self._tally.waiting(self.name, "broker", False)
            log.info("%s: reading %s", self.name, self.topic)
            while not self._stopping.is_set():
                records = consumer.poll(timeout_ms=IDLE_POLL_MS, max_records=BATCH)
                if not records:
                    continue
                carry_out_all(records, self._rules, self.name)
                offsets = {record.partition: record.offset + 1 for record in records}
                self._position.save(consumer.topic_id, offsets)
        finally:
            consumer.close()


def carry_out_all(records: list[Record], rules: DirectRules, name: str) -> None:
    """The records of one poll, in order (see :func:`carry_out`): their direct commands
    claimed together, one round trip to Redis for the lot instead of one each (at a
    few hundred commands a second a poll brings ~10). Never raises."""
    starts: list[tuple[Exec, bytes | None]] = []
    for record in records:
        carry_out(record, rules, name, starts)
    _start(starts)


def carry_out(
    record: Record,
    rules: DirectRules,
    name: str,
    starts: list[tuple[Exec, bytes | None]],
) -> None:
    """One inbox record: a trainer's direct command, a revocation, or a task the
    scheduler sealed; refused (dead-lettered) if none of these. Never raises: one bad
    record must not stop the node's inbox.

    Direct commands gather in ``starts``, to be claimed together (one round trip to
    Redis for a whole poll's commands, not one each); any other record first starts
    those gathered before it, so a record acts after everything read before it.
    """
    node = runtime.node()
    if header(record.headers, HEADER_KEY) is not None:
        try:
            direct.carry_out(record, rules, name, starts)
        except Exception:
            log.exception("%s: a direct command failed", name)
        return
    _start(starts)
    opened = read_inbox_record(record.value or b"")
    if isinstance(opened, str):
        log.error("%s: refused a record: %s", name, opened)
        node.tally.dead_letter(name, DeadLetterReason.INVALID.value)
        dead_letter(
            node.courier.publisher, node.settings, name, record, DeadLetterReason.INVALID, opened
        )
        return
    task, args = opened
    try:
        if task == NodeTask.REVOKE_KEYS:
            direct.revoke(args, name)
        else:
            tasks.perform(task, tuple(args))
    except Exception:
        log.exception("%s: %s failed", name, task.value)


def _start(starts: list[tuple[Exec, bytes | None]]) -> None:
    """Claim and start the gathered commands; the list is emptied. Never raises."""
    if not starts:
        return
    try:
        tasks.start_commands(starts)
    except Exception:
        log.exception("starting %d commands failed", len(starts))
    finally:
        starts.clear()
