"""A node's Podman service dies: its running sandboxes keep answering (their agent
channel does not go through Podman), a destroy and a create sent at once are done (the
node revives the service for them), and a watch keeps a new service running.

The node and a scheduler run on topics of their own (tests/side_platform.py), so that
the stack's node, which other tests use, keeps its service.
"""

from __future__ import annotations

import os
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.config import Settings
from app.sdk import Client
from tests.conftest import wait_for
from tests.side_platform import first_sandbox, side_platform
from workers.host.mounts import remove_tree
from workers.host.podman_service import service_pids
from workers.host.user import find_node_user

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NODE = "node4"


@pytest.fixture
def side(stack: Settings) -> Iterator[Settings]:
    state = Path(tempfile.mkdtemp(prefix="dsec-podman-loss-"))
    os.chmod(state, 0o755)  # the node user walks through it to its home
    try:
        with side_platform(stack, NODE, state, env={"DSEC_WARM_POOL": "{}"}) as settings:
            yield settings
    finally:
        remove_tree(state)


def test_a_node_whose_podman_service_died_starts_another_and_serves(side: Settings) -> None:
    with Client(side, tenant="tests", job_id="podman-loss") as client:
        box = first_sandbox(client, NODE)
        doomed = client.create(timeout_s=60)
        user = find_node_user(NODE, side)
        assert user is not None
        before = service_pids(user)
        assert before

        # When the node's Podman service is killed
        for pid in before:
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not service_pids(user), 10, "the Podman service gone")

        # Then a destroy sent at once is done (the node revives Podman for it)
        doomed.close()
        # And the running sandbox still answers
        assert box.exec("echo alive").text == "alive\n"
        # And a create succeeds: the node started a new service by itself
        made = client.create(timeout_s=60)
        assert made.exec("echo new").text == "new\n"
        assert service_pids(user) and set(service_pids(user)).isdisjoint(before)
        for sandbox in (box, made):
            sandbox.close()
