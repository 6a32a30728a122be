"""A node host comes up from settings alone: `dsec node up` with no development extra
(the embedded broker's package made unimportable) and no compiler needed (the agent
binary of a release), joins over Kafka and Redis, and `dsec node down` stops it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from app.config import Settings
from app.control import tenants
from app.domain.proof import Role
from tests.conftest import declare_lost, wait_for_node

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NODE = "node7"


def _dsec(*args: str) -> subprocess.CompletedProcess[str]:
    """`dsec ARGS` as a node host runs it: without the development extra."""
    code = (
        "import sys; sys.modules['hypothesis'] = sys.modules['pytest'] = None;"
        " from app.cli.main import main;"
        f" sys.argv = ['dsec', *{list(args)!r}]; main()"
    )
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
        env={**os.environ, "DSEC_NODE_ID": NODE},
    )  # fmt: skip


def test_a_node_host_comes_up_from_settings_alone(stack: Settings, db: Any, tmp_path: Path) -> None:
    # Given the node's credential from a control host and the release's agent binary
    tenants.ensure(stack, Role.NODE, NODE)
    agent = tmp_path / "dsec-agent"
    built = _dsec("node", "agent", "--out", str(agent))
    assert built.returncode == 0 and agent.is_file(), built.stdout + built.stderr
    try:
        # When the node host is brought up, without the development extra
        done = _dsec("node", "up", "--node", NODE, "--agent", str(agent))
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"worker-{NODE}: started" in done.stdout
        # Then it joins the platform: its heartbeats reach the log through Kafka
        wait_for_node(db, NODE, "alive", timeout_s=120)
        # And `dsec node down` stops its worker
        stopped = _dsec("node", "down", "--node", NODE)
        assert stopped.returncode == 0 and f"worker-{NODE}: stopped" in stopped.stdout
    finally:
        _dsec("node", "down", "--node", NODE)
        declare_lost(stack, [NODE])


def test_a_node_without_its_credential_is_told_what_to_do(stack: Settings) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", "node", "up", "--node", "nowhere9"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "DSEC_NODE_CREDENTIAL_FILE": "/nonexistent/node.json"},
    )  # fmt: skip
    assert done.returncode == 2
    assert "dsec node add nowhere9" in done.stdout and "Traceback" not in done.stderr
