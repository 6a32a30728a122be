"""The node's Podman side for real: node user, service, shared store, sandbox containers.

Uses its own node ``ptest`` (user ``dsec-ptest``) so it never disturbs ``node0``; the
setup is idempotent, so the node is left configured for the next run.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.config import Settings, get_settings
from app.images import store as image_store
from workers.agent.build import RESOLVER
from workers.containers.podman_driver import PodmanDriver
from workers.containers.spec import AGENT_BIN_MOUNT, RESOLV_CONF, SandboxSpec
from workers.errors import ImageNotFound, PodmanUnavailable
from workers.host import layer_store
from workers.host.ops import live_processes_of
from workers.host.podman_service import ensure_podman_service
from workers.host.setup import ensure_node_user
from workers.host.user import NodeUser

pytestmark = pytest.mark.integration

NODE = "ptest"
IMAGE = image_store.BUSYBOX_IMAGE
SLEEP = ["/bin/sh", "-c", "sleep 3600"]


@pytest.fixture(scope="module")
def cfg() -> Settings:
    if os.geteuid() != 0 or shutil.which("podman") is None:
        pytest.fail("needs root and podman (apt-get install podman runc uidmap)", pytrace=False)
    return get_settings()


@pytest.fixture(scope="module")
def node(cfg: Settings) -> NodeUser:
    image_store.import_busybox_image(settings=cfg)
    user = ensure_node_user(NODE, cfg)
    ensure_podman_service(user, cfg)
    return user


@pytest.fixture(scope="module")
def workdir(node: NodeUser) -> Iterator[Path]:
    """Host dirs the node user can read (pytest's tmp_path is root-only)."""
    base = node.home / "test" / uuid.uuid4().hex[:8]
    (base / "bin").mkdir(parents=True, mode=0o755)
    (base / "bin" / RESOLV_CONF).write_text(RESOLVER)  # an agent directory holds it
    base.parent.chmod(0o755)
    shutil.copy("/bin/busybox", base / "bin" / "busybox")
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def driver(node: NodeUser) -> Iterator[PodmanDriver]:
    d = PodmanDriver(node.socket_url, command=SLEEP)
    yield d
    for box in d.list_sandboxes():
        if box.sandbox_id.startswith("pt-"):
            d.remove(box.sandbox_id)
    d.close()


def _spec(workdir: Path, image: str = IMAGE) -> SandboxSpec:
    sid = f"pt-{uuid.uuid4().hex[:10]}"
    run = workdir / "run" / sid
    run.mkdir(parents=True, mode=0o755)
    return SandboxSpec(sandbox_id=sid, image=image, agent_bin_dir=workdir / "bin", run_dir=run)


def test_node_setup_is_idempotent(cfg: Settings, node: NodeUser) -> None:
    pidfile = cfg.state_dir / "run" / f"podman-{NODE}.pid"
    pid = pidfile.read_text()
    again = ensure_node_user(NODE, cfg)
    assert again == node
    assert again.name == "dsec-ptest" and again.uid != 0 and again.subuids
    assert again.socket_url == f"unix://{cfg.state_dir}/nodes/{NODE}/run/podman/podman.sock"
    assert ensure_podman_service(again, cfg) == node.socket_url
    assert pidfile.read_text() == pid, "a healthy service is reused, not restarted"
    conf = (node.config_dir / "containers.conf").read_text()
    assert 'runtime = "runc"' in conf and "keyring = false" in conf
    storage = (node.config_dir / "storage.conf").read_text()
    assert f'additionalimagestores = ["{node.store_view}"]' in storage
    # The shared store shows as the node user's own through the idmapped view.
    st = node.store_view.stat()
    assert (st.st_uid, st.st_gid) == (node.uid, node.gid)
    assert cfg.layer_store.stat().st_uid == 0


def test_busybox_image_is_in_store_and_seen_by_node(cfg: Settings, driver: PodmanDriver) -> None:
    assert image_store.import_busybox_image(settings=cfg) is False, "second import is a no-op"
    assert layer_store.image_exists(IMAGE, cfg)
    assert any(f"localhost/{IMAGE}" in i.names for i in layer_store.list_images(cfg))
    assert driver.ping()
    assert driver.image_exists(IMAGE)
    assert IMAGE in driver.list_images()


def test_sandbox_is_locked_down(driver: PodmanDriver, workdir: Path) -> None:
    probe = (
        "grep -E '^(CapEff|CapBnd|NoNewPrivs)' /proc/self/status; "
        "echo nets=$(ls /sys/class/net); "
        "touch /rootfs-write 2>/dev/null || echo root-ro; "
        "touch /workspace/w /tmp/t && echo scratch-rw; "
        "touch /.dsec/bin/x 2>/dev/null || echo agent-bin-ro; "
        f"{AGENT_BIN_MOUNT}/busybox true && echo agent-bin-runs; "
        "echo owner=$(stat -c %u:%g /bin/busybox /etc/passwd /workspace | tr '\\n' ,); "
        "echo id=$(id -u)"
    )
    spec = _spec(workdir)
    driver.create_and_start(spec, command=["/bin/sh", "-c", probe])
    deadline = time.monotonic() + 15
    while (box := driver.get(spec.sandbox_id)) is not None and box.running:
        assert time.monotonic() < deadline, "probe did not finish"
        time.sleep(0.05)
    assert box is not None and box.exit_code == 0 and not box.oom_killed
    out = driver.logs(spec.sandbox_id) or ""
    info = driver.inspect(spec.sandbox_id)
    assert info is not None
    host = info["HostConfig"]
    assert host["NetworkMode"] == "none"
    assert host["ReadonlyRootfs"] is True
    assert "CAP_SYS_CHROOT" in host["CapDrop"] and not host["CapAdd"]
    assert "no-new-privileges" in host["SecurityOpt"]
    assert info["Config"]["Labels"]["dsec.sandbox_id"] == spec.sandbox_id
    assert "CapEff:\t0000000000000000" in out and "CapBnd:\t0000000000000000" in out
    assert "NoNewPrivs:\t1" in out
    assert "nets=lo\n" in out, out
    for line in ("root-ro", "scratch-rw", "agent-bin-ro", "agent-bin-runs", "id=0"):
        assert line in out.splitlines(), out
    # Image files and scratch space belong to the sandbox's root, not to nobody.
    assert "owner=0:0,0:0,0:0," in out, out


def test_create_is_idempotent_and_remove_too(driver: PodmanDriver, workdir: Path) -> None:
    spec = _spec(workdir)
    cid = driver.create_and_start(spec)
    assert driver.create_and_start(spec) == cid
    boxes = {b.sandbox_id: b for b in driver.list_sandboxes()}
    assert boxes[spec.sandbox_id].running and boxes[spec.sandbox_id].container_id == cid
    started = time.monotonic()
    assert driver.remove(spec.sandbox_id) is True
    assert time.monotonic() - started < 5, "remove must not wait for a stop timeout"
    assert driver.remove(spec.sandbox_id) is False
    assert driver.get(spec.sandbox_id) is None
    assert spec.sandbox_id not in {b.sandbox_id for b in driver.list_sandboxes()}


def test_unknown_image_raises_image_not_found(driver: PodmanDriver, workdir: Path) -> None:
    spec = _spec(workdir, image="dsec/no-such-image:never")
    assert not driver.image_exists(spec.image)
    with pytest.raises(ImageNotFound):
        driver.create_and_start(spec)
    assert driver.get(spec.sandbox_id) is None


def test_no_service_raises_podman_unavailable(workdir: Path) -> None:
    dead = PodmanDriver(f"unix://{workdir}/no-such.sock", timeout_s=2)
    assert dead.ping() is False
    with pytest.raises(PodmanUnavailable):
        dead.list_sandboxes()
    with pytest.raises(PodmanUnavailable):
        dead.create_and_start(_spec(workdir))


def test_a_node_does_not_read_the_store_while_root_writes_it(node: NodeUser, cfg: Settings) -> None:
    # Root's import and a node's create take Podman's store locks in opposite orders
    # and can wait for each other for ever; the store lock keeps them apart.
    guarded = PodmanDriver(node.socket_url, store_lock=layer_store.store_lock_path(cfg))
    listed: list[list[str]] = []
    with layer_store.store_lock(cfg):
        reader = threading.Thread(target=lambda: listed.append(guarded.list_images()))
        reader.start()
        reader.join(1.0)
        assert reader.is_alive() and not listed, "the node read the store during a write"
    reader.join(30)
    assert listed and IMAGE in listed[0]
    guarded.close()


def test_a_node_whose_processes_all_died_starts_again(
    cfg: Settings, node: NodeUser, driver: PodmanDriver, workdir: Path
) -> None:
    # Given a running sandbox, then every process of the node user gone at once (the
    # state dir carried into a fresh process world keeps saying "running")
    spec = _spec(workdir)
    driver.create_and_start(spec)
    _kill_all_of(node.uid)
    # When the node is set up again
    again = ensure_node_user(NODE, cfg)
    # Then its service starts, and the sandbox is known as no longer running
    assert ensure_podman_service(again, cfg, timeout_s=30) == node.socket_url
    box = driver.get(spec.sandbox_id)
    assert box is not None and not box.running
    assert driver.remove(spec.sandbox_id) is True


def _kill_all_of(uid: int) -> None:
    deadline = time.monotonic() + 10
    while pids := live_processes_of(uid):
        assert time.monotonic() < deadline, f"processes of uid {uid} survived SIGKILL: {pids}"
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
