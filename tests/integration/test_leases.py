"""Trainer leases: a silent trainer's sandboxes are frozen, come back when it
reattaches, and are destroyed (lease_lapsed) when the grace period runs out."""

from __future__ import annotations

import glob
import time
from pathlib import Path
from typing import Any

import pytest

from app.config import Settings
from app.sdk import Client
from tests.conftest import scalar, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def process_states(sandbox_id: str) -> list[str]:
    """States (R, S, T…) of the sandbox's processes, read on the host from its cgroup."""
    states = []
    for procs in glob.glob(f"/sys/fs/cgroup/pids/dsec/*/{sandbox_id}/cgroup.procs"):
        for pid in Path(procs).read_text().split():
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            states.append(stat.rsplit(")", 1)[1].split()[0])
    return states


def event_count(db: Any, sandbox_id: str, kind: str) -> int:
    with db() as conn:
        return int(
            scalar(
                conn,
                "SELECT count(*) FROM events WHERE sandbox_id = :s AND type = :t",
                s=sandbox_id,
                t=kind,
            )
        )


def test_lapsed_lease_freezes_thaws_and_finally_destroys(stack: Settings, db: Any) -> None:
    # Given a trainer holding a short lease, with a busy process in its sandbox
    trainer = Client(
        stack, tenant="tests", job_id="lease", lease=True, lease_ttl_s=2, lease_grace_s=6
    )
    lease_id = trainer.lease_id
    assert lease_id is not None
    box = trainer.create()
    box.exec("sh -c 'while true; do :; done' >/dev/null 2>&1 &")
    # When the trainer vanishes (stops renewing, leaves its sandbox behind)
    trainer.close()
    # Then the sandbox is frozen: its processes are stopped (T), the agent (S) is not
    wait_for(lambda: event_count(db, box.id, "SandboxFrozen"), timeout_s=30, what="frozen")
    states = process_states(box.id)
    assert "T" in states, states
    # When a trainer reattaches to the same lease
    again = Client(
        stack, tenant="tests", job_id="lease", lease=lease_id, lease_ttl_s=2, lease_grace_s=6
    )
    wait_for(lambda: event_count(db, box.id, "SandboxThawed"), timeout_s=30, what="thawed")
    # Then the sandbox runs again and answers
    assert "T" not in process_states(box.id)
    assert again.sandbox(box.id).exec("echo back").stdout == b"back\n"
    # When that trainer vanishes too and nobody comes back within the grace period
    again.close()
    time.sleep(2)
    # Then the sandbox is destroyed with the reason lease_lapsed
    with db() as conn:
        reason = wait_for(
            lambda: scalar(
                conn,
                "SELECT end_reason FROM sandboxes WHERE sandbox_id = :s AND state = 'stopped'",
                s=box.id,
            ),
            timeout_s=40,
            what="destroyed after the grace period",
        )
    assert reason == "lease_lapsed"
    # And the log says it was frozen when it went
    with db() as conn:
        last = scalar(
            conn,
            "SELECT payload->'last_state' FROM events WHERE sandbox_id = :s"
            " AND type = 'SandboxStopped'",
            s=box.id,
        )
    assert last["frozen"] is True and last["commands"] >= 1
