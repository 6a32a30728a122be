"""Images through the hub: a node's first command from an image it never saw, against
a raw ``podman pull`` from the same registry; and what many task images on one base
cost in the hub and on a node.

    .venv/bin/python bench/images.py [--sizes 100,1000] [--rounds 3] [--tasks 200]

- cold start, per size S (MB): an image FROM the base image plus one layer of S MB
  of incompressible data, built into the store and pushed to the hub (`dsec image
  push`), then removed from the store. Each round times the SDK's ``create`` of it
  and its first ``exec("true")``: the node pulls the image for the create
  (workers/host/hub_client.py); the base layer is already on the node, as on every
  node. Raw: root's Podman pulls the same image from the same hub into the same store
  with the node's login (the image removed first), timed alone: the floor of any
  pull-based start. The ratio is what counts on these noisy machines.
- snapshots: a sandbox writes S MB of random data into its /workspace, then
  ``sandbox.snapshot`` keeps it as the tenant's image (stop its processes, read the
  workspace, build one layer on its image, push it to the hub), ``--rounds`` times;
  then ``client.create_group(F, image=snapshot)`` forks F sandboxes from it (on this
  node the image is already in the store: no pull), timed to all ready.
- task images: N images FROM the base, each adding a 64 KiB file of its own (as
  2,000 SWE-style task images add a repository to one environment), built and pushed;
  the hub's storage and the store's growth against the sum of the images' sizes.

Needs `dsec up` (with its hub). Every image it makes is removed from the store after;
the hub keeps their blobs (`docker-registry garbage-collect` frees them).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

from image_sharing import du

from app import credentials
from app.config import Settings, get_settings
from app.images.build import build_image
from app.images.store import remove_image
from app.sdk import Client
from app.stats import percentile
from workers.host.hub_client import HubClient
from workers.host.layer_store import find_image, image_exists, store_podman

HUB_STORAGE = "hub/storage"


def _build(settings: Settings, name: str, payload_bytes: int, base: str) -> None:
    """``name``: ``base`` plus one layer with ``payload_bytes`` of random data."""
    with tempfile.TemporaryDirectory(dir=settings.state_dir) as tmp:
        ctx = Path(tmp)
        with open(ctx / "payload", "wb") as f:
            left = payload_bytes
            while left > 0:
                chunk = min(left, 1 << 20)
                f.write(os.urandom(chunk))
                left -= chunk
        (ctx / "Containerfile").write_text(f"FROM {base}\nCOPY payload /payload\n")
        build_image(name, ctx / "Containerfile", ctx, settings)


def _operator(settings: Settings) -> HubClient:
    return HubClient(settings, credentials.for_client(settings, "operator"))


def _node(settings: Settings) -> HubClient:
    path = settings.node_credential_file or credentials.node_file(settings, settings.node_id)
    return HubClient(settings, credentials.load(path))


def cold_start(settings: Settings, size_mb: int, rounds: int) -> dict[str, float]:
    """Platform and raw figures for one image size."""
    name = f"bench/pull-{size_mb}m:{uuid.uuid4().hex[:8]}"
    _build(settings, name, size_mb << 20, settings.default_image)
    began = time.monotonic()
    _operator(settings).push(name)
    push_s = time.monotonic() - began
    remove_image(name, settings)
    node = _node(settings)
    platform, raw = [], []
    try:
        with Client(settings) as client:
            for _ in range(rounds):
                began = time.monotonic()
                with client.create(image=name, ttl_s=300) as sandbox:
                    result = sandbox.exec("true")
                    platform.append(time.monotonic() - began)
                    assert result.ok, result
                _wait_unused(settings, name)
                remove_image(name, settings)
                began = time.monotonic()
                pulled = store_podman(
                    settings, "pull", "--quiet", *node.login_args(),
                    f"docker://{settings.hub}/{name}",
                )  # fmt: skip
                raw.append(time.monotonic() - began)
                assert pulled.returncode == 0
                store_podman(settings, "rmi", f"{settings.hub}/{name}")
    finally:
        if image_exists(name, settings):
            remove_image(name, settings)
    p50, r50 = percentile(platform, 50), percentile(raw, 50)
    print(
        f"{size_mb} MB layer: push {push_s:.2f} s; create to first command p50"
        f" {p50:.2f} s (max {max(platform):.2f}); raw pull p50 {r50:.2f} s;"
        f" platform / raw {p50 / r50:.2f}"
    )
    return {"push_s": push_s, "first_command_s": p50, "raw_pull_s": r50, "ratio": p50 / r50}


def _wait_unused(settings: Settings, name: str, timeout_s: float = 30.0) -> None:
    from app.images.store import image_users

    deadline = time.monotonic() + timeout_s
    while image_users(name, settings) and time.monotonic() < deadline:
        time.sleep(0.2)


def task_images(settings: Settings, count: int) -> dict[str, float]:
    """Hub and store growth for ``count`` task images on one base."""
    hub_before = du(settings.state_dir / HUB_STORAGE)
    store_before = du(settings.layer_store)
    names = [f"bench/task-{uuid.uuid4().hex[:8]}:{i}" for i in range(count)]
    operator = _operator(settings)
    sizes = 0
    began = time.monotonic()
    try:
        for name in names:
            _build(settings, name, 64 << 10, settings.default_image)
            found = find_image(name, settings)
            sizes += found.size if found else 0
            operator.push(name)
        took = time.monotonic() - began
        hub_growth = du(settings.state_dir / HUB_STORAGE) - hub_before
        store_growth = du(settings.layer_store) - store_before
    finally:
        for name in names:
            if image_exists(name, settings):
                remove_image(name, settings, refresh=False)
    print(
        f"{count} task images: built and pushed in {took:.0f} s; sum of sizes"
        f" {sizes / 1e6:.1f} MB; hub grew {hub_growth / 1e6:.1f} MB, store"
        f" {store_growth / 1e6:.1f} MB"
    )
    return {
        "sum_mb": sizes / 1e6, "hub_mb": hub_growth / 1e6, "store_mb": store_growth / 1e6
    }  # fmt: skip


def snapshots(settings: Settings, changed_mb: int, rounds: int, forks: int) -> dict[str, float]:
    """Snapshot time for ``changed_mb`` written, and a fork of ``forks`` from it."""
    took, images = [], []
    try:
        with Client(settings) as client, client.create(ttl_s=600) as sandbox:
            wrote = sandbox.exec(
                f"head -c {changed_mb << 20} /dev/urandom > /workspace/data", timeout_s=120
            )
            assert wrote.ok, wrote
            name = f"bench-snap-{uuid.uuid4().hex[:6]}"
            for i in range(rounds):
                began = time.monotonic()
                images.append(sandbox.snapshot(name, tag=str(i)))
                took.append(time.monotonic() - began)
            began = time.monotonic()
            shape = {"cpus": 0.1, "memory_mb": 64, "ttl_s": 600}
            with client.create_group(forks, image=images[-1], **shape) as group:
                fork_s = time.monotonic() - began
                assert all(f.exec("test -s /workspace/data").ok for f in group)
    finally:
        for image in images:
            _wait_unused(settings, image)
            if image_exists(image, settings):
                remove_image(image, settings)
    pause_s, resume_s = pause_and_resume(settings, changed_mb)
    p50 = percentile(took, 50)
    print(
        f"snapshot of {changed_mb} MB changed: p50 {p50:.2f} s (max {max(took):.2f});"
        f" fork of {forks} from it: {fork_s:.2f} s to all ready;"
        f" pause {pause_s:.2f} s, resume to first command {resume_s:.2f} s"
    )
    return {"snapshot_s": p50, "fork_s": fork_s, "pause_s": pause_s, "resume_s": resume_s}


def pause_and_resume(settings: Settings, changed_mb: int) -> tuple[float, float]:
    """A sandbox with ``changed_mb`` written paused (snapshot, destroy), then resumed
    (a create from its image) to its first command."""
    image = ""
    try:
        with Client(settings) as client:
            box = client.create(ttl_s=600)
            box.exec(f"head -c {changed_mb << 20} /dev/urandom > /workspace/data", timeout_s=120)
            began = time.monotonic()
            image = box.pause()
            paused = time.monotonic() - began
            began = time.monotonic()
            with client.create(image=image, ttl_s=600) as back:
                assert back.exec("test -s /workspace/data").ok
                resumed = time.monotonic() - began
    finally:
        if image:
            _wait_unused(settings, image)
            if image_exists(image, settings):
                remove_image(image, settings)
    return paused, resumed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100", help="Layer sizes in MB, comma-separated.")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tasks", type=int, default=20)
    parser.add_argument("--snapshot-mb", type=int, default=10)
    parser.add_argument("--forks", type=int, default=16)
    args = parser.parse_args()
    settings = get_settings()
    if not settings.hub or shutil.which("docker-registry") is None:
        raise SystemExit("needs the stack's hub (`dsec up`)")
    subprocess.run(["sync"], check=False)
    parts = []
    for size in (int(s) for s in args.sizes.split(",") if s):
        got = cold_start(settings, size, args.rounds)
        parts.append(
            f"first_command_{size}mb_s={got['first_command_s']:.2f}"
            f" raw_pull_{size}mb_s={got['raw_pull_s']:.2f} ratio_{size}mb={got['ratio']:.2f}"
        )
    if args.snapshot_mb:
        got = snapshots(settings, args.snapshot_mb, args.rounds, args.forks)
        parts.append(
            f"snapshot_{args.snapshot_mb}mb_s={got['snapshot_s']:.2f}"
            f" fork_{args.forks}_s={got['fork_s']:.2f} pause_s={got['pause_s']:.2f}"
            f" resume_s={got['resume_s']:.2f}"
        )
    if args.tasks:
        got = task_images(settings, args.tasks)
        parts.append(
            f"tasks={args.tasks} sum_mb={got['sum_mb']:.1f} hub_mb={got['hub_mb']:.1f}"
            f" store_mb={got['store_mb']:.1f}"
        )
    print("RESULT images " + " ".join(parts))


if __name__ == "__main__":
    main()
