"""The platform's own images, built from this checkout: ``dsec/control`` (projector,
schedulers, Flower, the CLI) and ``dsec/node`` (a node host in a container).

Both come FROM the debootstrap import of bookworm (:mod:`app.images.debian`), so no
registry is involved. Their RUN steps take Debian packages from the mirror apt is
configured with (the host's network); Python packages come from a wheelhouse that
this host's pip fills first (``build/wheels``: the platform's two wheels, dsec and
dsec-sdk, and every dependency's), with the host's package index and certificates, so
that the build itself installs offline. The build context is the repository, narrowed
by its ``.containerignore`` to the wheelhouse: the images hold the installed wheels,
no checkout. They go into the shared store like any image, from where
``podman save`` ships them to other hosts (docs/deploy.md).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import app
from app.config import Settings
from app.images.build import build_image
from app.images.debian import DEBOOTSTRAP_IMAGE, ensure_debootstrap_image
from app.images.store import remove_image
from workers.errors import NodeError
from workers.host.layer_store import image_exists

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
#: Wheels the image's Python (Debian's 3.11.2) needs where this host's does not: redis
#: asks for async-timeout below Python 3.11.3.
IMAGE_PYTHON_EXTRAS = ("async-timeout>=4.0.3",)
#: The wheels the images install from (the package's dependencies and its build's).
WHEELHOUSE = REPO / "build" / "wheels"


@dataclass(frozen=True)
class PlatformImage:
    """One image of the platform: its name and the Containerfile it is built from."""

    repository: str
    containerfile: Path

    def name(self, tag: str) -> str:
        return f"{self.repository}:{tag}"


CONTROL = PlatformImage("dsec/control", DOCKER / "control.Containerfile")
NODE = PlatformImage("dsec/node", DOCKER / "node.Containerfile")


def default_tag() -> str:
    """The package's version: what a release's images are tagged with."""
    return app.__version__


def build_platform_images(
    settings: Settings,
    *,
    tag: str | None = None,
    fresh: bool = False,
    log: Callable[[str], None] = lambda _m: None,
) -> dict[str, float | None]:
    """Build ``dsec/control:TAG`` then ``dsec/node:TAG`` (FROM the first); seconds each
    took, None for one already in the store. ``fresh`` removes them first."""
    tag = tag or default_tag()
    ensure_debootstrap_image(settings, log=log)
    fill_wheelhouse(log)
    took: dict[str, float | None] = {}
    base = DEBOOTSTRAP_IMAGE
    for image in (CONTROL, NODE):
        name = image.name(tag)
        if fresh and image_exists(name, settings):
            remove_image(name, settings, refresh=False)
        started = time.monotonic()
        built = build_image(
            name,
            image.containerfile,
            REPO,
            settings,
            network="host",
            build_args={"BASE": base},
            refresh=False,
        )
        took[name] = None if built is None else time.monotonic() - started
        log(
            f"{name}: "
            + ("already in the store" if built is None else f"built in {took[name]:.0f}s")
        )
        base = name
    return took


def fill_wheelhouse(log: Callable[[str], None] = lambda _m: None) -> Path:
    """Wheels of both distributions (built from this checkout each time) and of their
    dependencies, at the versions the suite passed with (constraints.txt; pip skips
    what is there), in :data:`WHEELHOUSE`."""
    WHEELHOUSE.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    # The SDK's source beside the server's: the server pins that very version of it.
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--wheel-dir", str(WHEELHOUSE),
         "--constraint", str(REPO / "constraints.txt"),
         str(REPO / "sdk"), str(REPO), *IMAGE_PYTHON_EXTRAS],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise NodeError(f"pip wheel failed:\n{done.stderr.strip()[-2000:]}")
    log(f"wheelhouse {WHEELHOUSE}: ready in {time.monotonic() - started:.0f}s")
    return WHEELHOUSE
