"""A node host that reboots with sandboxes on it: its processes and containers die at
once, its worker comes back (the supervisor here, systemd on a real host), and the
platform settles by itself: the sandboxes it lost end with a reason, billed until
the node last listed them, and the node serves again.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import text

from app.config import Settings
from app.stack import services as stack_mod
from tests.conftest import wait_for

pytestmark = pytest.mark.integration


def _first_stop(db: Callable[[], Any], sandbox_id: str) -> Any:
    with db() as conn:
        return conn.execute(
            text(
                "SELECT occurred_at, payload FROM events WHERE sandbox_id = :s"
                " AND type = 'SandboxStopped' ORDER BY position LIMIT 1"
            ),
            {"s": sandbox_id},
        ).first()


def test_a_rebooted_node_ends_what_it_lost_and_bills_until_it_last_saw_it(
    stack: Settings, client: Any, db: Callable[[], Any]
) -> None:
    # Given two running sandboxes on the node, listed by its heartbeats
    boxes = [client.create(timeout_s=120) for _ in range(2)]
    for box in boxes:
        assert box.exec("true").exit_code == 0
    worker = next(
        s
        for s in stack_mod.services(stack, stack_mod.known_node_ids(stack))
        if s.name == f"worker-{stack.node_id}"
    )
    pid = worker.pid(stack)
    assert pid is not None

    # When the host goes down: the worker and the containers die at once
    down_at = datetime.now(UTC)
    os.killpg(pid, signal.SIGKILL)
    socket = stack.state_dir / "nodes" / stack.node_id / "run" / "podman" / "podman.sock"
    for box in boxes:  # (rm -f of a name that is not there succeeds: check it went)
        subprocess.run(
            ["podman", "--url", f"unix://{socket}", "rm", "-t", "0", "-f", f"dsec-{box.id}"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
    listed = subprocess.run(
        ["podman", "--url", f"unix://{socket}", "ps", "-a", "--format", "{{.Names}}"],
        check=True, capture_output=True, text=True, timeout=60,
    ).stdout  # fmt: skip
    assert not [box for box in boxes if f"dsec-{box.id}" in listed.split()]

    # Then the worker comes back by itself, and each lost sandbox ends `failed`
    wait_for(lambda: worker.pid(stack) not in (None, pid), 30, "the worker started again")
    for box in boxes:
        stop = wait_for(lambda b=box: _first_stop(db, b.id), 90, f"{box.id} ended")
        assert stop.payload["reason"] == "failed"
        assert "vanished" in stop.payload["detail"]
        # stamped when the node last listed it (before the host went down), not when
        # the scheduler was sure: the tenant pays nothing for the reboot
        assert stop.occurred_at <= down_at
        with db() as conn:
            ended = conn.execute(
                text("SELECT ended_at FROM sandbox_lives WHERE sandbox_id = :s"), {"s": box.id}
            ).scalar()
        assert ended == stop.occurred_at

    # And the node serves again
    with client.create(timeout_s=120) as fresh:
        assert fresh.exec("echo up").stdout == b"up\n"
