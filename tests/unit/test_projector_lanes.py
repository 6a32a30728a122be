"""Cutting a batch into lanes: each partition whole in one lane, offsets with it."""

from __future__ import annotations

import threading
import uuid

import pytest

from app.control.lanes import BatchOutcome, Lane, Prepared, split_lanes
from app.db.log import SourcedEvent
from app.domain.events import NodeLost, NodeLostPayload
from app.domain.records import Inbound, Record


def _batch(partitions: list[int], dead: int = 0) -> Prepared:
    topic_id = uuid.uuid4()
    good: list[SourcedEvent] = []
    records: list[Record] = []
    offsets: dict[int, int] = {}
    for n, partition in enumerate(partitions):
        event = NodeLost(node_id=f"n{n}", payload=NodeLostPayload(detail=str(n)))
        good.append(SourcedEvent(event, "t", topic_id, partition, n))
        records.append(Inbound("t", partition, n, None, b""))
        offsets[partition] = n + 1
    return Prepared(good, records, BatchOutcome(dead=dead, offsets=offsets))


def test_each_partition_goes_whole_to_one_lane_in_order() -> None:
    batch = _batch([0, 1, 2, 3, 0, 1, 4, 2])
    parts = split_lanes(batch, 2)
    assert [p is not None for p in parts] == [True, True]
    even, odd = parts
    assert even is not None and odd is not None
    assert [r.partition for r in even.records] == [0, 2, 0, 4, 2]
    assert [r.partition for r in odd.records] == [1, 3, 1]
    assert [r.offset for r in even.records] == [0, 2, 4, 6, 7]
    # Items stay paired with their records, and each lane moves its own offsets only.
    for part in parts:
        assert part is not None
        assert [i.offset for i in part.good] == [r.offset for r in part.records]
    assert even.outcome.offsets == {0: 5, 2: 8, 4: 7}
    assert odd.outcome.offsets == {1: 6, 3: 4}


def test_a_lane_without_partitions_gets_nothing_and_dead_letters_are_counted_once() -> None:
    # A batch of dead letters only: offsets move, no good events.
    batch = Prepared([], [], BatchOutcome(dead=3, offsets={2: 10, 5: 7}))
    parts = split_lanes(batch, 3)
    assert parts[0] is None and parts[1] is None
    got = {p: part.outcome.offsets for p, part in enumerate(parts) if part is not None}
    assert got == {2: {2: 10, 5: 7}}
    assert sum(part.outcome.dead for part in parts if part is not None) == 3


def test_one_lane_is_the_batch_itself() -> None:
    batch = _batch([3, 1])
    assert split_lanes(batch, 1) == [batch]


def test_a_failed_part_stops_the_parts_queued_behind_it_in_its_lane() -> None:
    # Given a lane whose first part fails slowly while a second one waits behind it
    committed: list[int] = []
    release = threading.Event()

    def commit(part: Prepared) -> BatchOutcome:
        number = part.outcome.offsets[0]
        if number == 1:
            release.wait(5)
            raise RuntimeError("database gone")
        committed.append(number)
        return part.outcome

    lane = Lane("test-lane", commit)
    try:
        lane.submit(Prepared([], [], BatchOutcome(offsets={0: 1})))
        lane.submit(Prepared([], [], BatchOutcome(offsets={0: 2})))
        release.set()
        # Then the failure surfaces, the part behind it is not committed (its offsets
        # would pass the failed events), and once settled the lane commits again
        with pytest.raises(RuntimeError, match="database gone"):
            lane.submit(Prepared([], [], BatchOutcome(offsets={0: 3})))
        lane.settle()
        assert committed == []
        lane.submit(Prepared([], [], BatchOutcome(offsets={0: 4})))
        lane.settle()
        assert committed == [4]
    finally:
        lane.close()
