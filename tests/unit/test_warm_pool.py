"""Warm pool logic without Podman: identity, claim records, limits rewrites, and the
claim and refill rules against the in-memory container driver and a fake agent pool."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from workers.claim_record import RECORD_NAME, ClaimRecord, read_record, write_record
from workers.containers import label
from workers.containers import limits as limits_mod
from workers.containers.limits import CgroupLayout, CgroupLimiter, Hierarchy, Limits
from workers.containers.memory_driver import InMemoryDriver
from workers.containers.podman_api import from_list
from workers.containers.port import ContainerDriver, SandboxContainer
from workers.containers.spec import SandboxSpec
from workers.errors import NodeError
from workers.upkeep import held
from workers.warm_pool import WarmPool

IMAGE = "dsec/busybox:latest"


def _box(name: str, label_id: str, warm: bool) -> SandboxContainer:
    labels = {label.SANDBOX_ID: label_id, **({label.WARM: IMAGE} if warm else {})}
    return from_list({"Names": [name], "Labels": labels, "State": "running", "Id": "c1"}, False)


def test_the_name_identifies_a_sandbox_and_tells_warm_from_claimed() -> None:
    cold = _box("dsec-sb-1", "sb-1", warm=False)
    waiting = _box("dsec-warm-1", "warm-1", warm=True)
    claimed = _box("dsec-sb-2", "warm-1", warm=True)
    assert (cold.sandbox_id, cold.warm, cold.claimed) == ("sb-1", False, False)
    assert (waiting.sandbox_id, waiting.warm, waiting.claimed) == ("warm-1", True, False)
    assert (claimed.sandbox_id, claimed.warm, claimed.claimed) == ("sb-2", False, True)


def test_claim_record_round_trip_and_refusals(tmp_path: Path) -> None:
    record = ClaimRecord("sb-1", "warm-1", IMAGE, {"dsec.tenant": "a"}, {"K": "v"})
    write_record(tmp_path, record)
    assert read_record(tmp_path) == record
    # A symlink is never followed, garbage is no record
    (tmp_path / RECORD_NAME).unlink()
    os.symlink("/etc/passwd", tmp_path / RECORD_NAME)
    assert read_record(tmp_path) is None
    (tmp_path / RECORD_NAME).unlink()
    (tmp_path / RECORD_NAME).write_text("{not json")
    assert read_record(tmp_path) is None


@pytest.fixture
def limiter(tmp_path: Path) -> CgroupLimiter:
    hierarchy = Hierarchy(1, {c: tmp_path / c for c in ("memory", "pids", "cpu", "cpuacct")})
    limiter = CgroupLimiter(CgroupLayout(hierarchy, "n"))
    limiter.create("warm-1", Limits.of(512, 256, 1.0))
    (tmp_path / "memory/dsec/n/warm-1/memory.memsw.limit_in_bytes").write_text(str(512 << 20))
    return limiter


@pytest.mark.parametrize(("memory_mb", "first"), [(64, "memory.limit_in_bytes"), (1024, "memsw")])
def test_a_memory_limit_grows_memsw_first_and_shrinks_it_last(
    limiter: CgroupLimiter, monkeypatch: pytest.MonkeyPatch, memory_mb: int, first: str
) -> None:
    written: list[str] = []
    real = limits_mod._write_all
    monkeypatch.setattr(
        limits_mod, "_write_all", lambda ws: (written.extend(p.name for p, _, _ in ws), real(ws))
    )
    limiter.update("warm-1", Limits.of(memory_mb, 32, 0.5))
    assert first in written[0]
    assert limiter.read("warm-1", "memory", "memory.limit_in_bytes") == str(memory_mb << 20)
    assert limiter.read("warm-1", "pids", "pids.max") == "32"


def test_rename_moves_every_controller_and_is_idempotent(limiter: CgroupLimiter) -> None:
    limiter.rename("warm-1", "sb-9")
    limiter.rename("warm-1", "sb-9")
    assert limiter.sandbox_ids() == ["sb-9"]
    assert limiter.read("sb-9", "pids", "pids.max") == "256"


def test_cgroup_v2_cannot_rename(tmp_path: Path) -> None:
    v2 = CgroupLimiter(CgroupLayout(Hierarchy(2, {"": tmp_path}), "n"))
    assert not v2.layout.renamable
    with pytest.raises(OSError, match="cannot rename"):
        v2.rename("warm-1", "sb-9")


# --- the pool against the in-memory driver --------------------------------------------


class FakeAgents:
    def __init__(self) -> None:
        self.slots: dict[str, dict[str, str]] = {}
        self.dead: set[str] = set()

    def register(self, sandbox_id: str, run_dir: Path, env: Any = None) -> Path:
        self.slots[sandbox_id] = dict(env or {})
        return run_dir / "agent.sock"

    def rename(self, old: str, new: str, run_dir: Path, env: Any = None) -> None:
        del self.slots[old]
        self.slots[new] = dict(env or {})

    def unregister(self, sandbox_id: str) -> None:
        self.slots.pop(sandbox_id, None)

    def registered(self) -> set[str]:
        return set(self.slots)

    def is_connected(self, sandbox_id: str) -> bool:
        return sandbox_id in self.slots and sandbox_id not in self.dead

    def connection(self, sandbox_id: str, wait_s: float) -> Any:
        return type("Conn", (), {"ping": lambda self: None})()


class FakeNode:
    def __init__(self, root: Path) -> None:
        self.node_id = "n"
        self.driver: ContainerDriver = InMemoryDriver(images=[IMAGE])
        self.agents = FakeAgents()
        self.sandbox_root = root
        self.agent_dir = root / "agent"
        self.last_transition = 0.0
        self.busy: set[str] = set()

    def run_dir(self, sandbox_id: str) -> Path:
        return self.sandbox_root / sandbox_id

    def busy_ids(self) -> set[str]:
        return set(self.busy)


@pytest.fixture
def node(tmp_path: Path) -> FakeNode:
    return FakeNode(tmp_path)


@pytest.fixture
def pool(node: FakeNode) -> Iterator[WarmPool]:
    pool = WarmPool(node, {IMAGE: 2}, idle_s=0.05)
    pool.start()
    deadline = time.monotonic() + 5
    while pool.ready(IMAGE) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    yield pool
    pool.close(drain=False)


def _spec(node: FakeNode, sandbox_id: str = "sb-1", **kw: Any) -> SandboxSpec:
    shape: dict[str, Any] = {"image": IMAGE, "env": {"K": "v"}, **kw}
    return SandboxSpec(sandbox_id=sandbox_id, run_dir=node.run_dir(sandbox_id), **shape)


def test_a_claim_moves_everything_and_the_container_follows_at_finish(
    pool: WarmPool, node: FakeNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a look at the node when the container's rename begins
    at_rename: dict[str, Any] = {}
    rename = node.driver.rename

    def look(old: str, new: str) -> None:
        at_rename.update(
            old=old,
            limits=node.driver.limits(new),
            run_dir=node.run_dir(new).is_dir(),
            agent=new in node.agents.slots,
            container=node.driver.get(new),
        )
        rename(old, new)

    monkeypatch.setattr(node.driver, "rename", look)
    # When a sandbox claims a warm container
    container = pool.claim(_spec(node, memory_mb=64))
    # Then its container keeps the slot's name until the create finishes the claim (the
    # trainer is answered first), and the reconciler leaves it alone meanwhile
    assert container is not None and not at_rename and node.driver.get("sb-1") is None
    slot = next(b for b in node.driver.list_sandboxes() if b.container_id == container)
    pool.check(slot)
    assert node.driver.get(slot.sandbox_id) is not None
    pool.finish("sb-1")
    # and cgroups (with the sandbox's limits), run dir and agent slot had moved first
    assert at_rename["old"] == slot.sandbox_id
    assert at_rename["limits"] == Limits.of(64, 256, 1.0)
    assert at_rename["run_dir"] and at_rename["agent"] and at_rename["container"] is None
    claimed = node.driver.get("sb-1")
    assert claimed is not None and claimed.claimed and claimed.container_id == container
    assert node.agents.slots["sb-1"] == {"K": "v"}
    assert read_record(node.run_dir("sb-1")) == pool.record("sb-1")
    assert slot.sandbox_id not in pool.slot_ids()


def test_a_rename_refused_at_finish_removes_the_container_and_says_so(
    pool: WarmPool, node: FakeNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool.close(drain=False)  # no refill meanwhile
    container = pool.claim(_spec(node))

    def refused(old: str, new: str) -> None:
        raise NodeError("rename refused")

    monkeypatch.setattr(node.driver, "rename", refused)
    with pytest.raises(NodeError, match="refused"):
        pool.finish("sb-1")
    assert all(b.container_id != container for b in node.driver.list_sandboxes())
    assert pool.slot_ids() == {b.sandbox_id for b in node.driver.list_sandboxes()}


def test_an_abandoned_claim_removes_its_container(pool: WarmPool, node: FakeNode) -> None:
    pool.close(drain=False)  # no refill meanwhile
    container = pool.claim(_spec(node))
    pool.abandon("sb-1")
    assert all(b.container_id != container for b in node.driver.list_sandboxes())
    pool.finish("sb-1")  # nothing left to finish


def test_a_restart_between_a_claims_commit_and_its_rename_finishes_it(
    pool: WarmPool, node: FakeNode
) -> None:
    # Given a worker that died after a claim's commit, before its container's rename
    pool.close(drain=False)
    container = pool.claim(_spec(node))
    # When the next worker's pool starts
    again = WarmPool(node, {IMAGE: 0})
    again.start()
    again.close(drain=False)
    # Then the sandbox has its container (the unclaimed slot is gone)
    claimed = node.driver.get("sb-1")
    assert claimed is not None and claimed.claimed and claimed.container_id == container
    assert [b.sandbox_id for b in node.driver.list_sandboxes()] == ["sb-1"]


def test_shapes_the_pool_cannot_serve_start_cold(pool: WarmPool, node: FakeNode) -> None:
    assert pool.claim(_spec(node, network=True)) is None
    assert pool.claim(_spec(node, disk_mb=1024)) is None
    assert pool.claim(_spec(node, image="other:latest")) is None
    assert pool.ready(IMAGE) == 2


def test_a_failed_hand_over_leaves_nothing_and_goes_cold(
    pool: WarmPool, node: FakeNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a full pool whose agent slot cannot move (after the commit)
    pool.close(drain=False)  # no refill meanwhile
    slots = {b.sandbox_id for b in node.driver.list_sandboxes() if b.warm}

    def refused(*args: Any, **kwargs: Any) -> None:
        raise NodeError("rename refused")

    monkeypatch.setattr(node.agents, "rename", refused)
    # When a sandbox claims one, the create goes cold
    assert pool.claim(_spec(node)) is None
    # Then the slot is gone with all it had, under its name and the sandbox's
    left = {b.sandbox_id for b in node.driver.list_sandboxes()}
    assert len(slots - left) == 1 and left < slots and pool.ready(IMAGE) == 1
    assert node.driver.cgroup_sandbox_ids() == sorted(left)
    assert "sb-1" not in node.agents.slots and not node.run_dir("sb-1").exists()


def test_a_slot_whose_agent_hung_up_is_skipped(pool: WarmPool, node: FakeNode) -> None:
    pool.close(drain=False)  # no refill meanwhile
    first = next(s for s in node.agents.slots if s.startswith("warm-"))
    node.agents.dead.add(first)
    hung_up = node.driver.get(first)
    container = pool.claim(_spec(node))
    assert hung_up is not None and container not in (None, hung_up.container_id)
    assert node.driver.get(first) is None
    assert pool.ready(IMAGE) == 0


def test_a_start_removes_a_previous_lifes_warm_containers_not_its_sandboxes(
    node: FakeNode,
) -> None:
    # Given a warm container and a claimed one, left by a worker that stopped
    for slot in ("warm-old", "warm-taken"):
        node.run_dir(slot).mkdir(parents=True)
        warm = SandboxSpec(slot, IMAGE, labels={label.WARM: IMAGE}, run_dir=node.run_dir(slot))
        node.driver.create_and_start(warm)
    node.driver.rename("warm-taken", "sb-1")
    # When a new pool starts
    pool = WarmPool(node, {IMAGE: 0})
    pool.start()
    pool.close(drain=False)
    # Then the unclaimed one is gone with its run dir; the claimed sandbox stays
    assert [b.sandbox_id for b in node.driver.list_sandboxes()] == ["sb-1"]
    assert not node.run_dir("warm-old").exists()


def test_refill_waits_while_sandboxes_are_busy(pool: WarmPool, node: FakeNode) -> None:
    # Given the pool emptied by claims while a create is still in flight
    node.busy.add("sb-x")
    assert pool.claim(_spec(node, "sb-1")) and pool.claim(_spec(node, "sb-2"))
    time.sleep(0.3)
    # Then nothing is refilled until the node is quiet
    assert pool.ready(IMAGE) == 0
    node.busy.clear()
    node.last_transition = time.monotonic()
    deadline = time.monotonic() + 5
    while pool.ready(IMAGE) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.ready(IMAGE) == 2


def test_concurrent_claims_never_share_a_slot(pool: WarmPool, node: FakeNode) -> None:
    pool.close(drain=False)  # no refill: two slots for eight claims
    got: list[str | None] = []
    threads = [
        threading.Thread(target=lambda i=i: got.append(pool.claim(_spec(node, f"sb-{i}"))))
        for i in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    claimed = [c for c in got if c is not None]
    assert len(claimed) == 2 and len(set(claimed)) == 2


def test_heartbeats_list_sandboxes_and_creates_never_warm_slots(
    pool: WarmPool, node: FakeNode
) -> None:
    # Given a create in flight (which holds the refill back) and a claimed sandbox
    node.busy.add("sb-2")
    pool.claim(_spec(node, "sb-1"))
    node.warm = pool  # type: ignore[attr-defined]
    # Then the heartbeat's list is the sandboxes, not the slot still waiting
    assert len(node.agents.slots) == 2 and pool.ready(IMAGE) == 1
    assert held(node) == ["sb-1", "sb-2"]
