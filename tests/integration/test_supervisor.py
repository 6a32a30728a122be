"""The embedded stack restarts a service that dies, and says so in `dsec status`."""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import pytest
from typer.testing import CliRunner

from app.cli.main import cli
from app.config import Settings
from app.stack import services as stack_mod
from app.stack.process import Service
from tests.conftest import wait_for

pytestmark = pytest.mark.integration


def _service(settings: Settings, name: str) -> Service:
    every = stack_mod.services(settings, stack_mod.known_node_ids(settings))
    return next(s for s in every if s.name == name)


def _status(name: str) -> dict[str, Any]:
    out = CliRunner().invoke(cli, ["status", "--json"])
    assert out.exit_code == 0, out.output
    return next(row for row in json.loads(out.output) if row["service"] == name)


@pytest.mark.parametrize("name", ["projector", "worker-node0", "redis", "scheduler"])
def test_a_killed_service_comes_back_by_itself(stack: Settings, client: Any, name: str) -> None:
    service = _service(stack, name)
    before = service.pid(stack)
    restarts = _status(name)["restarts"]
    assert before is not None
    # When it is killed, no word said and nobody typing `dsec up`
    os.killpg(before, signal.SIGKILL)
    # Then the supervisor starts it again, and `dsec status` counts it
    wait_for(
        lambda: (pid := service.pid(stack)) is not None and pid != before,
        timeout_s=30,
        what=f"{name} started again",
    )
    row = _status(name)
    assert row["state"] == "running" and row["restarts"] == restarts + 1
    # And the platform serves again: a sandbox's whole life goes through both
    with client.create(timeout_s=120) as box:
        assert box.exec("echo back").stdout == b"back\n"
