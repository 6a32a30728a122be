"""The container driver contract: what every ContainerDriver does, whatever it drives.

One suite, run against each implementation of :class:`workers.containers.port.
ContainerDriver` (after eventsourcing's recorder test cases): the in-memory driver,
and PodmanDriver against the rootless Podman service of the running node
(``integration``), with the image the node's other tests use (built locally, never
pulled). A behaviour stated here holds for both, so tests of the logic above the
driver can use the in-memory one and still mean something.

The node's own reconciler sees the containers made here (they carry the sandbox
label) and listens for their agents; each lives a second or so and is removed by the
test, so no heartbeat pair lists one and the scheduler never calls it an orphan.
"""

from __future__ import annotations

import contextlib
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from app.config import Settings
from workers.agent.build import RESOLVER
from workers.containers import label
from workers.containers.limits import CgroupLimiter
from workers.containers.memory_driver import InMemoryDriver
from workers.containers.port import ContainerDriver, SandboxContainer
from workers.containers.spec import RESOLV_CONF, SandboxSpec
from workers.errors import ImageNotFound, NodeError

IMAGE = "dsec/busybox:latest"
MISSING_IMAGE = "localhost/dsec-contract/never-built:none"
#: What a sandbox runs here: no agent, only a process that lasts.
SLEEP = ["/bin/sh", "-c", "sleep 3600"]


@dataclass
class Harness:
    """A driver under contract, and sandbox specs whose containers it cleans up."""

    driver: ContainerDriver
    #: Host directory the node can read: agent binaries and run directories.
    base: Path
    #: Makes a container the driver did not: (sandbox id, labels).
    make_foreign: Callable[[str, dict[str, str]], None]
    ids: list[str] = field(default_factory=list)

    def new_id(self) -> str:
        """A fresh sandbox id, removed (whatever is left of it) after the test."""
        sandbox_id = f"ct-{uuid.uuid4().hex[:10]}"
        self.ids.append(sandbox_id)
        return sandbox_id

    def spec(self, image: str = IMAGE, **labels: str) -> SandboxSpec:
        sandbox_id = self.new_id()
        run_dir = self.base / "run" / sandbox_id
        run_dir.mkdir(parents=True, mode=0o755)
        return SandboxSpec(
            sandbox_id=sandbox_id,
            image=image,
            labels=labels,
            agent_bin_dir=self.base / "bin",
            run_dir=run_dir,
        )

    def create(self, **labels: str) -> tuple[str, str]:
        """A started sandbox: (sandbox id, container id)."""
        spec = self.spec(**labels)
        return spec.sandbox_id, self.driver.create_and_start(spec)

    def foreign(self, labels: dict[str, str]) -> str:
        """A container named as a sandbox's but made outside the driver; its id."""
        sandbox_id = self.new_id()
        self.make_foreign(sandbox_id, labels)
        return sandbox_id

    def listed(self, sandbox_id: str) -> list[SandboxContainer]:
        return [b for b in self.driver.list_sandboxes() if b.sandbox_id == sandbox_id]

    def clean_up(self) -> None:
        for sandbox_id in self.ids:
            self.driver.remove(sandbox_id)
        left = {b.sandbox_id for b in self.driver.list_sandboxes()} & set(self.ids)
        assert not left, f"containers left behind: {sorted(left)}"


@pytest.fixture(scope="module")
def node_at_rest(stack: Settings) -> Iterator[None]:
    """The node's worker stopped while this module runs on its Podman service: its
    reconcile rounds (every 5 s) remove a warm container its pool does not know and
    look at every sandbox container in the store, which these tests' own are."""
    from app.stack import services as stack_mod
    from tests.conftest import wait_for

    worker = next(s for s in stack_mod.services(stack) if s.name == f"worker-{stack.node_id}")
    worker.stop(stack)  # its pid file goes: the supervisor leaves it down
    try:
        yield
    finally:
        since = time.time()
        worker.start(stack)
        wait_for(lambda: stack_mod.node_alive(stack, stack.node_id, since), 60, "the node back")


@pytest.fixture(scope="module")
def podman_node(request: pytest.FixtureRequest) -> Iterator[tuple[Any, Path]]:
    """The running node's user and a directory of it the node can read."""
    stack: Settings = request.getfixturevalue("stack")
    request.getfixturevalue("node_at_rest")
    from workers.host.user import find_node_user

    user = find_node_user(stack.node_id)
    if user is None:
        pytest.fail(f"node {stack.node_id} is not set up", pytrace=False)
    base = user.home / "contract-tests" / uuid.uuid4().hex[:8]
    (base / "bin").mkdir(parents=True, mode=0o755)
    (base / "bin" / RESOLV_CONF).write_text(RESOLVER)  # an agent directory holds it
    base.parent.chmod(0o755)
    yield user, base
    shutil.rmtree(base, ignore_errors=True)
    with contextlib.suppress(OSError):
        base.parent.rmdir()  # unless another run still uses it


def _podman(request: pytest.FixtureRequest) -> Iterator[Harness]:
    import podman

    from workers.containers.podman_driver import PodmanDriver

    user, base = request.getfixturevalue("podman_node")
    # With the node's own cgroups, as its worker drives Podman (the cgroup half).
    limiter = CgroupLimiter.detect(user.node_id)
    if limiter is None:
        pytest.fail("this host's cgroups cannot be managed: no limits hold", pytrace=False)
    driver = PodmanDriver(user.socket_url, command=SLEEP, limiter=limiter)
    if IMAGE not in driver.list_images():
        pytest.fail(f"{IMAGE} is not on node {user.node_id}: run `dsec up`", pytrace=False)
    client = podman.PodmanClient(base_url=user.socket_url)

    def make_foreign(sandbox_id: str, labels: dict[str, str]) -> None:
        client.containers.create(IMAGE, SLEEP, name=f"dsec-{sandbox_id}", labels=labels)

    harness = Harness(driver, base, make_foreign)
    try:
        yield harness
    finally:
        harness.clean_up()
        client.close()
        driver.close()


def _memory(tmp_path: Path) -> Iterator[Harness]:
    driver = InMemoryDriver(images=[IMAGE])

    def make_foreign(sandbox_id: str, labels: dict[str, str]) -> None:
        driver.add(f"dsec-{sandbox_id}", IMAGE, labels)

    harness = Harness(driver, tmp_path, make_foreign)
    yield harness
    harness.clean_up()


@pytest.fixture(params=["memory", pytest.param("podman", marks=pytest.mark.integration)])
def harness(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Harness]:
    if request.param == "podman":
        yield from _podman(request)
    else:
        yield from _memory(tmp_path)


def test_a_created_sandbox_is_listed_running_with_its_labels(harness: Harness) -> None:
    sandbox_id, container_id = harness.create(**{label.TENANT: "t-1", "x": "1"})
    [box] = harness.listed(sandbox_id)
    assert (box.container_id, box.name) == (container_id, f"dsec-{sandbox_id}")
    assert box.image.removeprefix("localhost/") == IMAGE
    assert box.running and box.exit_code is None and not box.oom_killed
    # The spec's labels and the sandbox label; Podman adds the image's own.
    wanted = {label.TENANT: "t-1", "x": "1", label.SANDBOX_ID: sandbox_id}
    assert box.labels.items() >= wanted.items()
    assert not box.warm and not box.claimed


def test_get_finds_a_sandbox_and_says_none_of_a_missing_one(harness: Harness) -> None:
    sandbox_id, container_id = harness.create(x="1")
    box = harness.driver.get(sandbox_id)
    assert box is not None and box.container_id == container_id and box.running
    assert box.labels == harness.listed(sandbox_id)[0].labels
    assert harness.driver.get(harness.new_id()) is None


def test_a_create_is_idempotent_by_name(harness: Harness) -> None:
    # Given a started sandbox (a redelivered create task will ask for it again)
    spec = harness.spec()
    first = harness.driver.create_and_start(spec)
    # When it is created again
    again = harness.driver.create_and_start(spec)
    # Then the same container is reused, not a second one made
    assert again == first
    assert [b.container_id for b in harness.listed(spec.sandbox_id)] == [first]


def test_remove_makes_it_gone_and_a_second_remove_is_harmless(harness: Harness) -> None:
    sandbox_id, _ = harness.create()
    assert harness.driver.remove(sandbox_id) is True
    assert harness.driver.get(sandbox_id) is None and not harness.listed(sandbox_id)
    assert harness.driver.remove(sandbox_id) is False
    assert harness.driver.remove(harness.new_id()) is False


def test_an_image_the_node_lacks_is_image_not_found_and_leaves_nothing(
    harness: Harness,
) -> None:
    spec = harness.spec(image=MISSING_IMAGE)
    with pytest.raises(ImageNotFound) as raised:
        harness.driver.create_and_start(spec)
    assert isinstance(raised.value, NodeError) and isinstance(raised.value, LookupError)
    assert harness.driver.get(spec.sandbox_id) is None


def test_a_warm_container_renamed_to_a_sandbox_is_claimed(harness: Harness) -> None:
    # Given a warm container, named and labelled after its slot
    slot, container_id = harness.create(**{label.WARM: IMAGE})
    [waiting] = harness.listed(slot)
    assert waiting.warm and not waiting.claimed
    # When a sandbox claims it
    sandbox_id = harness.new_id()
    harness.driver.rename(slot, sandbox_id)
    # Then the name says the sandbox, the container and its labels (the slot) stay
    assert harness.driver.get(slot) is None and not harness.listed(slot)
    [claimed] = harness.listed(sandbox_id)
    assert claimed.container_id == container_id and claimed.running
    assert claimed.labels[label.SANDBOX_ID] == slot
    assert claimed.claimed and not claimed.warm


def test_a_name_is_never_taken_twice(harness: Harness) -> None:
    first, first_container = harness.create()
    second, second_container = harness.create()
    with pytest.raises(NodeError):
        harness.driver.rename(first, second)
    assert [b.container_id for b in harness.listed(first)] == [first_container]
    assert [b.container_id for b in harness.listed(second)] == [second_container]


def test_renaming_a_missing_container_is_an_error(harness: Harness) -> None:
    with pytest.raises(NodeError):
        harness.driver.rename(harness.new_id(), harness.new_id())


def test_only_containers_with_the_sandbox_label_are_listed(harness: Harness) -> None:
    # Given a sandbox, and a container named like one that lacks the sandbox label
    sandbox_id, _ = harness.create()
    stranger = harness.foreign({"x": "1"})
    # Then the listing holds the sandbox and not the stranger
    listed = {b.sandbox_id for b in harness.driver.list_sandboxes()}
    assert sandbox_id in listed and stranger not in listed
    # And get goes by name: it finds the stranger, whose labels say what it is
    found = harness.driver.get(stranger)
    assert found is not None and found.labels.get("x") == "1"
    assert label.SANDBOX_ID not in found.labels


def test_images_are_named_as_users_write_them(harness: Harness) -> None:
    images = harness.driver.list_images()
    assert IMAGE in images
    assert not any(image.startswith("localhost/") for image in images)


# --- the cgroup half: the node's own cgroups hold each sandbox and its limits ---------


def _until(check: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_sandbox_has_cgroups_of_its_own_until_it_is_removed(harness: Harness) -> None:
    sandbox_id, _ = harness.create()
    assert sandbox_id in harness.driver.cgroup_sandbox_ids()
    assert harness.driver.remove(sandbox_id)
    assert sandbox_id not in harness.driver.cgroup_sandbox_ids()


def test_cgroups_that_hold_a_running_sandbox_are_not_removed(harness: Harness) -> None:
    sandbox_id, _ = harness.create()
    assert harness.driver.remove_cgroups(sandbox_id) is False
    assert sandbox_id in harness.driver.cgroup_sandbox_ids()
    assert harness.driver.get(sandbox_id).running  # type: ignore[union-attr]


def test_a_live_sandbox_is_seen_in_its_cgroups_and_was_never_oom_killed(
    harness: Harness,
) -> None:
    sandbox_id, _ = harness.create()
    assert harness.driver.usage(sandbox_id).processes >= 1
    assert harness.driver.oom_kills(sandbox_id) == 0


def test_a_live_sandbox_takes_new_limits_and_one_without_cgroups_refuses(
    harness: Harness,
) -> None:
    sandbox_id, _ = harness.create()
    harness.driver.update_limits(sandbox_id, memory_mb=128, pids=64, cpus=0.5)
    with pytest.raises(NodeError):
        harness.driver.update_limits(harness.new_id(), memory_mb=128, pids=64, cpus=0.5)


def test_killing_a_sandboxs_processes_ends_it(harness: Harness) -> None:
    sandbox_id, _ = harness.create()
    assert harness.driver.kill_processes(sandbox_id) >= 1
    assert _until(lambda: not harness.driver.get(sandbox_id).running)  # type: ignore[union-attr]
    assert harness.driver.kill_processes(harness.new_id()) == 0


def test_renamed_cgroups_follow_a_claimed_sandbox_where_the_host_can_rename(
    harness: Harness,
) -> None:
    if not harness.driver.can_rename_cgroups:
        pytest.skip("cgroup v2 keeps a live sandbox's cgroups under their first name")
    old, _ = harness.create()
    new = harness.new_id()
    harness.driver.rename(old, new)
    harness.driver.rename_cgroups(old, new)
    ids = harness.driver.cgroup_sandbox_ids()
    assert new in ids and old not in ids
    harness.driver.update_limits(new, memory_mb=64, pids=32, cpus=0.25)
