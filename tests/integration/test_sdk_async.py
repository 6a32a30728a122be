"""The asyncio client drives sandboxes concurrently from one event loop."""

from __future__ import annotations

import asyncio

import pytest

from app.config import Settings
from app.errors import SandboxFailedError
from app.sdk.aio import AsyncClient

pytestmark = pytest.mark.integration


def test_async_batch_exec_and_files(stack: Settings) -> None:
    async def scenario() -> list[bytes]:
        async with AsyncClient(stack, tenant="tests", job_id="async") as client:
            boxes = await client.create_many(4)
            try:
                await asyncio.gather(
                    *(b.write_file("/workspace/n", str(i).encode()) for i, b in enumerate(boxes))
                )
                results = await asyncio.gather(*(b.exec("cat /workspace/n") for b in boxes))
                return [r.stdout for r in results]
            finally:
                await asyncio.gather(*(b.close() for b in boxes))

    assert asyncio.run(scenario()) == [b"0", b"1", b"2", b"3"]


def test_async_errors_are_typed(stack: Settings) -> None:
    async def scenario() -> None:
        async with AsyncClient(stack, tenant="tests", job_id="async") as client:
            await client.create(image="dsec/missing:latest")

    with pytest.raises(SandboxFailedError):
        asyncio.run(scenario())


def test_async_background_command_runs_beside_others_and_is_killed(stack: Settings) -> None:
    async def scenario() -> tuple[bytes, bool, int, bytes]:
        async with (
            AsyncClient(stack, tenant="tests", job_id="async") as client,
            await client.create() as box,
        ):
            server = box.start("echo up; exec sleep 300")
            beside = await box.exec("echo beside")

            async def started() -> None:
                while server.output()[0] != b"up\n":
                    await asyncio.sleep(0.05)

            await asyncio.wait_for(started(), 30)
            killed = await server.kill()
            result = await server.wait(30)
            return beside.stdout, killed and result.killed, result.exit_code, result.stdout

    assert asyncio.run(scenario()) == (b"beside\n", True, -9, b"up\n")
