"""The ``dsec`` CLI as a person drives it: create, exec, ps, events, destroy, top, bench.

Everything runs against the real stack; each test works in its own tenant.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner, Result

from app.cli.main import cli
from app.config import Settings
from tests.conftest import forget_tenant, free_port, scalar, wait_for

pytestmark = pytest.mark.integration

runner = CliRunner()


def dsec(*args: str) -> Result:
    return runner.invoke(cli, list(args))


def _json(result: Result) -> Any:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _types(result: Result) -> set[str]:
    """Event types in a JSON listing of events (``dsec events``, ``dsec audit``)."""
    return {row["type"] for row in _json(result)}


def test_a_sandbox_from_create_to_destroy(
    stack: Settings, db: Callable[[], Any], tmp_path: Path
) -> None:
    tenant = f"cli-{uuid.uuid4().hex[:8]}"
    # Given a tenant an operator made, and a sandbox it created from the shell
    made = _json(dsec("tenant", "create", tenant, "--json"))
    assert made["role"] == "tenant" and Path(made["credential_file"]).stat().st_mode & 0o077 == 0
    created = dsec("create", "--tenant", tenant, "--job", "shell", "--memory-mb", "128")
    assert created.exit_code == 0, created.output
    sandbox_id = created.stdout.strip()
    assert sandbox_id.startswith("sb-")
    try:
        # When a command runs in it, with no --tenant (as the local operator)
        ran = dsec("exec", sandbox_id, "--", "sh", "-c", "echo out; echo err >&2; exit 3")
        # Then its output comes back raw, on the right streams, and its exit code is ours
        assert ran.exit_code == 3, ran.output
        assert ran.stdout == "out\n"
        assert ran.stderr == "err\n"
        # And one argument is a shell string; --json prints the result object
        result = _json(dsec("exec", "--json", sandbox_id, "echo $((6 * 7))"))
        assert (result["exit_code"], result["stdout"], result["timed_out"]) == (0, "42\n", False)
        # And a command that outlives its timeout ends the CLI with 124, like timeout(1)
        assert dsec("exec", "--timeout", "0.5", sandbox_id, "--", "sleep", "5").exit_code == 124

        # And a directory goes in and comes back with `dsec cp`
        local = tmp_path / "d"
        local.mkdir()
        (local / "f").write_bytes(b"\x00\xffdata")
        put = dsec("cp", str(local), f"{sandbox_id}:/workspace")
        assert (put.exit_code, put.stdout.strip()) == (0, "/workspace/d"), put.output
        got = dsec("cp", f"{sandbox_id}:/workspace/d/f", str(tmp_path / "back"))
        assert got.exit_code == 0, got.output
        assert (tmp_path / "back" / "f").read_bytes() == b"\x00\xffdata"
        assert dsec("cp", str(local), str(tmp_path / "x")).exit_code == 125
        moved = _json(dsec("cp", "--json", str(local), f"{sandbox_id}:/tmp"))
        assert (moved["sandbox_id"], moved["to"]) == (sandbox_id, "/tmp/d")

        # Then `dsec ps` shows it running, for the tenant it was created for
        rows = _json(dsec("ps", "--json", "--tenant", tenant))
        assert [(r["sandbox_id"], r["job_id"], r["state"]) for r in rows] == [
            (sandbox_id, "shell", "running")
        ]
        # And `dsec events` lists its start
        wait_for(
            lambda: "SandboxStarted" in _types(dsec("events", sandbox_id, "--json")),
            what="SandboxStarted in `dsec events`",
        )
        # And the commands were billed to the sandbox's tenant, found through `dsec ps`
        with db() as conn:
            billed = scalar(
                conn,
                "SELECT array_agg(DISTINCT tenant) FROM events"
                " WHERE sandbox_id = :sb AND type = 'CommandCompleted'",
                sb=sandbox_id,
            )
        assert billed == [tenant]
        # And the log says the operator ran them, not the tenant
        with db() as conn:
            actors = scalar(
                conn,
                "SELECT array_agg(DISTINCT payload->>'actor') FROM events"
                " WHERE sandbox_id = :sb AND type = 'CommandCompleted'",
                sb=sandbox_id,
            )
        assert len(actors) == 1 and actors[0].startswith("operator:")
    finally:
        destroyed = dsec("destroy", sandbox_id)
        forget_tenant(stack, tenant)
    assert destroyed.exit_code == 0, destroyed.output
    # Then it has ended, and the audit trail (--json, the same as --format json) says so
    wait_for(
        lambda: "SandboxStopped" in _types(dsec("audit", "--sandbox", sandbox_id, "--json")),
        what="SandboxStopped in `dsec audit --json`",
    )
    assert _json(dsec("ps", "--json", "--tenant", tenant)) == []


def test_exec_in_an_unknown_sandbox_fails_with_125(stack: Settings) -> None:
    # When a command is sent to a sandbox that never existed
    result = dsec("exec", "sb-never-was-here", "--", "true")
    # Then the CLI says why on stderr and ends with 125, never a command's code
    assert result.exit_code == 125
    assert "unknown_sandbox" in result.stderr


def test_top_lists_the_node(stack: Settings) -> None:
    frame = _json(dsec("top", "--once", "--json"))
    node = next(n for n in frame["nodes"] if n["node_id"] == stack.node_id)
    assert node["state"] == "alive"
    assert node["capacity_sandboxes"] > 0
    assert node["images"] >= 1
    assert node["heartbeat_age_s"] is not None
    # And the terminal frame renders too
    shown = dsec("top", "--once")
    assert shown.exit_code == 0, shown.output
    assert stack.node_id in shown.stdout


def test_bench_without_a_name_lists_the_benchmarks(stack: Settings) -> None:
    listed = {row["name"] for row in _json(dsec("bench", "--json"))}
    assert {"exec", "schedule", "e2e"} <= listed
    shown = dsec("bench")
    assert shown.exit_code == 0, shown.output
    assert "schedule" in shown.stdout


def test_an_expected_failure_is_one_line_not_a_traceback() -> None:
    # Given a database that is not there (nothing listens on the port)
    port = free_port()
    env = {**os.environ, "DSEC_DATABASE_URL": f"postgresql+psycopg://dsec_app@127.0.0.1:{port}/x"}
    dsec_bin = str(Path(sys.executable).with_name("dsec"))
    # When an operator asks for the bill
    done = subprocess.run([dsec_bin, "bill"], env=env, capture_output=True, text=True)
    # Then it says what is wrong in one line, with a status that scripts can test
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and "╭" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("dsec: ServiceUnavailable: Postgres") and str(port) in line
    # And the version is one line too
    version = subprocess.run([dsec_bin, "--version"], capture_output=True, text=True)
    assert version.returncode == 0 and version.stdout.startswith("dsec 0.")
