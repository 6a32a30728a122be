"""In-memory adapters of the platform's ports (:mod:`app.ports`), for unit tests and
benchmarks of the rules alone. The contract suites in ``tests/contracts/`` hold them
to what the real adapters do.

:class:`InMemoryPublisher` and :class:`InMemoryTransport` put a process's sends (a
scheduler's or a node's :class:`app.ports.Producer`, a trainer's
:class:`app.sdk.transport.Transport`) onto an :class:`InMemoryBus`, so the real
processes' logic can talk to each other in one test (tests/unit/test_round_trip.py).
"""

from __future__ import annotations

import random
import threading
from collections import defaultdict, deque
from collections.abc import Callable, Sequence

from app.domain.partitioner import key_partition
from app.domain.records import Inbound, Record
from app.ports import Bus, Headers


class InMemoryBus:
    """Topics as lists of records per partition; thread-safe."""

    def __init__(self) -> None:
        self._parts: dict[tuple[str, int], list[Inbound]] = defaultdict(list)
        self._changed = threading.Condition()

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
