"""The shared, read-only image-layer store as root's Podman keeps it: where it is and
how it is laid out, the Podman that reads and writes it, its writer lock, and what it
holds. Nothing here knows about nodes (:mod:`app.images.store` adds images and
tells the running nodes; :mod:`workers.host.store_view` gives each node its view).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from app.config import Settings, get_settings
from workers.errors import NodeError
from workers.host.file_lock import file_lock

_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class StoreImage:
    """One image in the shared store."""

    id: str
    names: tuple[str, ...]
    size: int
    created: str


def ensure_store(settings: Settings | None = None) -> Path:
    """Create and initialise the store (root-owned, world-traversable); return its path.

    Rootless Podman refuses an *empty* additional store (it tries to create its lock
    directories there), so root's Podman lays out the structure first.
    """
    settings = settings or get_settings()
    store = settings.layer_store
    store.mkdir(mode=0o755, parents=True, exist_ok=True)
    if store.stat().st_uid != 0:
        raise NodeError(f"layer store {store} must belong to root")
    store.chmod(0o755)
    if not (store / "overlay-images" / "images.lock").exists():
        store_podman(settings, "images", "--quiet")
    return store


def store_podman(
    settings: Settings, *args: str, stdin: bytes | None = None, check: bool = True
) -> subprocess.CompletedProcess[bytes]:
    """Run root's Podman against the shared store only (never against a node's).

    Its own config files keep whatever /etc/containers says out of the store.
    """
    conf = store_conf_dir(settings)
    env = {
        "PATH": _PATH,
        "HOME": str(conf),
        "LANG": "C.UTF-8",
        "CONTAINERS_CONF": str(conf / "containers.conf"),
        "CONTAINERS_STORAGE_CONF": str(conf / "storage.conf"),
        "TMPDIR": str(conf / "tmp"),
    }
    cmd = [shutil.which("podman") or "/usr/bin/podman", "--tmpdir", str(conf / "libpod"), *args]
    done = subprocess.run(cmd, input=stdin, capture_output=True, env=env, check=False)
    if check and done.returncode != 0:
        err = done.stderr.decode(errors="replace").strip()
        raise NodeError(f"podman {' '.join(args)} on the layer store failed: {err}")
    return done


def list_images(settings: Settings | None = None) -> list[StoreImage]:
    """Images in the shared store, once each (Podman lists an image once per name)."""
    settings = settings or get_settings()
    ensure_store(settings)
    out = store_podman(settings, "images", "--format", "json").stdout
    images: list[StoreImage] = []
    seen: set[str] = set()
    for item in json.loads(out or b"[]"):
        if item.get("Id") in seen:
            continue
        seen.add(str(item.get("Id")))
        images.append(
            StoreImage(
                id=str(item.get("Id", "")),
                names=tuple(item.get("Names") or ()),
                size=int(item.get("Size") or 0),
                created=str(item.get("CreatedAt", "")),
            )
        )
    return images


def image_exists(name: str, settings: Settings | None = None) -> bool:
    """The store holds ``name`` (short names resolve to ``localhost/`` as Podman does)."""
    settings = settings or get_settings()
    ensure_store(settings)
    return store_podman(settings, "image", "exists", name, check=False).returncode == 0


def find_image(name: str, settings: Settings | None = None) -> StoreImage | None:
    """The store's image called ``name`` (or with that id), or None."""
    settings = settings or get_settings()
    wanted = normalize_name(name)
    for image in list_images(settings):
        if wanted in image.names or (len(name) >= 12 and image.id.startswith(name)):
            return image
    return None


def normalize_name(name: str) -> str:
    """``dsec/x`` -> ``localhost/dsec/x:latest``: the name Podman stores for a local image."""
    first, _, rest = name.partition("/")
    if not rest or ("." not in first and ":" not in first and first != "localhost"):
        name = f"localhost/{name}"
    if ":" not in name.rsplit("/", 1)[-1] and "@" not in name:
        name += ":latest"
    return name


def store_conf_dir(settings: Settings) -> Path:
    """Config, runroot and temp dirs of root's store Podman (written on first use)."""
    conf = settings.state_dir / "store-podman"
    for sub in ("", "run", "libpod", "tmp"):
        (conf / sub).mkdir(mode=0o700, parents=True, exist_ok=True)
    storage = (
        "[storage]\n"
        'driver = "overlay"\n'
        f'graphroot = "{settings.layer_store}"\n'
        f'runroot = "{conf / "run"}"\n'
    )
    containers = (
        "[engine]\n"
        # Root Podman's own database stays out of the store every node user sees.
        f'static_dir = "{conf / "libpod"}"\n'
        'runtime = "runc"\n'
        'cgroup_manager = "cgroupfs"\n'
        'events_logger = "none"\n'
    )
    for fname, text in (("storage.conf", storage), ("containers.conf", containers)):
        path = conf / fname
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
    return conf


def store_lock_path(settings: Settings) -> Path:
    """The store's own lock file: beside the store, not in a stack's ``state_dir``,
    because stacks with different state dirs share one store."""
    store = settings.layer_store
    store.parent.mkdir(parents=True, exist_ok=True)
    return store.parent / f".{store.name}.lock"


@contextlib.contextmanager
def store_lock(settings: Settings) -> Iterator[None]:
    """Hold the store's writer lock: one import, build or removal at a time, and no
    node reading the store meanwhile.

    Podman's own locks keep the store consistent but not deadlock-free: root's import
    takes the layers lock then the images lock, a node service creating a container
    takes them the other way round, and each waits for the other for ever (seen on
    these hosts with Podman 4.3). Node workers hold this lock shared around every
    call that reads the store (:class:`workers.containers.podman_driver.PodmanDriver`), so the
    two never interleave. It also makes check-then-write (exists? import) atomic.
    """
    with file_lock(store_lock_path(settings)):
        yield
