"""The vertical slice through real parts: SDK -> Kafka -> scheduler -> Celery ->
rootless Podman -> Kafka -> projector -> Postgres, and back to the trainer."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from app.domain.requests import CreateSandbox
from app.errors import SandboxFailedError, SandboxNotFound
from tests.conftest import scalar, wait_for

pytestmark = pytest.mark.integration


def test_create_exec_destroy_lands_in_the_log(client: Any, db: Any) -> None:
    # Given a running sandbox
    sandbox = client.create()
    # When a command runs in it
    result = sandbox.exec("echo hi")
    # Then the trainer gets stdout and the exit code
    assert result.stdout == b"hi\n"
    assert result.exit_code == 0
    # And the projection shows it running on the node that answered
    with db() as conn:
        state = wait_for(
            lambda: scalar(
                conn,
                "SELECT state FROM sandboxes WHERE sandbox_id = :s AND state = 'running'",
                s=sandbox.id,
            ),
            what="running state in the projection",
        )
    assert state == "running"
    # When the sandbox is closed
    sandbox.close()

    # Then its life is in the log, in order, ending in Stopped(destroyed)
    def lifecycle() -> list[str] | None:
        with db() as conn:
            rows = (
                conn.exec_driver_sql(
                    "SELECT type FROM events WHERE sandbox_id = %(s)s ORDER BY position",
                    {"s": sandbox.id},
                )
                .scalars()
                .all()
            )
        return list(rows) if "SandboxStopped" in rows else None

    types = wait_for(lifecycle, what="SandboxStopped in the log")
    assert types[:2] == ["SandboxRequested", "SandboxScheduled"]
    assert "SandboxStarted" in types and "CommandCompleted" in types
    with db() as conn:
        assert (
            scalar(conn, "SELECT end_reason FROM sandboxes WHERE sandbox_id = :s", s=sandbox.id)
            == "destroyed"
        )
        assert (
            scalar(conn, "SELECT commands FROM sandboxes WHERE sandbox_id = :s", s=sandbox.id) == 1
        )


def test_stderr_and_exit_code_are_separate(client: Any) -> None:
    with client.create() as sandbox:
        result = sandbox.exec("echo out; echo err >&2; exit 3")
    assert (result.stdout, result.stderr, result.exit_code) == (b"out\n", b"err\n", 3)


def test_files_round_trip(client: Any) -> None:
    data = bytes(range(256)) * 10
    with client.create() as sandbox:
        sandbox.write_file("/workspace/blob.bin", data)
        assert sandbox.read_file("/workspace/blob.bin") == data
        assert sandbox.exec("wc -c < /workspace/blob.bin").stdout.strip() == b"2560"


def test_unknown_image_fails_with_reason_and_node_survives(client: Any, db: Any) -> None:
    with pytest.raises(SandboxFailedError) as info:
        client.create(image="dsec/no-such-image:latest")
    assert info.value.reason == "image_not_found"
    with db() as conn:
        wait_for(
            lambda: scalar(
                conn,
                "SELECT payload->>'reason' FROM events"
                " WHERE sandbox_id = :s AND type = 'SandboxFailed'",
                s=info.value.sandbox_id,
            ),
            what="SandboxFailed in the log",
        )
    # And the node still serves the next request
    with client.create() as sandbox:
        assert sandbox.exec("true").exit_code == 0


def test_exec_on_unknown_sandbox_is_rejected(client: Any) -> None:
    with pytest.raises(SandboxNotFound):
        client.sandbox("sb-doesnotexist00000000").exec("true")


def test_ttl_reaps_a_forgotten_sandbox(client: Any, db: Any) -> None:
    # Given a sandbox with a two-second time to live that nobody destroys
    sandbox = client.create(ttl_s=2)
    sandbox.exec("sleep 1000 > /dev/null 2>&1 &")
    # Then the node's reaper ends it with the reason ttl
    with db() as conn:
        reason = wait_for(
            lambda: scalar(
                conn,
                "SELECT end_reason FROM sandboxes WHERE sandbox_id = :s AND state = 'stopped'",
                s=sandbox.id,
            ),
            timeout_s=30,
            what="the TTL reaper",
        )
    assert reason == "ttl"
    # and it is billed its time to live, not a reaper round more
    with db() as conn:
        billed = scalar(
            conn,
            "SELECT extract(epoch FROM ended_at - started_at) FROM sandbox_lives"
            " WHERE sandbox_id = :s",
            s=sandbox.id,
        )
    assert 0 < billed <= 2


def test_the_longest_sandbox_id_the_protocol_allows_works(client: Any) -> None:
    # 63 characters: its agent socket's path would pass AF_UNIX's limit, named as is
    long_id = ("sb-long-" + uuid.uuid4().hex * 2)[:63]
    client.call(CreateSandbox(**client.request_fields(long_id)), timeout_s=60)
    box = client.sandbox(long_id)
    try:
        assert box.exec("echo hi").stdout == b"hi\n"
    finally:
        box.close()
