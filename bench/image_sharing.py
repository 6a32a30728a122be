"""Benchmark: N sandboxes of one image on the shared store vs N private copies of it.

    source /tmp/h2.env        # any stack's environment; the stack must be up (dsec up)
    .venv/bin/python bench/image_sharing.py [--n 20] [--image dsec/debian-python:12]

Two phases, each with N sandboxes created through the SDK, each running
``python3 -c 'import time; time.sleep(...)'`` in the background:

- shared: all N sandboxes start from the one image in the shared layer store;
- private: the image's filesystem is exported once (``podman image mount`` + tar) and
  imported N times, each copy with one extra file so that its layer digest (and so its
  files, inodes and page cache) is its own, the way N private images would be.
  Importing the *same* tarball N times would not do: the store keeps one layer per
  digest, so all names would share it.

Disk: ``du -sx`` of the node user's graphroot (what the sandboxes themselves add: their
container layers and config) and of the layer store (what the private copies add).
Memory: the sum of Rss and Pss (and Pss_File, Pss_Anon) from /proc/<pid>/smaps_rollup
of the N python3 processes, found on the host by a marker argument. Pss divides a
shared page among the processes mapping it, so the sum is what those processes cost
together; with private copies every process maps pages of its own files.

Prints the figures; the last line holds the headline numbers. Runs as root; the private
images (``dsec-bench/private-*``) and sandboxes are removed afterwards.
"""

from __future__ import annotations

import argparse
import io
import subprocess
import tarfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from app.config import Settings, get_settings
from app.control import tenants
from app.images.debian import DEBIAN_IMAGE, build_debian_image
from app.images.store import refresh_nodes, remove_image
from app.sdk import Client, Sandbox
from workers.host.layer_store import find_image, store_podman
from workers.host.user import set_up_node_user

MB = 1e6
#: Small sandboxes: the node's declared capacity (8 CPUs per core) must hold N of them.
SIZE = {"cpus": 0.25, "memory_mb": 128}


@dataclass
class Memory:
    """Sums over the benchmark's python3 processes (bytes)."""

    processes: int = 0
    rss: int = 0
    pss: int = 0
    pss_file: int = 0
    pss_anon: int = 0


def du(path: Path) -> int:
    """Bytes allocated under ``path`` on its own filesystem."""
    out = subprocess.run(["du", "-sx", "-B1", str(path)], capture_output=True, text=True).stdout
    return int(out.split()[0]) if out else 0


def memory(marker: str) -> Memory:
    """Rss/Pss sums of the processes whose command line carries ``marker``."""
    total = Memory()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if marker.encode() not in (proc / "cmdline").read_bytes():
                continue
            rollup = (proc / "smaps_rollup").read_text()
        except OSError:
            continue
        fields = {}
        for line in rollup.splitlines()[1:]:
            key, _, rest = line.partition(":")
            fields[key] = int(rest.split()[0]) * 1024
        total.processes += 1
        total.rss += fields.get("Rss", 0)
        total.pss += fields.get("Pss", 0)
        total.pss_file += fields.get("Pss_File", 0)
        total.pss_anon += fields.get("Pss_Anon", 0)
    return total


def start_sleepers(boxes: list[Sandbox], marker: str, n: int) -> Memory:
    """Start python3 in each sandbox, wait until all run, and measure them."""
    cmd = f"python3 -c 'import time; time.sleep(900)' {marker} >/dev/null 2>&1 &"
    for box in boxes:
        result = box.exec(cmd)
        assert result.exit_code == 0, result
    deadline = time.monotonic() + 60
    while memory(marker).processes < n:
        assert time.monotonic() < deadline, "python3 did not start in every sandbox"
        time.sleep(0.2)
    time.sleep(2)  # past interpreter start-up
    return memory(marker)


def private_tarball(settings: Settings, image: str) -> tuple[bytes, int]:
    """The image's filesystem as a tar, and the offset where its end blocks start."""
    mount = store_podman(settings, "image", "mount", image).stdout.decode().strip()
    try:
        tar = subprocess.run(
            ["tar", "--numeric-owner", "-C", mount, "-cf", "-", "."],
            capture_output=True,
            check=True,
        ).stdout
    finally:
        store_podman(settings, "image", "unmount", image, check=False)
    with tarfile.open(fileobj=io.BytesIO(tar)) as reader:
        for _ in reader:
            pass
        end = reader.offset
    return tar, end


def with_marker(tar: bytes, end: int, text: str) -> bytes:
    """``tar`` with one more file, /etc/dsec-private-copy, holding ``text``."""
    data = text.encode()
    info = tarfile.TarInfo("./etc/dsec-private-copy")
    info.size, info.mtime = len(data), 1_700_000_000
    pad = b"\0" * (-len(data) % tarfile.BLOCKSIZE)
    return tar[:end] + info.tobuf(format=tarfile.PAX_FORMAT) + data + pad + b"\0" * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20, help="sandboxes per phase")
    parser.add_argument("--image", default=DEBIAN_IMAGE)
    args = parser.parse_args()
    n, image = args.n, args.image
    settings = get_settings()
    if image == DEBIAN_IMAGE:
        build_debian_image(settings, log=lambda m: print(f"  {m}"))
    found = find_image(image, settings)
    user = set_up_node_user(settings.node_id, settings)
    assert found is not None, f"{image} is not in the store"
    run = uuid.uuid4().hex[:8]
    print(f"image {image}: {found.size / MB:.1f} MB; node {user.node_id}; N={n}")

    bench = tenants.local(settings, "bench")
    with Client(settings, credential=bench, job_id=f"image-sharing-{run}") as client:
        # --- shared store: N sandboxes, one image --------------------------------------
        before = du(user.graphroot)
        started = time.monotonic()
        boxes = client.create_many(n, image, **SIZE)
        create_s = time.monotonic() - started
        try:
            shared_disk = du(user.graphroot) - before
            shared = start_sleepers(boxes, f"dsec-bench-shared-{run}", n)
        finally:
            for box in boxes:
                box.close()
        print(f"shared:  {n} sandboxes created in {create_s:.1f}s")

        # --- private copies: N images with the same files, one per sandbox -------------
        tar, end = private_tarball(settings, image)
        names = [f"dsec-bench/private-{run}-{i}:1" for i in range(n)]
        store_before = du(settings.layer_store)
        started = time.monotonic()
        try:
            for i, name in enumerate(names):
                store_podman(
                    settings,
                    "import",
                    "--quiet",
                    "--change",
                    "WORKDIR /workspace",
                    "-",
                    name,
                    stdin=with_marker(tar, end, f"{run}-{i}\n"),
                )
            import_s = time.monotonic() - started
            store_growth = du(settings.layer_store) - store_before
            refresh_nodes(settings, names[-1], present=True)
            before = du(user.graphroot)
            boxes = [client.create(name, **SIZE) for name in names]
            try:
                private_disk = du(user.graphroot) - before
                private = start_sleepers(boxes, f"dsec-bench-private-{run}", n)
            finally:
                for box in boxes:
                    box.close()
        finally:
            for name in names:
                remove_image(name, settings, refresh=False)
            refresh_nodes(settings, names[-1], present=False)
    print(f"private: {n} copies imported in {import_s:.1f}s ({import_s / n:.1f}s each)")

    size = found.size
    print()
    print(f"{'disk':28} {'shared store':>16} {'private copies':>16}")
    print(f"{'image bytes on disk':28} {size / MB:13.1f} MB {store_growth / MB:13.1f} MB")
    print(f"{'  (image size x N)':28} {'':>16} {size * n / MB:13.1f} MB")
    print(f"{'graphroot growth':28} {shared_disk / MB:13.2f} MB {private_disk / MB:13.2f} MB")
    print(
        f"{'  per sandbox':28} {shared_disk / n / 1e3:13.1f} kB {private_disk / n / 1e3:13.1f} kB"
    )
    print()
    print(f"{'memory (N python3 sleeping)':28} {'shared store':>16} {'private copies':>16}")
    for label, attr in (
        ("sum Rss", "rss"),
        ("sum Pss", "pss"),
        ("  of which Pss_File", "pss_file"),
        ("  of which Pss_Anon", "pss_anon"),
    ):
        a, b = getattr(shared, attr), getattr(private, attr)
        print(f"{label:28} {a / MB:13.1f} MB {b / MB:13.1f} MB")
    print(f"{'Pss per sandbox':28} {shared.pss / n / MB:13.2f} MB {private.pss / n / MB:13.2f} MB")
    print()
    shared_total = size + shared_disk
    private_total = store_growth + private_disk
    print(
        f"headline: N={n} {image}: disk {shared_total / MB:.0f} MB shared vs "
        f"{private_total / MB:.0f} MB private ({private_total / shared_total:.1f}x); "
        f"python3 Pss sum {shared.pss / MB:.1f} MB shared vs {private.pss / MB:.1f} MB private "
        f"({private.pss / shared.pss:.1f}x)"
    )


if __name__ == "__main__":
    main()
