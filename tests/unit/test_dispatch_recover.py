"""A restarted scheduler takes up what the log shows: nodes, allocations, groups, leases."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from app.config import Settings
from app.control.dispatch import Dispatcher, LiveSandbox
from app.control.outbox import Outbox
from app.domain.codec import decode_event
from app.domain.lease import LeaseState
from app.domain.node_tasks import TASK_FOR_REQUEST
from app.domain.requests import GROUP_LABEL, LEASE_LABEL, CreateSandbox, RenewLease
from tests.unit.signing import KEYS, PARTITIONS, task_request
from tests.unit.test_dispatch_groups import _record


@dataclass(frozen=True)
class Row:
    """A ``nodes`` row as the scheduler reads it."""

    queue: str = "node.n0"
    capacity_sandboxes: int = 2
    capacity_cpus: float = 8.0
    capacity_memory_mb: int = 8192
    images: list[str] = field(default_factory=list)


def _live(sandbox_id: str, labels: dict[str, str], frozen: bool = False) -> LiveSandbox:
    return LiveSandbox(
        sandbox_id=sandbox_id, node_id="n0", cpus=1.0, memory_mb=256, tenant="t", job_id="j",
        labels=labels, frozen=frozen,
    )  # fmt: skip


def _recovered(*live: LiveSandbox) -> Dispatcher:
    dispatcher = Dispatcher(Settings(lease_ttl_s=30, lease_grace_s=300), KEYS, PARTITIONS)
    dispatcher.recover([("n0", Row())], live)
    return dispatcher


def test_recovered_sandboxes_hold_their_room_and_groups() -> None:
    dispatcher = _recovered(
        _live("sb-a", {GROUP_LABEL: "grp-1"}), _live("sb-b", {GROUP_LABEL: "grp-1"})
    )
    node = dispatcher.placement.nodes["n0"]
    assert (node.used_sandboxes, node.used_cpus, node.confirmed) == (2, 2.0, False)
    assert dispatcher.groups == {("t", "grp-1"): ["sb-a", "sb-b"]}
    # Full (2 of 2): once the node is heard from, a third sandbox still waits.
    node.confirmed = True
    out = Outbox()
    dispatcher.handle(out, _record(CreateSandbox(sandbox_id="sb-c", tenant="t", queue_s=0)))
    assert out.tasks == []


def test_leases_come_back_from_the_labels() -> None:
    dispatcher = _recovered(
        _live("sb-a", {LEASE_LABEL: "lease-1"}), _live("sb-b", {LEASE_LABEL: "lease-1"})
    )
    lease = dispatcher.leases[("t", "lease-1")]
    assert lease.sandboxes == {"sb-a", "sb-b"}
    assert lease.state == LeaseState.HELD
    assert lease.expires_s > time.monotonic() + 20  # a fresh TTL: the trainer may renew


def test_a_frozen_lease_is_recovered_lapsed_and_a_renewal_thaws_it() -> None:
    dispatcher = _recovered(_live("sb-a", {LEASE_LABEL: "lease-1"}, frozen=True))
    assert dispatcher.leases[("t", "lease-1")].state == LeaseState.LAPSED
    out = Outbox()
    dispatcher.handle(out, _record(RenewLease(sandbox_id="lease-1", tenant="t")))
    assert [(task, queue) for task, queue, _ in out.tasks] == [
        (TASK_FOR_REQUEST["ThawSandbox"], "node.n0")
    ]
    assert task_request(out.tasks[0][2])["sandbox_id"] == "sb-a"


def test_a_leased_create_records_its_lease_in_the_log() -> None:
    dispatcher = _recovered()
    dispatcher.placement.nodes["n0"].confirmed = True
    out = Outbox()
    create = CreateSandbox(sandbox_id="sb-l", tenant="t", lease_id="lease-9")
    dispatcher.handle(out, _record(create))
    requested = [decode_event(v) for _, v in out.events if b"SandboxRequested" in v]
    assert requested[0].payload.labels[LEASE_LABEL] == "lease-9"  # type: ignore[union-attr]


def test_the_metrics_say_a_recovered_node_is_not_placed_on_until_it_is_heard() -> None:
    # `dsec up` waits for this gauge: a heartbeat in the projection is not yet one the
    # scheduler has read, and until it has, every create goes to the other nodes.
    from prometheus_client import CollectorRegistry, generate_latest

    from app.metrics import NODE_PLACEABLE, PlacementCollector

    dispatcher = _recovered(_live("sb-a", {}))
    registry = CollectorRegistry()
    registry.register(PlacementCollector(lambda: dispatcher.placement.nodes.values()))

    def scraped() -> str:
        return generate_latest(registry).decode()

    assert f'{NODE_PLACEABLE}{{node="n0"}} 0.0' in scraped()
    assert 'dsec_scheduler_node_sandboxes{node="n0"} 1.0' in scraped()
    dispatcher.placement.nodes["n0"].confirmed = True
    assert f'{NODE_PLACEABLE}{{node="n0"}} 1.0' in scraped()
