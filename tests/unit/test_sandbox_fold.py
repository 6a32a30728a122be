"""The sandboxes projection folded from a batch (pure): a refused create of a live id
moves nothing but its position, a refused id lives anew (projections v7)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

from app.db.fold import fold
from app.domain.base import RejectReason, StopReason
from app.domain.events import (
    Event,
    RejectedPayload,
    RequestedPayload,
    SandboxRejected,
    SandboxRequested,
    SandboxStarted,
    SandboxStopped,
    StartedPayload,
    StoppedPayload,
)
from app.domain.sandbox_state import SandboxState

T0 = datetime(2026, 12, 1, 12, tzinfo=UTC)
RID = uuid.uuid4()


def _requested(at: datetime) -> SandboxRequested:
    return SandboxRequested(
        sandbox_id="sb-1", tenant="t", occurred_at=at,
        payload=RequestedPayload(request_id=RID, actor="t/k", image="img", cpus=1,
                                 memory_mb=64, disk_mb=64, ttl_s=60, network=False),
    )  # fmt: skip


def _refused(at: datetime) -> SandboxRejected:
    return SandboxRejected(
        sandbox_id="sb-1", tenant="u", occurred_at=at,
        payload=RejectedPayload(request_id=uuid.uuid4(), request_type="CreateSandbox",
                                reason=RejectReason.DUPLICATE, detail="sandbox id in use"),
    )  # fmt: skip


def _started(at: datetime) -> SandboxStarted:
    return SandboxStarted(
        sandbox_id="sb-1", node_id="n0", tenant="t", occurred_at=at,
        payload=StartedPayload(request_id=RID, container_id="c"),
    )  # fmt: skip


def _folded(*events: Event) -> tuple[SandboxState | None, dict[str, object], int]:
    box = fold([(e, n + 1) for n, e in enumerate(events)]).sandboxes["sb-1"]
    return box.state, box.columns, box.last_position


def test_a_duplicate_create_refused_leaves_a_running_sandbox_running() -> None:
    state, columns, position = _folded(
        _requested(T0), _started(T0 + timedelta(seconds=1)), _refused(T0 + timedelta(seconds=2))
    )
    assert state == SandboxState.RUNNING
    assert "ended_at" not in columns and "end_reason" not in columns
    assert position == 3


def test_a_refused_id_lives_anew_with_its_own_columns() -> None:
    state, columns, _ = _folded(_refused(T0), _requested(T0 + timedelta(seconds=5)))
    assert state == SandboxState.REQUESTED
    assert columns["requested_at"] == T0 + timedelta(seconds=5)
    assert "ended_at" not in columns and "end_reason" not in columns


def test_an_end_is_still_the_last_word() -> None:
    stopped = SandboxStopped(
        sandbox_id="sb-1", tenant="t", occurred_at=T0 + timedelta(seconds=3),
        payload=StoppedPayload(reason=StopReason.DESTROYED),
    )  # fmt: skip
    state, columns, position = _folded(
        _requested(T0), stopped, _refused(T0 + timedelta(seconds=4)), _started(T0)
    )
    assert (state, columns["end_reason"], position) == (SandboxState.STOPPED, "destroyed", 2)
