"""Rollout groups through the platform: all or nothing, destroyed as one."""

from __future__ import annotations

from typing import Any

import pytest

from app.errors import SandboxRejectedError
from tests.conftest import scalar, wait_for

pytestmark = pytest.mark.integration


def test_group_is_created_and_destroyed_as_one(client: Any, db: Any) -> None:
    with client.create_group(3, labels={"step": "17"}) as group:
        assert len(group) == 3
        outputs = [box.exec("echo $((6*7))").stdout for box in group]
        assert outputs == [b"42\n"] * 3
        ids = [box.id for box in group]
    with db() as conn:
        for sandbox_id in ids:
            reason = wait_for(
                lambda s=sandbox_id: scalar(
                    conn,
                    "SELECT end_reason FROM sandboxes WHERE sandbox_id = :s AND state = 'stopped'",
                    s=s,
                ),
                what=f"{sandbox_id} stopped",
            )
            assert reason == "destroyed"
        # Cost per group and step is a query over the projection's labels
        assert (
            scalar(
                conn,
                "SELECT count(*) FROM sandboxes WHERE labels->>'dsec.group' = :g"
                " AND labels->>'step' = '17'",
                g=group.id,
            )
            == 3
        )


def test_group_without_room_starts_nothing(client: Any, db: Any) -> None:
    # Given a group whose members together need more CPU than the nodes declare (each
    # member alone fits a node)
    with pytest.raises(SandboxRejectedError) as info:
        client.create_group(40, cpus=2, memory_mb=16, queue_s=0)
    # Then the trainer is told why, and no member was ever requested
    assert info.value.reason in {"capacity", "no_nodes"}
    with db() as conn:
        started = scalar(
            conn,
            "SELECT count(*) FROM events WHERE sandbox_id = :s AND type = 'SandboxRequested'",
            s=info.value.sandbox_id,
        )
    assert started == 0
