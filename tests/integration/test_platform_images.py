"""The platform's own images build from this checkout's wheels, with nothing pulled:
the control image runs the installed CLI as a user without privileges, and the node
image carries rootless Podman's tools and a static agent but no compiler."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from app.config import Settings
from app.images.platform import CONTROL, NODE, build_platform_images
from app.images.store import remove_image
from tests.conftest import wait_for
from workers.host.layer_store import image_exists, store_podman

pytestmark = [pytest.mark.integration, pytest.mark.slow]

#: Podman's default rlimits exceed this machine's hard limits (DESIGN.md).
ULIMITS = ("--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024")


def _run(settings: Settings, image: str, *args: str, entrypoint: str | None = None) -> str:
    """What ``image`` prints when run with ``args`` (it must exit 0)."""
    name = f"dsec-image-check-{uuid.uuid4().hex[:8]}"
    extra = ("--entrypoint", entrypoint) if entrypoint else ()
    store_podman(settings, "run", "-d", "--name", name, "--network=none", *ULIMITS, *extra,
                 image, *args)  # fmt: skip
    try:
        # Polled: `podman wait` and an attached run notice the exit ~20 s late here.
        state = wait_for(lambda: _exited(settings, name), timeout_s=120, what=f"{image} to exit")
        out = store_podman(settings, "logs", name).stdout.decode()
        assert state == "0", f"{image} {args} exited {state}: {out}"
        return out
    finally:
        store_podman(settings, "rm", "-f", name, check=False)


def _exited(settings: Settings, name: str) -> str | None:
    """The container's exit code once it has exited."""
    fmt = "{{.State.Status}} {{.State.ExitCode}}"
    status, _, code = (
        store_podman(settings, "inspect", "--format", fmt, name).stdout.decode().partition(" ")
    )
    # "stopped" is how this Podman shows a container whose process ended.
    return code.strip() if status in ("exited", "stopped") else None


@pytest.fixture
def tag(stack: Settings) -> Iterator[str]:
    """A tag of this run's own: the images are built anew from this checkout."""
    made = f"test-{uuid.uuid4().hex[:8]}"
    yield made
    for image in (NODE, CONTROL):
        if image_exists(image.name(made), stack):
            remove_image(image.name(made), stack, refresh=False)


def test_the_platform_images_build_and_hold_what_each_role_needs(stack: Settings, tag: str) -> None:
    took = build_platform_images(stack, tag=tag)
    control, node = CONTROL.name(tag), NODE.name(tag)
    assert took[control] is not None and took[node] is not None

    assert _run(stack, control, "--version").startswith("dsec ")
    # The wheels are installed, no checkout: the migrations are the package's own
    where = _run(stack, control, "-c", "test ! -e /opt/dsec/src && python -c "
                 "'from app.db.setup import migrations_dir; print(migrations_dir())'",
                 entrypoint="sh").strip()  # fmt: skip
    assert where.startswith("/opt/dsec/venv/lib/") and where.endswith("app/db/migrations"), where
    who = _run(stack, control, "-c", "id -un", entrypoint="sh").strip()
    assert who == "dsec"
    probe = (
        "podman --version && runc --version >/dev/null && newuidmap 2>&1 | head -c0;"
        " test -x /opt/dsec/agent/dsec-agent && echo agent;"
        " command -v gcc cc || echo no-compiler; dsec --version"
    )
    out = _run(stack, node, "-c", probe, entrypoint="sh")
    assert "podman version" in out and "agent" in out and "no-compiler" in out, out
    assert out.rstrip().endswith(_run(stack, control, "--version").strip()), out
