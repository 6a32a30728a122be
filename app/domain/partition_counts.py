"""How many partitions the topics a request involves have, as the broker says.

The gate refuses a reply partition that does not exist and a request read on another
partition than its key's; both need the real counts, not the ones the platform asks
for when it makes topics (``DSEC_REPLY_PARTITIONS``): a topic made beforehand, or by
a broker that makes topics on a client's question, may have fewer. The scheduler
answers from its Kafka clients' metadata (app/control/scheduler.py); tests and
benchmarks fix the counts (:class:`FixedPartitions`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class PartitionCounts(Protocol):
    """The partition counts the gate checks requests against."""

    def requests(self) -> int:
        """Partitions of the requests topic being read."""
        ...

    def replies(self, topic: str) -> int | None:
        """Partitions of a replies topic; None: no such topic is known (nothing can be
        sent there)."""
        ...


@dataclass(frozen=True)
class FixedPartitions:
    """Counts that never change: every replies topic has ``replies_each`` (unit tests,
    benchmarks of the rules, in-memory buses)."""

    requests_topic: int = 8
    replies_each: int = 16

    def requests(self) -> int:
        return self.requests_topic

    def replies(self, topic: str) -> int | None:
        return self.replies_each
