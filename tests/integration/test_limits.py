"""Resource limits hold (on this cgroup v1 host as on v2 ones), attacked from inside.

The node's own cgroups carry the limits (workers/containers/limits.py); these tests read them
from the host where a figure is needed (CPU time, task counts, OOM kills).
"""

from __future__ import annotations

import re
import time
from typing import Any

import pytest

from app.config import Settings
from app.errors import SandboxError, SandboxRejectedError
from tests.conftest import scalar, wait_for
from workers.containers.limits import CgroupLimiter, Limits

pytestmark = pytest.mark.integration

MiB = 1 << 20


def _stops(db: Any, sandbox_id: str) -> list[tuple[str, str]] | None:
    with db() as conn:
        rows = conn.exec_driver_sql(
            "SELECT payload->>'reason', payload->>'detail' FROM events"
            " WHERE sandbox_id = %(s)s AND type = 'SandboxStopped' ORDER BY position",
            {"s": sandbox_id},
        ).all()
    return [tuple(r) for r in rows] or None


def _last_state(db: Any, sandbox_id: str) -> dict[str, Any]:
    with db() as conn:
        last: dict[str, Any] = scalar(
            conn,
            "SELECT payload->'last_state' FROM events WHERE sandbox_id = :s"
            " AND type = 'SandboxStopped' ORDER BY position LIMIT 1",
            s=sandbox_id,
        )
    return last


def test_commands_run_inside_the_sandbox_cgroups(
    client: Any, stack: Settings, limiter: CgroupLimiter
) -> None:
    with client.create(memory_mb=96, pids_limit=40, cpus=0.25) as box:
        own = box.exec("cat /proc/self/cgroup").text
        # Then every limited controller of the command is the sandbox's cgroup
        suffix = f"/{stack.node_id}/{box.id}"
        v2 = limiter.layout.version == 2
        for ctrl in ("",) if v2 else ("memory", "pids", "cpu"):
            line = re.search(rf"^\d+:[^:]*\b{ctrl}\b[^:]*:(.*)$", own, re.M)
            assert line and line.group(1).endswith(suffix), own
        # And the command sees its own limits where tools look for them
        files = (
            ("memory.max", "pids.max", "cpu.max")
            if v2
            else ("memory/memory.limit_in_bytes", "pids/pids.max", "cpu/cpu.cfs_quota_us")
        )
        seen = box.exec("cd /sys/fs/cgroup && cat " + " ".join(files)).text.split()
        assert seen[:3] == [str(96 * MiB), "40", "25000"], seen


def test_memory_hog_is_oom_killed_and_the_sandbox_stops_with_oom(
    client: Any, db: Any, limiter: CgroupLimiter
) -> None:
    box = client.create(memory_mb=64)
    # Given a sandbox where a modest allocation works
    assert box.exec("dd if=/dev/zero of=/dev/null bs=16M count=1").exit_code == 0
    assert limiter.oom_kills(box.id) == 0
    # When a command touches four times its memory
    hog = box.exec("dd if=/dev/zero of=/dev/null bs=256M count=1")
    # Then the trainer gets the command's death by SIGKILL, as a normal reply
    assert hog.exit_code == -9 and not hog.timed_out
    # And the sandbox ends, once, with reason oom
    stops = wait_for(lambda: _stops(db, box.id), 15, "SandboxStopped of the OOM-killed sandbox")
    box.closed = True  # ended already (a destroy now is refused: sandbox_not_running)
    # And the next request hears that the sandbox no longer runs (from the scheduler,
    # or from the node if the scheduler has not seen the end yet), not of its agent
    with pytest.raises(SandboxError) as after:
        box.exec("true")
    assert after.value.reason == "sandbox_not_running", after.value
    time.sleep(0.5)
    assert [reason for reason, _ in _stops(db, box.id) or []] == ["oom"], stops
    assert "out of memory" in stops[0][1]
    # And the log keeps how it stood: the kill, the peak at the limit, the last command
    last = _last_state(db, box.id)
    assert last["observed_by"] == "node" and last["oom_kills"] >= 1
    assert last["memory_peak_mb"] >= 60
    assert last["last_command"].startswith("dd ") and last["last_exit_code"] == -9
    # And its cgroups went with it
    assert box.id not in limiter.sandbox_ids()


@pytest.mark.slow
def test_fork_bomb_is_contained_and_the_node_stays_healthy(
    client: Any, limiter: CgroupLimiter
) -> None:
    neighbour = client.create()
    with client.create(pids_limit=32, cpus=0.5) as bomb:
        # When a fork bomb goes off (its background forks outlive the command)
        bomb.exec("b() { b | b & }; b", timeout_s=3)
        # Then its tasks stay at the limit, the kernel refusing the forks beyond it
        tasks = int(limiter.read(bomb.id, "pids", "pids.current") or "0")
        assert 0 < tasks <= 32, tasks
        events = limiter.read(bomb.id, "pids", "pids.events")
        if events is not None:
            assert int(events.split()[1]) > 0, events
        # And the neighbour still forks
        assert neighbour.exec("echo ok | cat").text == "ok\n"
    # And once destroyed nothing is left of it, and the next sandbox works
    assert limiter.pids(bomb.id) == [] and bomb.id not in limiter.sandbox_ids()
    neighbour.close()
    with client.create() as fresh:
        assert fresh.exec("echo fine").text == "fine\n"


@pytest.mark.slow
def test_half_a_cpu_gets_half_a_core(client: Any, limiter: CgroupLimiter) -> None:
    with client.create(cpus=0.5) as box:
        # Given a busy loop running in the background of a 0.5-CPU sandbox
        box.exec("sh -c 'while :; do :; done' >/dev/null 2>&1 &")
        time.sleep(0.3)
        # When its CPU time is measured from the host over 2 s
        t0, u0 = time.monotonic(), limiter.cpu_usage_s(box.id)
        time.sleep(2.0)
        t1, u1 = time.monotonic(), limiter.cpu_usage_s(box.id)
        assert u0 is not None and u1 is not None
        share = (u1 - u0) / (t1 - t0)
        print(f"\nCPU share of a 0.5-cpu busy loop: {share:.3f} cores")
        # Then it got about half a core (the quota), not a whole one
        assert 0.35 <= share <= 0.6, share


def test_disk_fills_at_its_configured_size(
    client: Any, limiter: CgroupLimiter, stack: Settings
) -> None:
    with client.create(disk_mb=16, memory_mb=256) as box:
        # When the sandbox writes until it cannot, in /workspace and in /tmp
        result = box.exec(
            "yes > /workspace/fill; echo rc=$?; wc -c < /workspace/fill;"
            " yes > /tmp/fill; echo rc=$?; wc -c < /tmp/fill",
            timeout_s=30,
        )
        # Then both stop with ENOSPC at their sizes (16 MiB asked; /tmp is 64 MiB)
        assert result.stderr.decode().count("No space left on device") == 2, result.stderr
        lines = result.text.split()
        assert lines[0] == "rc=1" and lines[2] == "rc=1", lines
        workspace, tmp = int(lines[1]), int(lines[3])
        assert 15 * MiB < workspace <= 16 * MiB, workspace
        assert 63 * MiB < tmp <= 64 * MiB, tmp
        # And it is memory, not the node's disk: tmpfs, charged to the sandbox's cgroup
        mounts = box.exec("grep -E ' /(workspace|tmp) ' /proc/self/mountinfo").text
        assert mounts.count(" - tmpfs ") == 2, mounts
        usage = limiter.read(box.id, "memory", "memory.usage_in_bytes")
        if usage is not None:  # v1
            assert int(usage) >= workspace + tmp


@pytest.mark.slow
def test_oom_in_a_background_process_ends_the_sandbox_too(
    client: Any, db: Any, limiter: CgroupLimiter
) -> None:
    box = client.create(memory_mb=64)
    # Given a hog the command leaves behind, so no exec sees it die
    box.exec("dd if=/dev/zero of=/dev/null bs=256M count=1 >/dev/null 2>&1 &")
    wait_for(lambda: limiter.oom_kills(box.id) > 0, 10, "the OOM kill of the background hog")
    # Then the reconciler's next round ends the sandbox with reason oom
    stops = wait_for(lambda: _stops(db, box.id), 15, "SandboxStopped from the reconciler")
    assert [reason for reason, _ in stops] == ["oom"]
    box.closed = True  # gone already


@pytest.mark.slow
def test_reconciler_removes_leftover_cgroups(limiter: CgroupLimiter) -> None:
    # Given cgroups whose sandbox has no container (a worker died between the two)
    stray = f"sb-stray{time.monotonic_ns() % 10**9}"
    limiter.create(stray, Limits.of(memory_mb=32, pids=8, cpus=0.1))
    assert stray in limiter.sandbox_ids()
    # Then the next reconciler round removes them
    wait_for(lambda: stray not in limiter.sandbox_ids(), 15, "the sweep of leftover cgroups")


def test_a_destroyed_sandbox_leaves_its_last_state_in_the_log(client: Any, db: Any) -> None:
    with client.create(memory_mb=128) as box:
        box.exec("dd if=/dev/zero of=/dev/null bs=8M count=4")
        box.exec(["sh", "-c", "exit 3"])
    last = wait_for(lambda: _last_state(db, box.id), 15, "the Stopped of the destroyed sandbox")
    assert last["observed_by"] == "node"
    assert (last["commands"], last["last_command"], last["last_exit_code"]) == (
        2,
        "sh -c 'exit 3'",
        3,
    )
    assert last["cpu_s"] > 0 and last["memory_peak_mb"] >= 8
    assert last["processes"] >= 1 and last["oom_kills"] == 0 and last["frozen"] is False


@pytest.mark.parametrize(
    "shape",
    [{"pids_limit": 65_536}, {"cpus": 64}, {"memory_mb": 262_144}],
    ids=["pids-beyond-pid_max", "cpus-beyond-cores", "memory-beyond-host"],
)
def test_a_limit_no_host_can_keep_is_refused_at_once(client: Any, shape: dict[str, Any]) -> None:
    # Given a create asking one sandbox for more than any node's host has, and
    # willing to wait for room: waiting would not help
    with pytest.raises(SandboxRejectedError) as refused:
        client.create(queue_s=60, timeout_s=20, **shape)
    # Then it is refused at once, saying what the nodes allow
    assert refused.value.reason == "invalid"
    assert "the most any node allows one sandbox" in str(refused.value)
