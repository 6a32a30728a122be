"""Several commands in one sandbox at once, commands in the background, and kills.

A trainer starts a server in the background and talks to it from a second command;
reads a background command's output while it runs; kills it. Another tenant cannot
kill it, neither through the owner's sandbox nor by naming the command from its own.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import text

from app.config import Settings
from app.domain.requests import KillCommand
from app.errors import SandboxRejectedError
from app.sdk import Client, Sandbox
from tests.conftest import tenant_client, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def carol(stack: Settings) -> Iterator[Client]:
    with tenant_client(stack, "carol", "background") as c:
        yield c


@pytest.fixture(scope="module")
def dave(stack: Settings) -> Iterator[Client]:
    with tenant_client(stack, "dave", "background") as c:
        yield c


@pytest.fixture
def box(carol: Client) -> Iterator[Sandbox]:
    with carol.create(memory_mb=64, ttl_s=600) as sandbox:
        yield sandbox


def _completions(db: Any, command_id: uuid.UUID) -> list[dict[str, Any]]:
    with db() as conn:
        rows = conn.execute(
            text(
                "SELECT payload FROM events WHERE type = 'CommandCompleted'"
                " AND payload->>'request_id' = :r"
            ),
            {"r": str(command_id)},
        ).all()
    return [row.payload for row in rows]


def test_a_server_and_its_client_run_in_one_sandbox_at_once(box: Sandbox, db: Any) -> None:
    # The reader blocks until a second command writes: with one command at a time
    # in a sandbox this never ends (the writer would wait behind the reader).
    box.exec("mkfifo /tmp/pipe")
    reader = box.start("cat /tmp/pipe", timeout_s=60)
    writer = box.exec("echo through the pipe > /tmp/pipe", timeout_s=30)
    assert writer.ok
    result = reader.wait(timeout_s=30)
    assert result.ok and result.stdout == b"through the pipe\n"
    assert not result.killed
    both = [reader.id]
    wait_for(lambda: all(len(_completions(db, c)) == 1 for c in both), what="the log")


def test_background_output_is_read_while_it_runs_then_killed(box: Sandbox, db: Any) -> None:
    server = box.start("echo ready; echo warming >&2; exec sleep 300", timeout_s=600)
    wait_for(lambda: server.output()[0] == b"ready\n", what="the server's first output")
    assert not server.done
    assert box.exec("echo meanwhile").stdout == b"meanwhile\n"  # not queued behind it
    assert server.kill() is True
    result = server.wait(timeout_s=30)
    assert result.killed and result.exit_code == -9
    assert result.stdout == b"ready\n" and result.stderr == b"warming\n"
    assert server.kill() is False  # ended: nothing to kill
    logged = wait_for(lambda: _completions(db, server.id), what="the killed command's record")
    assert len(logged) == 1
    assert logged[0]["exit_code"] == -9 and logged[0]["killed_by"].startswith("carol")
    # The sandbox lives on; the kill took the command, not its sandbox.
    assert box.exec("echo alive").stdout == b"alive\n"


def test_many_commands_at_once_in_one_sandbox(box: Sandbox) -> None:
    # A barrier: each command checks in, then waits for all the others. Run one
    # after another, the first would wait for the rest forever (and time out).
    n = 12
    box.exec("mkdir /tmp/barrier")
    script = (
        "touch /tmp/barrier/$ID; "
        f"while [ $(ls /tmp/barrier | wc -l) -lt {n} ]; do sleep 0.05; done; echo $ID"
    )
    members = [box.start(script, env={"ID": str(i)}, timeout_s=60) for i in range(n)]
    results = [m.wait(timeout_s=90) for m in members]
    assert [r.stdout for r in results] == [f"{i}\n".encode() for i in range(n)]
    assert not any(r.timed_out for r in results)


def test_another_tenant_cannot_kill_a_command(box: Sandbox, dave: Client, db: Any) -> None:
    victim = box.start("sleep 3; echo finished", timeout_s=60)
    wait_for(lambda: b"sleep 3" in box.exec("ps -o args").stdout, what="the command to run")
    # Through the owner's sandbox: refused by the scheduler, as if it did not exist.
    with pytest.raises(SandboxRejectedError) as refused:
        dave.call(KillCommand(command_id=victim.id, **dave.request_fields(box.id)))
    assert refused.value.reason == "unknown_sandbox"
    # Naming the command from a sandbox of one's own: the node finds no such command.
    with dave.create(memory_mb=64, ttl_s=600) as own:
        reply = dave.call(KillCommand(command_id=victim.id, **dave.request_fields(own.id)))
        assert reply.detail == "not running"  # type: ignore[union-attr]
    result = victim.wait(timeout_s=30)
    assert result.ok and result.stdout == b"finished\n" and not result.killed
    [logged] = wait_for(lambda: _completions(db, victim.id), what="its record")
    assert logged["killed_by"] is None
