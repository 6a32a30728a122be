"""The trajectory log: completed steps are answered, not run again; a lost sandbox is
rebuilt by replaying its trajectory into a fresh one."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from app.config import Settings
from app.sdk import Client
from tests.conftest import scalar, wait_for

pytestmark = pytest.mark.integration


def test_restarted_trainer_fast_forwards_without_rerunning(stack: Settings, db: Any) -> None:
    trajectory = f"traj-{uuid.uuid4().hex[:8]}"
    # Given a trainer that ran two steps, the first one not idempotent
    with Client(stack, tenant="tests", job_id="traj") as first:
        sandbox = first.create()
        made = sandbox.exec("mkdir x", trajectory_id=trajectory, step=0)
        sandbox.exec("echo one > x/f", trajectory_id=trajectory, step=1)
    assert made.exit_code == 0 and not made.replayed
    # When it restarts (preempted) and replays its trajectory from the start
    with Client(stack, tenant="tests", job_id="traj") as again:
        box = again.sandbox(sandbox.id)
        replay = box.exec("mkdir x", trajectory_id=trajectory, step=0)
        replay_1 = box.exec("echo one > x/f", trajectory_id=trajectory, step=1)
        fresh = box.exec("cat x/f; ls", trajectory_id=trajectory, step=2)
        # Then the completed steps come back from the log, marked replayed, and
        # `mkdir x` did not run twice (it would have failed: the directory exists)
        assert replay.replayed and replay.exit_code == 0
        assert replay_1.replayed
        assert not fresh.replayed and fresh.stdout == b"one\nx\n"
        box.close()
    with db() as conn:
        ran = wait_for(
            lambda: (
                scalar(
                    conn,
                    "SELECT count(*) FROM events"
                    " WHERE sandbox_id = :s AND type = 'CommandCompleted'",
                    s=sandbox.id,
                )
                == 3
                and scalar(
                    conn,
                    "SELECT count(*) FROM events"
                    " WHERE sandbox_id = :s AND type = 'CommandReplayed'",
                    s=sandbox.id,
                )
            ),
            what="three commands run and the replays recorded",
        )
    assert ran == 2


def test_lost_sandbox_is_rebuilt_from_its_trajectory(client: Any, db: Any) -> None:
    trajectory = f"traj-{uuid.uuid4().hex[:8]}"
    # Given a trajectory that built some state, then lost its sandbox
    with client.create() as lost:
        lost.exec(
            "mkdir -p src && echo 'print(42)' > src/main.py", trajectory_id=trajectory, step=0
        )
        lost.exec("echo built > src/.done", trajectory_id=trajectory, step=1)
    with db() as conn:
        wait_for(
            lambda: (
                scalar(conn, "SELECT count(*) FROM commands WHERE trajectory_id = :t", t=trajectory)
                == 2
            ),
            what="the trajectory in the commands projection",
        )
    # When a fresh sandbox is created from the trajectory
    with client.create(restore_trajectory=trajectory) as rebuilt:
        # Then its state is the one the trajectory left
        assert rebuilt.exec("cat src/main.py src/.done").stdout == b"print(42)\nbuilt\n"
        assert rebuilt.id != lost.id


def test_a_large_step_is_whole_live_and_cut_in_its_replay(client: Any, stack: Settings) -> None:
    trajectory = f"traj-{uuid.uuid4().hex[:8]}"
    cap = stack.step_output_bytes
    with client.create() as box:
        # Given a step whose output is larger than what the log keeps for replays
        live = box.exec(
            f"head -c {cap + 5000} /dev/zero", trajectory_id=trajectory, step=0,
            max_output_bytes=4 << 20,
        )  # fmt: skip
        # Then the trainer gets it whole
        assert len(live.stdout) == cap + 5000 and not live.truncated
        # And a replay gets what the log kept, saying it was cut
        replay = box.exec(f"head -c {cap + 5000} /dev/zero", trajectory_id=trajectory, step=0)
    assert replay.replayed and replay.truncated
    assert replay.stdout == b"\0" * cap
