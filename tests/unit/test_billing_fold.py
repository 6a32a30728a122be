"""The billing fold (pure): first values win, commands count on their UTC day."""

from __future__ import annotations

import uuid
from datetime import UTC, date, datetime, timedelta, timezone
from decimal import Decimal

from app.db.billing import fold
from app.domain.base import StopReason
from app.domain.events import (
    CommandCompleted,
    CommandPayload,
    Event,
    RequestedPayload,
    SandboxRequested,
    SandboxStarted,
    SandboxStopped,
    StartedPayload,
    StoppedPayload,
)

T0 = datetime(2026, 3, 1, 23, 30, tzinfo=UTC)


def env(when: datetime, tenant: str = "acme", node: str | None = None) -> dict[str, object]:
    return {"sandbox_id": "sb-1", "tenant": tenant, "job_id": "j", "occurred_at": when,
            "node_id": node}  # fmt: skip


def requested(when: datetime, cpus: float) -> Event:
    payload = RequestedPayload(
        request_id=uuid.uuid4(), actor="acme/k", image="img", cpus=cpus, memory_mb=512,
        disk_mb=1, ttl_s=60, network=False,
    )  # fmt: skip
    return SandboxRequested(**env(when), payload=payload)


def started(when: datetime, tenant: str, node: str) -> Event:
    payload = StartedPayload(request_id=uuid.uuid4(), container_id="c" * 64)
    return SandboxStarted(**env(when, tenant, node), payload=payload)


def stopped(when: datetime, reason: StopReason) -> Event:
    return SandboxStopped(**env(when), payload=StoppedPayload(reason=reason, detail=reason))


def command(when: datetime) -> Event:
    payload = CommandPayload(
        request_id=uuid.uuid4(), actor="acme/k", command="true", exit_code=0,
        duration_ms=1.0, stdout_bytes=0, stderr_bytes=0,
    )  # fmt: skip
    return CommandCompleted(**env(when, node="n"), payload=payload)


def test_the_first_request_start_and_stop_make_the_life() -> None:
    events = [
        requested(T0, 0.1),
        started(T0 + timedelta(seconds=1), "acme", "node-a"),
        requested(T0 + timedelta(seconds=2), 8),  # a replayed request: ignored
        started(T0 + timedelta(seconds=3), "other", "node-b"),
        stopped(T0 + timedelta(hours=1), StopReason.OOM),
        stopped(T0 + timedelta(hours=2), StopReason.NODE_LOST),
    ]
    life = fold([(e, n) for n, e in enumerate(events, 1)]).lives["sb-1"]
    assert (life.cpus, life.memory_mb, life.tenant, life.node_id) == (
        Decimal("0.1"),
        512,
        "acme",
        "node-a",
    )
    assert (life.started_at, life.ended_at) == (T0 + timedelta(seconds=1), T0 + timedelta(hours=1))
    assert (life.end_reason, life.last_position) == ("oom", 6)  # the last lifecycle event


def test_the_tenant_of_a_life_is_its_start_s() -> None:
    # The raw view takes tenant and job from the SandboxStarted event.
    events = [stopped(T0, StopReason.NODE_LOST), started(T0, "late-tenant", "n")]
    assert fold([(e, n) for n, e in enumerate(events, 1)]).lives["sb-1"].tenant == "late-tenant"


def test_commands_count_on_their_utc_day_whatever_their_zone() -> None:
    tokyo = timezone(timedelta(hours=9))
    events = [
        command(T0),
        command(datetime(2026, 3, 2, 8, 0, tzinfo=tokyo)),  # 2026-03-01 23:00 UTC
        command(T0 + timedelta(hours=1)),  # after midnight UTC
    ]
    counted = fold([(e, n) for n, e in enumerate(events, 1)]).commands
    assert counted == {("acme", "j", date(2026, 3, 1)): 2, ("acme", "j", date(2026, 3, 2)): 1}
