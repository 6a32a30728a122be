"""In-memory adapters of the platform's ports (:mod:`app.ports`), for unit tests and
benchmarks of the rules alone. The contract suites in ``tests/contracts/`` hold them
to what the real adapters do."""

from __future__ import annotations

import threading
from collections import defaultdict, deque
from collections.abc import Sequence

from app.domain.records import Inbound, Record
from app.ports import Headers


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
