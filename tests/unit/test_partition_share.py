"""Several schedulers share a topic's partitions: fair shares, what to claim and give
back, and what a scheduler learns from the others' events so it can take over."""

from __future__ import annotations

import json
import time

import pytest

from app.config import Settings
from app.consuming import key_partition
from app.control.outbox import Outbox
from app.domain.base import StopReason
from app.domain.events import FreezePayload, SandboxFrozen, SandboxStopped, StoppedPayload
from app.domain.lease import LeaseState
from app.domain.partition_share import fair_share, rebalance
from app.domain.proof import SCHEDULER_KEY_ID, Purpose
from app.domain.records import Inbound
from app.domain.requests import CreateGroup, CreateSandbox, Exec
from tests.unit.signing import KEYS, inbox_tasks, reply_to, task_request
from tests.unit.test_dispatch_groups import _dispatcher, _record

# --- arithmetic ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("partitions", "members", "share"),
    [(8, 1, 8), (8, 2, 4), (8, 3, 3), (8, 8, 1), (8, 9, 1), (8, 0, 8), (0, 2, 0), (7, 2, 4)],
)
def test_fair_share(partitions: int, members: int, share: int) -> None:
    assert fair_share(partitions, members) == share


def test_a_lone_scheduler_claims_every_free_partition() -> None:
    plan = rebalance(owned=set(), free=set(range(8)), partitions=8, members=1)
    assert plan.claim == tuple(range(8)) and plan.release == ()


def test_a_second_scheduler_makes_the_first_give_back_its_highest_half() -> None:
    # Given one scheduler holding all 8 partitions when a second one joins
    first = rebalance(owned=set(range(8)), free=set(), partitions=8, members=2)
    # Then the first gives back 4 (its highest), and the newcomer claims them
    assert first.release == (4, 5, 6, 7) and first.claim == ()
    second = rebalance(owned=set(), free={4, 5, 6, 7}, partitions=8, members=2)
    assert second.claim == (4, 5, 6, 7) and second.release == ()


def test_at_its_share_a_scheduler_does_nothing() -> None:
    plan = rebalance(owned={0, 1, 2, 3}, free=set(), partitions=8, members=2)
    assert plan.claim == () and plan.release == ()


def test_the_survivor_takes_a_dead_schedulers_partitions() -> None:
    # Given two schedulers at 4 each, one dies: its session's locks are free, one member
    plan = rebalance(owned={0, 1, 2, 3}, free={4, 5, 6, 7}, partitions=8, members=1)
    assert plan.claim == (4, 5, 6, 7)


def test_shares_cover_every_partition_whatever_the_membership() -> None:
    # Claims of every member, each up to its share, leave nothing free
    for members in range(1, 10):
        free, owned = set(range(8)), [set[int]() for _ in range(members)]
        for mine in owned:
            plan = rebalance(mine, free, 8, members)
            mine.update(plan.claim)
            free -= set(plan.claim)
        assert free == set(), members
        assert max(len(m) for m in owned) <= fair_share(8, members)


def test_partitions_beyond_the_topic_are_ignored() -> None:
    plan = rebalance(owned={0, 9}, free={1, 12}, partitions=2, members=1)
    assert plan.claim == (1,) and plan.release == ()


def test_key_partition_is_kafkas_default_partitioner() -> None:
    # murmur2 of the key, as the Java client and kafka-python place a keyed record
    # (values from kafka-python's own partitioner on an 8-partition topic)
    from kafka.partitioner.default import murmur2

    for key in ("sb-1", "lease-abc", "x" * 60, "", "é", *(("k" * n) for n in range(1, 9))):
        assert key_partition(key, 8) == (murmur2(key.encode()) & 0x7FFFFFFF) % 8
        assert 0 <= key_partition(key, 8) < 8


# --- what a scheduler learns from the others' events ---------------------------------


def _as_records(out: Outbox) -> list[Inbound]:
    """The events of another scheduler's outbox, as this one reads them from the log."""
    from app.domain.proof import headers

    info = KEYS.lookup(SCHEDULER_KEY_ID)
    assert info is not None
    return [
        Inbound(topic="dsec.events", partition=0, offset=i, key=key.encode(), value=value,
                headers=headers(Purpose.EVENT, SCHEDULER_KEY_ID, info.secret, value))
        for i, (key, value) in enumerate(out.events)
    ]  # fmt: skip


def test_placements_of_another_scheduler_count_and_can_be_taken_over() -> None:
    # Given two schedulers that see the same two nodes of 4 CPUs
    a, b = _dispatcher(), _dispatcher()
    # When A places a sandbox of 3 CPUs and a group of two of 1 CPU
    out = Outbox()
    create = CreateSandbox(sandbox_id="sb-big", tenant="t", cpus=3, reply_to=reply_to())
    a.handle(out, _record(create))
    group = CreateGroup(sandbox_id="grp-1", tenant="t", members=["sb-m0", "sb-m1"], cpus=1)
    a.handle(out, _record(group))
    # and B reads A's events
    for record in _as_records(out):
        b.observe(Outbox(), record)
    # Then B counts the room they take on the same nodes
    for node_id, node in a.placement.nodes.items():
        theirs = b.placement.nodes[node_id]
        assert (theirs.used_sandboxes, theirs.used_cpus) == (node.used_sandboxes, node.used_cpus)
    # and knows them as A does: a redelivered create is a no-op, the group is one
    assert b.created_by == a.created_by
    assert b.groups == {("t", "grp-1"): ["sb-m0", "sb-m1"]}
    assert b.book.unstarted == {"sb-big", "sb-m0", "sb-m1"}
    again = Outbox()
    b.handle(again, _record(create))  # read again by B after a takeover
    assert again.tasks == [] and again.events == [] and again.replies == []
    # and routes requests for them to the node A chose
    routed = Outbox()
    b.handle(routed, _record(Exec(sandbox_id="sb-big", tenant="t", command="true")))
    [(topic, _task, args)] = inbox_tasks(routed)
    assert topic == f"dsec.node.{a.placement.allocations['sb-big'].node_id}"
    assert task_request(args)["sandbox_id"] == "sb-big"


def test_reading_its_own_events_back_changes_nothing() -> None:
    a = _dispatcher()
    out = Outbox()
    a.handle(out, _record(CreateSandbox(sandbox_id="sb-own", tenant="t", cpus=2)))
    before = {n: (v.used_sandboxes, v.used_cpus) for n, v in a.placement.nodes.items()}
    for record in _as_records(out):
        a.observe(Outbox(), record)
    assert {n: (v.used_sandboxes, v.used_cpus) for n, v in a.placement.nodes.items()} == before


def test_a_stop_by_another_scheduler_answers_the_trainer_waiting_here() -> None:
    # Given B placed a sandbox whose start a trainer waits for
    b = _dispatcher()
    b.handle(Outbox(), _record(CreateSandbox(sandbox_id="sb-w", tenant="t", reply_to=reply_to())))
    node = b.placement.allocations["sb-w"].node_id
    # When A, which declared its node lost, stops it
    stop = SandboxStopped(
        sandbox_id="sb-w", node_id=node, tenant="t", job_id="default",
        payload=StoppedPayload(reason=StopReason.NODE_LOST, detail=f"{node}: silent"),
    )  # fmt: skip
    out = Outbox()
    b.observe(out, _record(stop, key_id=SCHEDULER_KEY_ID))
    # Then B tells its trainer, and forgets the sandbox
    (reply,) = [json.loads(body) for _, _, body, _ in out.replies]
    assert reply["reason"] == "node_lost" and reply["sandbox_id"] == "sb-w"
    assert "sb-w" not in b.placement.allocations


def test_only_the_owner_of_a_leases_partition_keeps_its_clock() -> None:
    # Given a scheduler that knows a lease (created with it) but does not own the
    # partition its renewals are read from
    settings = Settings(lease_ttl_s=0.01, lease_grace_s=300)
    b = _dispatcher(settings)
    b.leases.keeps = lambda _lease_id: False
    create = CreateSandbox(sandbox_id="sb-l", tenant="t", lease_id="lease-1")
    b.handle(Outbox(), _record(create))
    lease = b.leases[("t", "lease-1")]
    lease.expires_s = 0.0  # long past
    # When its clock would have run out
    out = Outbox()
    b.check_leases(out)
    # Then it does nothing (the owner hears the renewals)
    assert out.tasks == [] and lease.state == LeaseState.HELD
    # But a freeze the owner made is learned from the log: requests are refused here too
    node = b.placement.allocations["sb-l"].node_id
    frozen = SandboxFrozen(
        sandbox_id="sb-l", node_id=node, tenant="t", job_id="default",
        payload=FreezePayload(reason="lease_lapsed"),
    )  # fmt: skip
    b.observe(Outbox(), _record(frozen))
    assert lease.state == LeaseState.LAPSED
    # And once it owns that partition, the lease starts a fresh grace on its clock
    b.leases.keeps = lambda _lease_id: True
    b.leases.restart_clocks(b.leases.keeps, time.monotonic())
    assert b.check_leases(Outbox()) is None and lease.state == LeaseState.LAPSED


def test_creates_waiting_for_room_on_a_partition_given_away_are_dropped() -> None:
    a = _dispatcher(cpus=1)
    a.handle(Outbox(), _record(CreateSandbox(sandbox_id="sb-1", tenant="t", cpus=1)))
    a.handle(Outbox(), _record(CreateSandbox(sandbox_id="sb-2", tenant="t", cpus=1)))
    a.handle(Outbox(), _record(CreateSandbox(sandbox_id="sb-3", tenant="t", cpus=1, queue_s=60)))
    [waiting] = a.pending
    others = [p for p in range(8) if p != waiting.partition]
    a.drop_pending(others)
    assert len(a.pending) == 1  # read from its own partition
    a.drop_pending([waiting.partition])
    assert a.pending == []


def test_the_keeper_of_a_lease_is_not_refrozen_by_a_late_freeze_event() -> None:
    # Given the scheduler that keeps a lease, whose trainer renewed it after a lapse
    a = _dispatcher()
    a.handle(Outbox(), _record(CreateSandbox(sandbox_id="sb-k", tenant="t", lease_id="lease-2")))
    lease = a.leases[("t", "lease-2")]
    # When the freeze event of the lapse arrives after the renewal
    node = a.placement.allocations["sb-k"].node_id
    frozen = SandboxFrozen(
        sandbox_id="sb-k", node_id=node, tenant="t", job_id="default",
        payload=FreezePayload(reason="lease_lapsed"),
    )  # fmt: skip
    a.observe(Outbox(), _record(frozen))
    # Then its own state stands: the lease is held
    assert lease.state == LeaseState.HELD
