"""The platform's ports: the small interfaces its parts see of the bus and the task
queue, each with a real adapter (:class:`app.kafka_bus.KafkaBus`,
:class:`app.consuming.PositionedConsumer`, :class:`app.taskqueue.CeleryTaskQueue`)
and an in-memory one (:mod:`app.memory`).

A :class:`PositionedReader` is how the projector, the scheduler and a node's inbox
read the bus: chosen partitions of one topic, from positions they store themselves.
A :class:`Producer` is the write half alone, as the processes that only send hold it
(:class:`app.bus.Publisher`, :class:`app.memory.InMemoryPublisher`): it may leave the
partition to the record's key, as Kafka's default partitioner does.

The contract suites in ``tests/contracts/`` run the same tests against both, so a
unit test that uses the in-memory one relies only on what the real one does too. The
trajectory log's port is the domain's (:class:`app.domain.trajectory.TrajectoryLog`),
the container driver's the node's (``workers/containers/port.py``).
"""

from __future__ import annotations

import uuid
from collections.abc import Collection, Sequence
from typing import Protocol

from app.domain.records import Record, StoredOffset

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


class PositionedReader(Protocol):
    """Reads chosen partitions of one topic from positions its owner stores.

    The reader keeps a position per partition it reads (the offset its next record
    comes from) and commits none anywhere: its owner stores the positions with the
    effects of the records (:class:`app.domain.records.StoredOffset`, tied to the
    topic's incarnation by :attr:`topic_id`) and hands them back to :meth:`seek`.
    """

    @property
    def all_partitions(self) -> Sequence[int]:
        """Every partition of the topic, in order (the reader may read only some)."""

    @property
    def partitions(self) -> Sequence[int]:
        """The partitions it reads, in order (possibly none)."""

    @property
    def topic_id(self) -> uuid.UUID:
        """The id of this incarnation of the topic: a topic deleted and made again
        under the same name gets another, so positions stored with it are told apart."""

    def seek(self, stored: dict[int, StoredOffset]) -> list[str]:
        """Read each partition from its stored offset: at its beginning if none is
        stored, and at its beginning too, with a warning returned (and logged), if
        the offset is no position in it: stored with another :attr:`topic_id`, or past
        the partition's end."""

    def reassign(self, partitions: Collection[int], stored: dict[int, StoredOffset]) -> list[str]:
        """Read ``partitions`` from now on: those it read already go on from where they
        stand, new ones start as :meth:`seek` starts them from ``stored``; returns
        the warnings of that seek. None at all: it reads nothing until reassigned."""

    def poll(self, timeout_ms: int = 200, max_records: int = 2000) -> list[Record]:
        """Up to ``max_records`` records from the partitions it reads, each partition's
        in order from its position, which moves past them; waits up to
        ``timeout_ms`` for the first and returns ``[]`` if none came. With no
        partition to read it sleeps ``timeout_ms`` and returns ``[]``."""

    def rewind(self, records: Sequence[Record]) -> None:
        """Read ``records`` again (polled, not handled): each of their partitions goes
        back to the first of them; the other partitions stay."""

    def ends(self) -> dict[int, int]:
        """Each partition it reads and its end: the offset its next record gets."""

    def position(self, partition: int) -> int:
        """The offset the next record read from ``partition`` (one it reads) has."""

    def close(self) -> None:
        """Let go of the topic; nothing is read after."""


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
