"""In-memory adapters of the platform's ports (:mod:`app.ports`), for unit tests and
benchmarks of the rules alone. The contract suites in ``tests/contracts/`` hold them
to what the real adapters do.

:class:`InMemoryPositionedReader` reads an :class:`InMemoryBus` as the projector, the
scheduler and a node's inbox read Kafka, so a test can publish on the bus and read
with it. :class:`InMemoryPublisher` and :class:`InMemoryTransport` put a process's sends (a
scheduler's or a node's :class:`app.ports.Producer`, a trainer's
:class:`app.sdk.transport.Transport`) onto an :class:`InMemoryBus`, so the real
processes' logic can talk to each other in one test (tests/unit/test_round_trip.py).
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from collections import defaultdict, deque
from collections.abc import Callable, Collection, Sequence

from app.domain.partitioner import key_partition
from app.domain.records import Inbound, Record, StoredOffset, first_offsets, not_a_position
from app.errors import ServiceUnavailable
from app.ports import Bus, Headers

log = logging.getLogger(__name__)


class InMemoryBus:
    """Topics as lists of records per partition; thread-safe.

    A record may go to any partition of any topic; a topic read through an
    :class:`InMemoryPositionedReader` is made first (:meth:`make_topic`), which gives it
    its partition count and the id of its incarnation."""

    def __init__(self) -> None:
        self._parts: dict[tuple[str, int], list[Inbound]] = defaultdict(list)
        #: Each made topic's partition count and incarnation id.
        self._topics: dict[str, tuple[int, uuid.UUID]] = {}
        self._changed = threading.Condition()

    def make_topic(self, topic: str, partitions: int) -> uuid.UUID:
        """Make ``topic`` with ``partitions`` partitions under a new id; returns it. A
        topic made again starts empty, as Kafka's does once deleted and made again."""
        with self._changed:
            for (name, _), part in self._parts.items():
                if name == topic:
                    # Emptied in place: a read waiting on the list sees the new one.
                    part.clear()
            made = self._topics[topic] = (partitions, uuid.uuid4())
            self._changed.notify_all()
            return made[1]

    def _made(self, topic: str) -> tuple[int, uuid.UUID]:
        with self._changed:
            made = self._topics.get(topic)
        if made is None:
            # As a Kafka consumer of a missing topic fails (app.bus.partitions).
            raise ServiceUnavailable(f"topic {topic} does not exist (never made)")
        return made

    def partition_count(self, topic: str) -> int:
        """How many partitions ``topic`` was made with."""
        return self._made(topic)[0]

    def topic_id(self, topic: str) -> uuid.UUID:
        """The id of this incarnation of ``topic`` (a new one each time it is made)."""
        return self._made(topic)[1]

    def publish(
        self,
        topic: str,
        key: str,
        value: bytes,
        *,
        partition: int,
        headers: Headers | None = None,
    ) -> None:
        with self._changed:
            part = self._parts[(topic, partition)]
            part.append(
                Inbound(topic, partition, len(part), key.encode(), value, list(headers or []))
            )
            self._changed.notify_all()

    def flush(self) -> None:
        """Nothing to wait for: a record is readable once published."""

    def read(
        self, topic: str, partition: int, offset: int, *, limit: int = 500, wait_s: float = 1.0
    ) -> list[Record]:
        with self._changed:
            part = self._parts[(topic, partition)]
            if not self._changed.wait_for(lambda: len(part) > offset, timeout=wait_s):
                return []
            return list(part[offset : offset + limit])

    def end(self, topic: str, partition: int) -> int:
        with self._changed:
            return len(self._parts[(topic, partition)])

    def _read_from(
        self, topic: str, positions: dict[int, int], limit: int, wait_s: float
    ) -> list[Inbound]:
        """Up to ``limit`` records of the partitions from their positions, partition
        after partition in the order given; waits up to ``wait_s`` for the first."""

        def found() -> list[Inbound]:
            out: list[Inbound] = []
            for partition, offset in positions.items():
                out.extend(self._parts[(topic, partition)][offset : offset + limit - len(out)])
            return out

        deadline = time.monotonic() + wait_s
        with self._changed:
            while not (got := found()):
                left = deadline - time.monotonic()
                if left <= 0:
                    return []
                self._changed.wait(left)
            return got


class InMemoryPositionedReader:
    """The :class:`app.ports.PositionedReader` over an :class:`InMemoryBus`: chosen
    partitions of one topic the bus made, from positions the caller stores. A
    partition assigned and never sought is read from its beginning, as Kafka's
    consumers here are (``auto_offset_reset``: earliest)."""

    def __init__(
        self, bus: InMemoryBus, topic: str, name: str, partitions: Collection[int] | None = None
    ) -> None:
        self._bus = bus
        self.topic = topic
        self.name = name
        #: Every partition of the topic (a caller may read only some).
        self.all_partitions = list(range(bus.partition_count(topic)))
        # Learnt once, as a Kafka consumer learns it from its first metadata.
        self._topic_id = bus.topic_id(topic)
        #: The partitions read.
        self.partitions = self._of(self.all_partitions if partitions is None else partitions)
        self._next = dict.fromkeys(self.partitions, 0)
        #: Where the next poll starts, so no partition starves the others.
        self._turn = 0

    def _of(self, partitions: Collection[int]) -> list[int]:
        return [p for p in self.all_partitions if p in partitions]

    @property
    def topic_id(self) -> uuid.UUID:
        """The id of the incarnation of the topic being read."""
        return self._topic_id

    def seek(self, stored: dict[int, StoredOffset]) -> list[str]:
        """See :meth:`app.ports.PositionedReader.seek`."""
        return self._seek(stored, self.partitions)

    def _seek(self, stored: dict[int, StoredOffset], partitions: Sequence[int]) -> list[str]:
        warnings: list[str] = []
        for partition in partitions:
            saved = stored.get(partition)
            if saved is None:
                self._next[partition] = 0
                continue
            end = self._bus.end(self.topic, partition)
            why = not_a_position(self.name, self.topic, partition, saved, self._topic_id, end)
            if why is not None:
                warnings.append(why)
            self._next[partition] = 0 if why is not None else saved.next_offset
        for warning in warnings:
            log.warning(warning)
        return warnings

    def reassign(self, partitions: Collection[int], stored: dict[int, StoredOffset]) -> list[str]:
        """See :meth:`app.ports.PositionedReader.reassign`."""
        kept = set(self.partitions)
        self.partitions = self._of(partitions)
        self._next = {p: n for p, n in self._next.items() if p in self.partitions}
        return self._seek(stored, [p for p in self.partitions if p not in kept])

    def poll(self, timeout_ms: int = 200, max_records: int = 2000) -> list[Record]:
        """See :meth:`app.ports.PositionedReader.poll`."""
        if not self.partitions:
            time.sleep(timeout_ms / 1000)
            return []
        self._turn = (self._turn + 1) % len(self.partitions)
        order = self.partitions[self._turn :] + self.partitions[: self._turn]
        positions = {p: self._next[p] for p in order}
        records = self._bus._read_from(self.topic, positions, max_records, timeout_ms / 1000)
        for record in records:
            self._next[record.partition] = record.offset + 1
        return list(records)

    def rewind(self, records: Sequence[Record]) -> None:
        """See :meth:`app.ports.PositionedReader.rewind`."""
        for partition, offset in first_offsets(records).items():
            if partition in self._next:
                self._next[partition] = offset

    def ends(self) -> dict[int, int]:
        """Each partition read and the offset its next record gets."""
        return {p: self._bus.end(self.topic, p) for p in self.partitions}

    def position(self, partition: int) -> int:
        """The offset the next read of ``partition`` starts at."""
        return self._next[partition]

    def close(self) -> None:
        """Nothing to let go of: it reads nothing more."""
        self.partitions = []
        self._next = {}


class InMemoryTaskQueue:
    """Queues as deques; thread-safe."""

    def __init__(self) -> None:
        self._queues: dict[str, deque[tuple[str, list[str]]]] = defaultdict(deque)
        self._changed = threading.Condition()

    def send(self, task: str, queue: str, args: Sequence[str]) -> None:
        with self._changed:
            self._queues[queue].append((task, list(args)))
            self._changed.notify_all()

    def take(self, queue: str, wait_s: float = 1.0) -> tuple[str, list[str]] | None:
        with self._changed:
            waiting = self._queues[queue]
            if not self._changed.wait_for(lambda: len(waiting) > 0, timeout=wait_s):
                return None
            return waiting.popleft()


class InMemoryPublisher:
    """A :class:`app.bus.Publisher` in front of a bus: a record with no partition
    goes to its key's (Kafka's default partitioner, over ``partitions(topic)``), and
    every record is stored at once, so ``on_stored`` is called before
    :meth:`publish` returns and ``on_failure`` never is."""

    def __init__(self, bus: Bus, partitions: Callable[[str], int]) -> None:
        self._bus = bus
        self._partitions = partitions

    def publish(
        self,
        topic: str,
        key: str,
        value: bytes,
        *,
        partition: int | None = None,
        headers: Headers | None = None,
        on_failure: Callable[[BaseException], None] | None = None,
        on_stored: Callable[[], None] | None = None,
    ) -> None:
        """Append the record; see :meth:`app.bus.Publisher.publish`."""
        if partition is None:
            partition = key_partition(key, self._partitions(topic))
        self._bus.publish(topic, key, value, partition=partition, headers=headers)
        if on_stored is not None:
            on_stored()

    def flush(self, timeout_s: float = 30.0) -> None:
        """Nothing waits: every record is stored once published."""
        self._bus.flush()

    def close(self) -> None:
        """Nothing to let go of."""


class _RepliesPartition:
    """One partition of a bus, read on from where it stood when followed, as a Kafka
    consumer assigned there at its end reads it."""

    def __init__(self, bus: Bus, topic: str, partition: int) -> None:
        self._bus = bus
        self._topic, self._partition = topic, partition
        self._next = bus.end(topic, partition)

    def poll(self, timeout_ms: int) -> dict[tuple[str, int], list[Record]]:
        records = self._bus.read(self._topic, self._partition, self._next, wait_s=timeout_ms / 1000)
        if not records:
            return {}
        self._next = records[-1].offset + 1
        return {(self._topic, self._partition): records}


class InMemoryTransport:
    """A trainer's way to the platform (:class:`app.sdk.transport.Transport`) over a
    bus: requests published as :class:`InMemoryPublisher` does, replies read from one
    partition of the replies topic picked at random, from its end."""

    def __init__(self, bus: Bus, partitions: Callable[[str], int]) -> None:
        self._bus = bus
        self._partitions = partitions
        self._publisher = InMemoryPublisher(bus, partitions)

    def publish(
        self,
        topic: str,
        key: str,
        value: bytes,
        *,
        headers: Headers | None = None,
        on_failure: Callable[[BaseException], None] | None = None,
        on_stored: Callable[[], None] | None = None,
    ) -> None:
        """Send a request to its key's partition."""
        self._publisher.publish(
            topic, key, value, headers=headers, on_failure=on_failure, on_stored=on_stored
        )

    def follow(self, topic: str) -> tuple[int, _RepliesPartition]:
        """Read one partition of ``topic`` from now on: its number, and its records."""
        partition = random.randrange(self._partitions(topic))
        return partition, _RepliesPartition(self._bus, topic, partition)

    def close(self) -> None:
        """Nothing to let go of."""
