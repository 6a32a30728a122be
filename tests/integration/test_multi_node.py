"""Several nodes on one machine: sandboxes spread, and a dead node is noticed."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from app.config import Settings
from app.errors import SandboxRejectedError
from app.stack import services as stack_mod
from app.stack.process import Service
from tests.conftest import declare_lost, scalar, wait_for, wait_for_node

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NODES = 3


@pytest.fixture(scope="module")
def three_nodes(stack: Settings) -> Iterator[Settings]:
    """The stack with two more node workers (each its own user and Podman service).

    Afterwards the extra workers are stopped and declared lost at once, so the next
    tests (and the next `make test`) place sandboxes on the configured node only.
    """
    try:
        stack_mod.up(stack, nodes=NODES, log=lambda _m: None)
        yield stack
    finally:
        _retire_extra_nodes(stack)


def _retire_extra_nodes(stack: Settings) -> None:
    # Also after a failed `up`: a live extra node would take later tests' sandboxes.
    extra = stack_mod.node_ids(stack, NODES)[1:]
    for node in extra:
        _worker(stack, node).stop(stack)
    declare_lost(stack, extra)


def _worker(settings: Settings, node: str) -> Service:
    return next(s for s in stack_mod.services(settings, NODES) if s.name == f"worker-{node}")


def test_sandboxes_spread_and_a_killed_node_is_declared_lost(
    three_nodes: Settings, client: Any, db: Any
) -> None:
    settings = three_nodes
    # Given sandboxes created on a three-node stack
    boxes = client.create_many(6)
    on = {box.node_id for box in boxes}
    assert len(on) >= 2, f"all sandboxes landed on {on}"
    victim = "node2" if any(b.node_id == "node2" for b in boxes) else sorted(on)[-1]
    doomed = [b for b in boxes if b.node_id == victim]
    survivors = [b for b in boxes if b.node_id != victim]
    # When that node's host dies without a word (its worker killed, and nothing on
    # the host left to start it again: no pid file for the stack's supervisor)
    worker = _worker(settings, victim)
    pid = worker.pid(settings)
    assert pid is not None
    worker.pidfile(settings).unlink()
    os.killpg(pid, signal.SIGKILL)
    try:
        # Then the scheduler declares it lost and its sandboxes end with node_lost
        wait_for_node(db, victim, "lost", timeout_s=60)
        with db() as conn:
            for box in doomed:
                reason = wait_for(
                    lambda b=box: scalar(
                        conn,
                        "SELECT end_reason FROM sandboxes WHERE sandbox_id = :s"
                        " AND state = 'stopped'",
                        s=b.id,
                    ),
                    what=f"{box.id} stopped",
                )
                assert reason == "node_lost"
                last = scalar(
                    conn,
                    "SELECT payload->'last_state' FROM events WHERE sandbox_id = :s"
                    " AND type = 'SandboxStopped'",
                    s=box.id,
                )
                # The scheduler saw no cgroup; it says when the node was last heard from
                assert last["observed_by"] == "scheduler" and last["last_heartbeat_at"]
        # And a trainer using such a sandbox is told why
        for box in doomed:
            with pytest.raises(SandboxRejectedError) as info:
                box.exec("true")
            assert "node_lost" in info.value.detail
        # And sandboxes on the other nodes carry on
        for box in survivors:
            assert box.exec("echo alive").stdout == b"alive\n"
    finally:
        for box in survivors:
            box.close()
        # The node comes back; its reconciler removes the sandboxes the log ended.
        worker.start(settings)
        time.sleep(0.5)
    wait_for_node(db, victim, "alive", timeout_s=60)
