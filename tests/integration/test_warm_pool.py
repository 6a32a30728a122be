"""Warm pools: a create is a claim of a pre-started container, which then behaves as
a sandbox of its own in every respect (limits, env, TTL, destroy, restart); and the
node and the scheduler agree on what runs (vanished containers, orphans)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from app.config import Settings
from app.stack import services as stack_mod
from tests.conftest import wait_for
from workers.containers import label
from workers.containers.limits import CgroupLimiter
from workers.containers.podman_driver import PodmanDriver
from workers.containers.spec import SandboxSpec
from workers.host.user import find_node_user

pytestmark = pytest.mark.integration

MiB = 1 << 20


@pytest.fixture(scope="module")
def driver(stack: Settings) -> Iterator[PodmanDriver]:
    """The node's own Podman service, as the node drives it (with its cgroups)."""
    user = find_node_user(stack.node_id)
    if user is None:
        pytest.fail(f"node {stack.node_id} is not set up", pytrace=False)
    d = PodmanDriver(user.socket_url, limiter=CgroupLimiter.detect(stack.node_id))
    yield d
    d.close()


@pytest.fixture(scope="module")
def pool_size(stack: Settings) -> int:
    size = stack.warm_pool.get(stack.default_image, 0)
    if size < 2:
        pytest.fail(f"these tests need DSEC_WARM_POOL >= 2 for {stack.default_image}")
    return size


def _warm(driver: PodmanDriver) -> dict[str, str]:
    """Running warm containers: slot id -> container id."""
    return {b.sandbox_id: b.container_id for b in driver.list_sandboxes() if b.warm and b.running}


def _full(driver: PodmanDriver, size: int) -> dict[str, str]:
    return wait_for(
        lambda: (w := _warm(driver)) and len(w) >= size and w, 60, f"{size} warm containers"
    )


def _event(db: Any, sandbox_id: str, type_: str) -> dict[str, Any] | None:
    with db() as conn:
        row = conn.exec_driver_sql(
            "SELECT payload, tenant, job_id FROM events WHERE sandbox_id = %(s)s"
            " AND type = %(t)s ORDER BY position LIMIT 1",
            {"s": sandbox_id, "t": type_},
        ).first()
    return None if row is None else {**row[0], "tenant": row[1], "job_id": row[2]}


def _stopped(db: Any, sandbox_id: str, timeout_s: float = 20) -> dict[str, Any]:
    found: dict[str, Any] = wait_for(
        lambda: _event(db, sandbox_id, "SandboxStopped"), timeout_s, f"Stopped of {sandbox_id}"
    )
    return found


def test_a_create_claims_a_started_container_that_obeys_the_request(
    client: Any, db: Any, driver: PodmanDriver, pool_size: int
) -> None:
    # Given warm containers started before the request
    before = _full(driver, pool_size)
    # When a trainer asks for a sandbox of that image with its own memory limit and env
    box = client.create(memory_mb=64, pids_limit=50, cpus=0.5, env={"ROLE": "solver"})
    # Then the node handed one of them over: Started says warm, with that container
    started = wait_for(lambda: _event(db, box.id, "SandboxStarted"), what="SandboxStarted")
    assert started["warm"] is True
    assert started["container_id"] in before.values()
    info = driver.inspect(box.id)
    assert info is not None and info["Name"] == f"dsec-{box.id}"
    labels = info["Config"]["Labels"]
    assert labels[label.WARM] and labels[label.SANDBOX_ID] in before
    # And it is a sandbox of the request: its env, with exec's own env on top
    assert box.exec("echo $ROLE").text == "solver\n"
    assert box.exec("echo $ROLE", env={"ROLE": "critic"}).text == "critic\n"
    # And its cgroups carry its name and the request's limits, seen from inside
    assert box.exec("cat /proc/self/cgroup").text.count(f"/{box.id}\n") >= 3
    seen = box.exec(
        "cd /sys/fs/cgroup && cat memory/memory.limit_in_bytes pids/pids.max cpu/cpu.cfs_quota_us"
    ).text.split()
    assert seen == [str(64 * MiB), "50", "50000"], seen
    # When a command touches four times its memory
    hog = box.exec("dd if=/dev/zero of=/dev/null bs=256M count=1")
    # Then the kernel kills it and the sandbox ends with reason oom, billed to the trainer
    assert hog.exit_code == -9
    stopped = _stopped(db, box.id)
    assert stopped["reason"] == "oom"
    assert (stopped["tenant"], stopped["job_id"]) == (client.tenant, client.job_id)
    box.closed = True


def test_ttl_reaps_a_claimed_sandbox(
    client: Any, db: Any, driver: PodmanDriver, pool_size: int
) -> None:
    _full(driver, 1)
    box = client.create(ttl_s=2)
    assert wait_for(lambda: _event(db, box.id, "SandboxStarted"))["warm"] is True
    # Then the reaper finds its expiry in the claim record (its labels have none)
    started = time.monotonic()
    assert _stopped(db, box.id, 15)["reason"] == "ttl"
    assert time.monotonic() - started < 12
    assert driver.get(box.id) is None
    box.closed = True


def test_destroy_removes_a_claimed_sandbox_and_the_pool_refills(
    client: Any, db: Any, driver: PodmanDriver, pool_size: int, stack: Settings
) -> None:
    # Given a full pool, emptied by as many creates at once
    _full(driver, pool_size)
    boxes = client.create_many(pool_size)
    claimed = [b for b in boxes if wait_for(lambda b=b: _event(db, b.id, "SandboxStarted"))["warm"]]
    assert len(claimed) >= pool_size - 1, "a burst of creates should find the pool full"
    # Then the pool refills in the background, while those sandboxes run
    refilled = _full(driver, pool_size)

    # And heartbeats report the sandboxes, never the warm containers
    def heartbeat() -> list[str] | None:
        with db() as conn:
            listed = conn.exec_driver_sql(
                "SELECT payload->'sandboxes' FROM events WHERE node_id = %(n)s"
                " AND type = 'NodeHeartbeat' ORDER BY position DESC LIMIT 1",
                {"n": stack.node_id},
            ).scalar()
        ids: list[str] | None = listed
        return ids if ids and all(b.id in ids for b in boxes) else None

    reported = wait_for(heartbeat, 15, "a heartbeat listing the sandboxes")
    assert not set(reported) & set(refilled)
    # When they are destroyed
    for box in boxes:
        box.close()
    # Then each ended once, destroyed, and nothing of it is left on the node
    limiter = driver.limiter
    assert limiter is not None
    for box in boxes:
        assert _stopped(db, box.id)["reason"] == "destroyed"
        assert driver.get(box.id) is None
        assert box.id not in limiter.sandbox_ids()
    root = stack.state_dir / "nodes" / stack.node_id / "sandboxes"
    assert not [b.id for b in boxes if (root / b.id).exists()]


def test_a_container_removed_behind_the_nodes_back_ends_failed(
    client: Any, db: Any, driver: PodmanDriver
) -> None:
    box = client.create()
    # A warm create answers before its container takes the sandbox's name.
    wait_for(lambda: driver.get(box.id), 10, "the claimed container to take its name")
    # When its container disappears without the node doing it
    assert driver.remove(box.id)
    # Then the scheduler, missing it in two heartbeats, ends it: failed, vanished
    stopped = _stopped(db, box.id, 30)
    assert stopped["reason"] == "failed" and "vanished" in stopped["detail"]
    box.closed = True


def test_an_orphan_container_is_removed(stack: Settings, db: Any, driver: PodmanDriver) -> None:
    # Given a sandbox container on the node that nobody ever asked for
    orphan = f"sb-orphan-{uuid.uuid4().hex[:8]}"
    run_dir = stack.state_dir / "nodes" / stack.node_id / "sandboxes" / orphan
    run_dir.mkdir(parents=True, mode=0o755)
    expires = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    spec = SandboxSpec(
        sandbox_id=orphan,
        image=stack.default_image,
        labels={
            label.TENANT: "nobody",
            label.JOB: "none",
            label.EXPIRES: expires,
            label.NODE: stack.node_id,
        },
        agent_bin_dir=stack.state_dir / "agent",
        run_dir=run_dir,
    )
    driver.create_and_start(spec)
    # Then the node reports it, the scheduler does not know it, and it is destroyed
    wait_for(lambda: driver.get(orphan) is None, 40, "the orphan's removal")
    # And no end is stated for a life the log never opened (a life ends once)
    assert _event(db, orphan, "SandboxStopped") is None


@pytest.mark.slow
def test_a_claimed_sandbox_survives_a_worker_restart(
    client: Any, db: Any, driver: PodmanDriver, stack: Settings, pool_size: int
) -> None:
    _full(driver, 1)
    box = client.create(env={"ROLE": "solver"}, ttl_s=60)
    assert wait_for(lambda: _event(db, box.id, "SandboxStarted"))["warm"] is True
    # When the node's worker restarts (a clean stop drains the pool)
    worker = next(s for s in stack_mod.services(stack) if s.name == f"worker-{stack.node_id}")
    worker.stop(stack)
    assert box.id in {b.sandbox_id for b in driver.list_sandboxes()}
    assert not _warm(driver), "a clean worker stop removes the waiting warm containers"
    since = time.time()
    worker.start(stack)
    wait_for(lambda: stack_mod.node_alive(stack, stack.node_id, since), 60, "the node back")
    # Then the sandbox is found by its id: its agent, its env, and its owner on destroy
    assert box.exec("echo $ROLE", timeout_s=10).text == "solver\n"
    box.close()
    stopped = _stopped(db, box.id)
    assert stopped["reason"] == "destroyed"
    assert (stopped["tenant"], stopped["job_id"]) == (client.tenant, client.job_id)
    _full(driver, pool_size)
