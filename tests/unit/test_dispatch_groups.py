"""Rollout groups are admitted all or nothing; tenants' quotas hold."""

from __future__ import annotations

import json
from itertools import count

from pydantic import BaseModel

from app.config import Settings
from app.control.dispatch import Dispatcher
from app.control.outbox import Outbox
from app.domain.events import NodeHeartbeat, NodePayload
from app.domain.records import Inbound
from app.domain.requests import CreateGroup, CreateSandbox, DestroyGroup
from tests.unit.signing import KEYS, PARTITIONS, record, reply_to, task_request

_offsets = count()


def _record(message: BaseModel, key_id: str | None = None) -> Inbound:
    """A proven record at a fresh offset (an id read twice elsewhere is a replay)."""
    return record(message, next(_offsets), key_id=key_id)


def _dispatcher(settings: Settings | None = None, cpus: float = 4) -> Dispatcher:
    dispatcher = Dispatcher(settings or Settings(), KEYS, PARTITIONS)
    for node in ("n0", "n1"):
        beat = NodeHeartbeat(
            node_id=node,
            payload=NodePayload(
                capacity_sandboxes=100, capacity_cpus=cpus, capacity_memory_mb=65536,
                queue=f"node.{node}",
            ),
        )  # fmt: skip
        dispatcher.observe(Outbox(), _record(beat))
    return dispatcher


def _group(n: int, cpus: float, queue_s: float = 0) -> CreateGroup:
    return CreateGroup(
        sandbox_id="grp-1", tenant="t", members=[f"sb-m{i}" for i in range(n)], cpus=cpus,
        queue_s=queue_s, reply_to=reply_to(),
    )  # fmt: skip


def test_group_that_fits_is_placed_whole() -> None:
    dispatcher = _dispatcher()
    out = Outbox()
    dispatcher.handle(out, _record(_group(6, cpus=1)))
    assert len(out.tasks) == 6
    assert dispatcher.groups[("t", "grp-1")] == [f"sb-m{i}" for i in range(6)]
    labels = {task_request(body)["labels"]["dsec.group"] for _, _, body in out.tasks}
    assert labels == {"grp-1"}


def test_group_that_does_not_fit_starts_nothing_and_says_why() -> None:
    # Given two nodes of 4 CPUs and a group of 3 sandboxes of 3 CPUs (only 2 fit)
    dispatcher = _dispatcher()
    out = Outbox()
    dispatcher.handle(out, _record(_group(3, cpus=3)))
    # Then no task is sent, no room stays reserved, every member is rejected
    assert out.tasks == []
    assert dispatcher.placement.allocations == {}
    replies = [json.loads(body) for _, _, body, _ in out.replies]
    assert len(replies) == 3 and {r["reason"] for r in replies} == {"capacity"}
    assert "all or nothing" in replies[0]["detail"]
    types = {json.loads(body)["type"] for _, body in out.events}
    assert types == {"SandboxRejected"}


def test_group_waits_for_room_within_its_queue_time() -> None:
    dispatcher = _dispatcher()
    blocker = CreateSandbox(sandbox_id="sb-big", tenant="t", cpus=4)
    dispatcher.handle(Outbox(), _record(blocker))
    out = Outbox()
    dispatcher.handle(out, _record(_group(2, cpus=3, queue_s=60)))
    assert out.tasks == [] and out.replies == [] and len(dispatcher.pending) == 1
    dispatcher.placement.release("sb-big")
    out = Outbox()
    dispatcher.retry_pending(out)
    assert len(out.tasks) == 2 and dispatcher.pending == []


def test_destroy_group_reaches_every_member() -> None:
    dispatcher = _dispatcher()
    dispatcher.handle(Outbox(), _record(_group(3, cpus=1)))
    out = Outbox()
    dispatcher.handle(out, _record(DestroyGroup(sandbox_id="grp-1", tenant="t")))
    assert sorted(task_request(args)["sandbox_id"] for _, _, args in out.tasks) == [
        "sb-m0", "sb-m1", "sb-m2",
    ]  # fmt: skip


def test_tenant_quota_refuses_beyond_it() -> None:
    dispatcher = _dispatcher(Settings(tenant_quotas={"t": 2}))
    for i in range(2):
        dispatcher.handle(Outbox(), _record(CreateSandbox(sandbox_id=f"sb-q{i}", tenant="t")))
    out = Outbox()
    request = CreateSandbox(sandbox_id="sb-q2", tenant="t", queue_s=0, reply_to=reply_to())
    dispatcher.handle(out, _record(request))
    assert json.loads(out.replies[0][2])["reason"] == "quota"
    # another tenant is not affected
    out = Outbox()
    dispatcher.handle(out, _record(CreateSandbox(sandbox_id="sb-o"), key_id="k-tenant-u"))
    assert len(out.tasks) == 1
