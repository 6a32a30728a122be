"""Partition counts of replies topics, from a producer's metadata, cached briefly:
where a scheduler or a node checks a request's ``reply_to`` before answering it (a send
to a partition that does not exist would block the producer)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol


class Metadata(Protocol):
    """What the cache asks (:class:`app.bus.Publisher` answers)."""

    def partitions_of(self, topic: str, wait_s: float) -> int | None: ...


#: How long a topic's partition count is believed before the producer's metadata is
#: read again (a topic made again with another count is noticed).
PARTITIONS_TTL_S = 5.0
#: How long a topic the broker did not know stays unknown before it is asked for
#: again, and how long asking may wait: a batch waits that long at most, once per
#: unknown topic and period (only a proven tenant's own topic is ever asked for).
UNKNOWN_TOPIC_TTL_S = 10.0
UNKNOWN_TOPIC_WAIT_S = 0.5


class PartitionCache:
    """A topic's partition count, as ``publisher()``'s metadata last said."""

    def __init__(self, publisher: Callable[[], Metadata]) -> None:
        self._publisher = publisher
        self._counts: dict[str, tuple[int | None, float]] = {}

    def __call__(self, topic: str) -> int | None:
        now = time.monotonic()
        cached = self._counts.get(topic)
        if cached is not None and now < cached[1]:
            return cached[0]
        count = self._publisher().partitions_of(topic, UNKNOWN_TOPIC_WAIT_S)
        self._counts[topic] = (count, now + (PARTITIONS_TTL_S if count else UNKNOWN_TOPIC_TTL_S))
        return count
