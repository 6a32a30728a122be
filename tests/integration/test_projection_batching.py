"""However the projector's batches fall, the projections come out the same.

A sandbox's first ending is its ending: a second Stopped (the node's own, after the
scheduler declared it lost), a late Started or a command that raced the destroy stay
in the log, but neither the row nor the charge moves. Applied here straight to the
projections, in a transaction that is rolled back.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Connection, text

from app.db import projections
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

pytestmark = pytest.mark.integration

T0 = datetime(2025, 6, 1, 12, 0, tzinfo=UTC)


def history(tenant: str, sandbox_id: str) -> list[Event]:
    common: dict[str, Any] = {"sandbox_id": sandbox_id, "tenant": tenant, "job_id": "j"}
    rid = uuid.uuid4()
    return [
        SandboxRequested(
            occurred_at=T0,
            payload=RequestedPayload(
                request_id=rid,
                actor="a",
                image="img",
                cpus=2,
                memory_mb=1024,
                disk_mb=64,
                ttl_s=600,
                network=False,
            ),
            **common,
        ),
        SandboxStarted(
            occurred_at=T0 + timedelta(seconds=1),
            node_id="n1",
            payload=StartedPayload(request_id=rid, container_id="c"),
            **common,
        ),
        SandboxStopped(
            occurred_at=T0 + timedelta(seconds=61),
            node_id="n1",
            payload=StoppedPayload(reason=StopReason.NODE_LOST),
            **common,
        ),
        # What came after the ending:
        SandboxStopped(
            occurred_at=T0 + timedelta(seconds=300),
            node_id="n1",
            payload=StoppedPayload(reason=StopReason.DESTROYED),
            **common,
        ),
        SandboxStarted(
            occurred_at=T0 + timedelta(seconds=301),
            node_id="n2",
            payload=StartedPayload(request_id=rid, container_id="c2"),
            **common,
        ),
        CommandCompleted(
            occurred_at=T0 + timedelta(seconds=302),
            node_id="n2",
            payload=CommandPayload(
                request_id=uuid.uuid4(),
                actor="a",
                command="true",
                exit_code=0,
                duration_ms=1.0,
                stdout_bytes=0,
                stderr_bytes=0,
            ),
            **common,
        ),
    ]


def state(conn: Connection, tenant: str) -> tuple[Any, ...]:
    box = conn.execute(
        text(
            "SELECT state, node_id, started_at, ended_at, end_reason, commands, last_position"
            " FROM sandboxes WHERE tenant = :t"
        ),
        {"t": tenant},
    ).one()
    usage = conn.execute(
        text(
            "SELECT sandboxes_started, sandboxes_ended, commands, ended_sandbox_seconds,"
            " ended_core_seconds FROM usage WHERE tenant = :t"
        ),
        {"t": tenant},
    ).one()
    return (*box, *usage)


def applied(conn: Connection, events: Sequence[Event], cuts: Sequence[int]) -> tuple[Any, ...]:
    tenant = events[0].tenant
    items = [(e, 1_000_000 + i) for i, e in enumerate(events)]
    for lo, hi in zip((0, *cuts), (*cuts, len(items)), strict=True):
        projections.apply_batch(conn, items[lo:hi])
    return state(conn, tenant)


@pytest.mark.parametrize("cuts", [(), (3,), (1, 3, 5), (1, 2, 3, 4, 5), (4,)])
def test_the_first_ending_wins_whatever_the_batches(conn: Connection, cuts: tuple[int]) -> None:
    tenant = f"batch-{uuid.uuid4().hex[:8]}"
    got = applied(conn, history(tenant, f"sb-{tenant}"), cuts)
    state_, node, started, ended, reason, commands, position = got[:7]
    assert (state_, node, reason) == ("stopped", "n1", "node_lost")
    assert (started, ended) == (T0 + timedelta(seconds=1), T0 + timedelta(seconds=61))
    assert commands == 1
    assert position == 1_000_002  # the first Stopped's
    # usage: started twice in the log, ended once, charged 60 s at 2 cores
    assert got[7:] == (2, 1, 1, 60, 120)


@pytest.mark.parametrize("cuts", [(), (1,)])
def test_a_life_whose_start_the_log_lost_folds_the_same_whatever_the_batches(
    conn: Connection, cuts: tuple[int]
) -> None:
    # Given a command and an ending of a sandbox whose start is not in the log (an
    # embedded broker that died took it), one batch or two
    tenant = f"batch-{uuid.uuid4().hex[:8]}"
    events = history(tenant, f"sb-{tenant}")
    got = applied(conn, [events[-1], events[2]], cuts)
    # Then the row is the ending's, and the command, with no life before it, is in
    # the tenant's usage but not on the row: a rebuild (one batch) says the same
    assert got[:7] == ("stopped", None, None, T0 + timedelta(seconds=61), "node_lost", 0, 1_000_001)
    assert got[7:] == (0, 1, 1, 0, 0)  # usage: no start, one end (of no length), a command
