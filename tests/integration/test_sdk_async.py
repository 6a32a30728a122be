"""The asyncio client drives sandboxes concurrently from one event loop, and offers
what the sync client does: groups, sandboxes by id, trees in and out."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from app.config import Settings
from app.domain.base import FailReason, RejectReason
from app.errors import SandboxFailedError, SandboxRejectedError, TransferFailed, TransferReason
from app.sdk.aio import AsyncClient
from tests.conftest import logged, wait_for

pytestmark = pytest.mark.integration

T = TypeVar("T")


def scenario(stack: Settings, body: Callable[[AsyncClient], Awaitable[T]]) -> T:
    """Run ``body`` with an async client of the test tenant, on a loop of its own."""

    async def run() -> T:
        async with AsyncClient(stack, tenant="tests", job_id="async") as client:
            return await body(client)

    return asyncio.run(run())


def test_async_batch_exec_and_files(stack: Settings) -> None:
    async def body(client: AsyncClient) -> list[bytes]:
        boxes = await client.create_many(4)
        try:
            await asyncio.gather(
                *(b.write_file("/workspace/n", str(i).encode()) for i, b in enumerate(boxes))
            )
            results = await asyncio.gather(*(b.exec("cat /workspace/n") for b in boxes))
            return [r.stdout for r in results]
        finally:
            await asyncio.gather(*(b.close() for b in boxes))

    assert scenario(stack, body) == [b"0", b"1", b"2", b"3"]


def test_async_errors_are_typed(stack: Settings) -> None:
    async def body(client: AsyncClient) -> None:
        await client.create(image="dsec/missing:latest")

    with pytest.raises(SandboxFailedError) as failed:
        scenario(stack, body)
    assert failed.value.reason is FailReason.IMAGE_NOT_FOUND


def test_async_background_command_runs_beside_others_and_is_killed(stack: Settings) -> None:
    async def body(client: AsyncClient) -> tuple[bytes, bool, int, bytes]:
        async with await client.create() as box:
            server = box.start("echo up; exec sleep 300")
            beside = await box.exec("echo beside")

            async def started() -> None:
                while server.output()[0] != b"up\n":
                    await asyncio.sleep(0.05)

            await asyncio.wait_for(started(), 30)
            killed = await server.kill()
            result = await server.wait(30)
            return beside.stdout, killed and result.killed, result.exit_code, result.stdout

    assert scenario(stack, body) == (b"beside\n", True, -9, b"up\n")


def test_async_group_is_created_and_destroyed_as_one(stack: Settings, db: Any) -> None:
    async def body(client: AsyncClient) -> tuple[list[bytes], list[str], bool]:
        async with await client.create_group(3, labels={"step": "18"}) as group:
            runs = await asyncio.gather(*(box.exec("echo $((6*7))") for box in group))
            ids = [box.id for box in group]
        return [run.stdout for run in runs], ids, all(box.closed for box in group)

    outputs, ids, closed = scenario(stack, body)
    assert outputs == [b"42\n"] * 3 and closed
    ended = [wait_for(lambda s=s: logged(db, s, "reason", "SandboxStopped")) for s in ids]
    assert ended == [["destroyed"]] * 3


def test_async_group_without_room_starts_nothing(stack: Settings) -> None:
    # Given a group whose members together need more CPU than the nodes declare
    async def body(client: AsyncClient) -> None:
        await client.create_group(40, cpus=2, memory_mb=16, queue_s=0)

    # Then none is started, and the error says why with the log's reason
    with pytest.raises(SandboxRejectedError) as refused:
        scenario(stack, body)
    assert refused.value.reason in {RejectReason.CAPACITY, RejectReason.NO_NODES}


def test_async_sandbox_by_id_from_another_client(stack: Settings) -> None:
    async def body(client: AsyncClient) -> tuple[bytes, bytes, str]:
        # Given a sandbox one client created and wrote into
        box = await client.create()
        await box.write_file("/workspace/mark", b"made by the first")
        # When another client of the tenant attaches to it by id, uses it and destroys it
        async with AsyncClient(stack, tenant="tests", job_id="async-2") as other:
            attached = other.sandbox(box.id)
            read = await attached.read_file("/workspace/mark")
            ran = (await attached.exec("cat /workspace/mark")).stdout
            await other.destroy(box.id)
        # Then the first client's handle finds it ended
        with pytest.raises(SandboxRejectedError) as ended:
            await box.exec("true")
        return read, ran, ended.value.reason

    read, ran, reason = scenario(stack, body)
    assert read == ran == b"made by the first"
    assert reason == RejectReason.SANDBOX_NOT_RUNNING


def test_async_tree_goes_in_and_comes_back(stack: Settings, tmp_path: Path) -> None:
    # Given a tree with a file of several pieces each way and an executable script
    script = tmp_path / "proj" / "bin" / "run.sh"
    script.parent.mkdir(parents=True)
    script.write_text("#!/bin/sh\necho ran\n")
    script.chmod(0o755)
    blob = os.urandom(1_500_000)
    (tmp_path / "proj" / "blob.bin").write_bytes(blob)

    async def body(client: AsyncClient) -> tuple[str, bytes, Path]:
        async with await client.create() as box:
            landed = await box.upload(tmp_path / "proj", "/workspace/in")
            ran = (await box.exec(f"{landed}/bin/run.sh")).stdout
            return landed, ran, await box.download(landed, tmp_path / "out")

    # Then it lands where upload says, runs there, and comes back byte for byte
    landed, ran, back = scenario(stack, body)
    assert (landed, ran, back) == ("/workspace/in/proj", b"ran\n", tmp_path / "out" / "proj")
    assert (back / "blob.bin").read_bytes() == blob
    assert (back / "bin" / "run.sh").stat().st_mode & 0o777 == 0o755


def test_async_download_refuses_a_link_out(stack: Settings, tmp_path: Path) -> None:
    async def body(client: AsyncClient) -> None:
        async with await client.create() as box:
            await box.exec("mkdir -p /workspace/trap && ln -s /etc/shadow /workspace/trap/key")
            await box.download("/workspace/trap", tmp_path / "out")

    with pytest.raises(TransferFailed) as refused:
        scenario(stack, body)
    assert refused.value.reason is TransferReason.REFUSED
    assert list((tmp_path / "out").iterdir()) == []
