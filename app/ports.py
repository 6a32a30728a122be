"""The platform's ports: the small interfaces its parts see of the bus and the task
queue, each with a real adapter (:class:`app.kafka_bus.KafkaBus`,
:class:`app.taskqueue.CeleryTaskQueue`) and an in-memory one (:mod:`app.memory`).

A :class:`Producer` is the write half alone, as the processes that only send hold it
(:class:`app.bus.Publisher`, :class:`app.memory.InMemoryPublisher`): it may leave the
partition to the record's key, as Kafka's default partitioner does.

The contract suites in ``tests/contracts/`` run the same tests against both, so a
unit test that uses the in-memory one relies only on what the real one does too. The
trajectory log's port is the domain's (:class:`app.domain.trajectory.TrajectoryLog`),
the container driver's the node's (``workers/containers/port.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from app.domain.records import Record

Headers = Sequence[tuple[str, bytes]]


class Bus(Protocol):
    """A log of records in numbered partitions of named topics.

    Records published to one partition are read back in the order they were
    published, at consecutive offsets from 0, with their key, value and headers;
    a reader names where it starts, so it can stop and resume from any position.
    """

    def publish(
        self,
        topic: str,
        key: str,
        value: bytes,
        *,
        partition: int,
        headers: Headers | None = None,
    ) -> None:
        """Append one record to a partition of ``topic`` (delivered by :meth:`flush`)."""

    def flush(self) -> None:
        """Return once every record published before is stored and readable."""

    def read(
        self, topic: str, partition: int, offset: int, *, limit: int = 500, wait_s: float = 1.0
    ) -> list[Record]:
        """Up to ``limit`` records of the partition from ``offset`` on, in order; waits
        up to ``wait_s`` for the first one and returns ``[]`` if none came."""

    def end(self, topic: str, partition: int) -> int:
        """The offset the partition's next record will get."""


class Producer(Protocol):
    """Sends records: the schedulers' and the nodes' one way onto the bus."""

    def publish(
        self,
        topic: str,
        key: str,
        value: bytes,
        /,
        *,
        partition: int | None = None,
        headers: Headers | None = None,
    ) -> None:
        """Send one record to ``partition`` of ``topic`` (None: the partition of its
        key, as Kafka's default partitioner picks it); delivered by :meth:`flush`."""

    def flush(self) -> None:
        """Return once every record sent before is stored (raises if one was not)."""


class TaskQueue(Protocol):
    """Named queues of tasks, each a name and its arguments (strings: the sealed
    envelopes of :mod:`app.domain.node_tasks`), delivered to whoever takes from the
    queue they were sent to, in the order sent."""

    def send(self, task: str, queue: str, args: Sequence[str]) -> None:
        """Queue one task."""

    def take(self, queue: str, wait_s: float = 1.0) -> tuple[str, list[str]] | None:
        """The oldest task of ``queue`` as (name, args), removed from it; ``None`` if the
        queue stayed empty for ``wait_s``."""
