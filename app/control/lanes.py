"""The projector's batches and the lanes that commit them, one thread per lane.

A batch is cut by partition (:func:`split_lanes`) so that lanes commit in parallel on
their own connections while each partition's records stay in order on one lane.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from app.db import log as event_log
from app.db.errors import UNAVAILABLE
from app.domain.records import Record

log = logging.getLogger(__name__)

#: Parts a lane holds queued or committing at once. Kafka hands a poll's records over
#: partition by partition, so one batch often feeds one lane only: with a single part
#: in flight the reader waited for that lane while the other lanes idled.
LANE_DEPTH = 2


@dataclass
class BatchOutcome:
    """What one batch did."""

    appended: int = 0
    duplicates: int = 0
    dead: int = 0
    offsets: dict[int, int] = field(default_factory=dict)


@dataclass
class Prepared:
    """A decoded batch, its dead letters already sent, ready for its transaction."""

    good: list[event_log.SourcedEvent]
    #: The record each of ``good`` came from, in the same order.
    records: list[Record]
    outcome: BatchOutcome
    #: ``good`` holds only what the log admits about its sandboxes (:meth:`Projector.screen`).
    screened: bool = False


class LaneBroken(RuntimeError):
    """A part was not committed because an earlier part of its lane failed."""


class Lane:
    """One committer thread, the parts it has in flight, and whether one of them failed."""

    def __init__(self, name: str, commit: Callable[[Prepared], BatchOutcome]) -> None:
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=name)
        self._commit = commit
        self._inflight: deque[Future[BatchOutcome]] = deque()
        # Set and read on the lane's own thread only; cleared once it has settled.
        self._broken = False

    def submit(self, part: Prepared) -> None:
        """Queue ``part`` behind the lane's others (waiting while the lane is full)."""
        while len(self._inflight) >= LANE_DEPTH:
            self._inflight.popleft().result()
        self._inflight.append(self._executor.submit(self._run, part))

    def check(self) -> None:
        """Raise the failure of a part that has ended, if one did."""
        while self._inflight and self._inflight[0].done():
            self._inflight.popleft().result()

    def _run(self, part: Prepared) -> BatchOutcome:
        if self._broken:
            raise LaneBroken("an earlier batch of this lane failed")
        try:
            return self._commit(part)
        except BaseException:
            self._broken = True
            raise

    def settle(self) -> None:
        """Wait for every part in flight to end, committed or not; mend the lane."""
        while self._inflight:
            try:
                self._inflight.popleft().result()
            except LaneBroken:
                pass
            except UNAVAILABLE as exc:
                log.warning("batch not committed (%s); it is read again", type(exc).__name__)
            except Exception:
                log.exception("batch failed; it is read again from stored offsets")
        self._broken = False

    def close(self) -> None:
        """Stop the thread, after what it was given."""
        self._executor.shutdown(wait=True)


def split_lanes(batch: Prepared, lanes: int) -> list[Prepared | None]:
    """``batch`` cut by partition into ``lanes`` parts (None where a lane got nothing).

    Each part keeps its records' order and carries the offsets of its partitions only,
    so its transaction moves just those. Dead letters were sent already; they are
    counted in the part that carries their partition's offset.
    """
    if lanes == 1:
        return [batch]
    parts: list[Prepared | None] = [None] * lanes

    def part(partition: int) -> Prepared:
        lane = partition % lanes
        made = parts[lane]
        if made is None:
            made = parts[lane] = Prepared([], [], BatchOutcome())
        return made

    for partition, offset in batch.outcome.offsets.items():
        part(partition).outcome.offsets[partition] = offset
    for item, record in zip(batch.good, batch.records, strict=True):
        into = part(record.partition)
        into.good.append(item)
        into.records.append(record)
    if batch.outcome.dead:
        next(p for p in parts if p is not None).outcome.dead += batch.outcome.dead
    return parts
