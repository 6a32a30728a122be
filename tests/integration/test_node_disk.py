"""A node whose disk is full refuses creates with the reason ``no_space``, and serves
again once there is room: a refusal, not a half-made sandbox or a broken node.

The node's home (its container layers, its sandboxes' run directories, its Podman
service's state) is a small filesystem of its own, filled by the test with a file.
So that its creates cannot land on the stack's node, the node and a scheduler run on
topics of their own (as the benchmarks do); the broker, Redis and Postgres are the
stack's.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from app.config import Settings
from app.errors import SandboxError
from app.sdk import Client
from tests.side_platform import first_sandbox, side_platform
from workers.host.mounts import remove_tree

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NODE = "node5"
HOME_MB = 128
#: What the node keeps free: well below the filesystem, so that only the filler
#: (not the node's own files) decides whether there is room; 0 leaves it to Podman's
#: own "no space left on device", which the node reports with the same reason.
MIN_FREE_MB = (24, 0)


@pytest.fixture(params=MIN_FREE_MB, ids=lambda mb: f"min_free_{mb}MB")
def small_node(stack: Settings, request: pytest.FixtureRequest) -> Iterator[tuple[Settings, Path]]:
    """Settings of a scheduler and a node on topics of their own, the node's home a
    filesystem of HOME_MB keeping ``request.param`` MiB free; yields them and the home."""
    state = Path(tempfile.mkdtemp(prefix="dsec-disk-"))
    os.chmod(state, 0o755)  # the node user walks through it to its home
    home = state / "nodes" / NODE
    home.mkdir(parents=True)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={HOME_MB}m,mode=0700", "tmpfs", str(home)],
        check=True, capture_output=True,
    )  # fmt: skip
    env = {
        "DSEC_NODE_MIN_FREE_MB": str(request.param),
        "DSEC_WARM_POOL": "{}",  # every create makes its container, and checks for room
    }
    try:
        with side_platform(stack, NODE, state, env=env) as settings:
            yield settings, home
    finally:
        remove_tree(state)  # its tmpfs and the node's view of the store unmounted first


def _create(client: Client) -> Any:
    """A sandbox, or the error that refused it."""
    try:
        return client.create(timeout_s=60)
    except SandboxError as exc:
        return exc


def test_a_node_with_a_full_disk_refuses_creates_then_serves_again(
    small_node: tuple[Settings, Path],
) -> None:
    settings, home = small_node
    with Client(settings, tenant="tests", job_id="node-disk") as client:
        # Given the node serving (once its heartbeat reached the scheduler)
        first = first_sandbox(client, NODE)
        assert first.node_id == NODE and first.exec("echo ok").text == "ok\n"

        # When its disk fills up (the sandbox already running keeps running)
        filler = home / "filler"
        subprocess.run(
            ["dd", "if=/dev/zero", f"of={filler}", "bs=1M", f"count={HOME_MB}"],
            capture_output=True,
        )  # fmt: skip
        assert os.statvfs(home).f_bavail * os.statvfs(home).f_frsize < max(MIN_FREE_MB) << 20

        # Then a create is refused with the reason no_space, and says where
        refused = _create(client)
        assert isinstance(refused, SandboxError), refused
        assert refused.reason == "no_space", refused
        assert str(home) in (refused.detail or "")

        # And once there is room again, the node serves as before
        filler.unlink()
        again = _create(client)
        assert not isinstance(again, SandboxError), again
        assert again.exec("echo ok").text == "ok\n"
        assert first.exec("echo still").text == "still\n"
        for box in (first, again):
            box.close()
