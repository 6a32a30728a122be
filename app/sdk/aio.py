"""The asyncio flavour of the SDK: the same client, awaited.

    from app.sdk import AsyncClient

    async with AsyncClient(tenant="team-a", job_id="rollout-7") as client:
        boxes = await client.create_many(8)
        results = await asyncio.gather(*(b.exec("pytest -q") for b in boxes))
        await asyncio.gather(*(b.close() for b in boxes))

Requests are sent and answered exactly as with :class:`app.sdk.Client` (one Kafka
producer and one replies partition per client); waiting happens on the event loop,
so thousands of sandboxes can be driven from one coroutine-based trainer.
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, Self

from app.config import Settings
from app.domain.base import new_sandbox_id
from app.domain.replies import Done, ErrorReply, ExecOutput, FileContent, Reply, SandboxReady
from app.domain.requests import (
    CreateSandbox,
    DestroySandbox,
    KillCommand,
    ReadFile,
    RequestBase,
    WriteFile,
)
from app.errors import RequestTimeout, TimeoutReason
from app.sdk.client import Chunk, Client, Command, ExecResult, Sandbox, _raise_for, exec_request


class AsyncClient:
    """An asyncio client for one tenant and job."""

    def __init__(self, settings: Settings | None = None, **options: Any) -> None:
        self._client = Client(settings, **options)

    async def call(
        self,
        request: RequestBase,
        timeout_s: float | None = None,
        on_output: Callable[[Chunk], None] | None = None,
    ) -> Reply:
        """Send a request and await its reply (typed errors as in the sync client)."""
        future = self._client.send(request, on_output)
        limit = timeout_s or self._client.timeout_s
        try:
            reply = await asyncio.wait_for(asyncio.wrap_future(future), limit)
        except TimeoutError as exc:
            raise RequestTimeout(
                f"{request.type} {request.sandbox_id}: no reply in {limit}s"
            ) from exc
        if isinstance(reply, ErrorReply):
            _raise_for(reply)
        return reply

    async def create(self, image: str | None = None, **options: Any) -> AsyncSandbox:
        """A new running sandbox."""
        return (await self.create_many(1, image, **options))[0]

    async def create_many(
        self, n: int, image: str | None = None, **options: Any
    ) -> list[AsyncSandbox]:
        """``n`` sandboxes at once; if any fails, the others are destroyed and it raises."""
        timeout_s = options.pop("timeout_s", None)
        requests = [
            CreateSandbox(
                image=image or self._client.settings.default_image,
                **self._client._common(new_sandbox_id()),
                **{**self._client._shape(), **options},
            )
            for _ in range(n)
        ]
        replies = await asyncio.gather(
            *(self.call(r, timeout_s) for r in requests), return_exceptions=True
        )
        boxes = [
            AsyncSandbox(self, r.sandbox_id)
            for r, reply in zip(requests, replies, strict=True)
            if isinstance(reply, SandboxReady)
        ]
        errors = [reply for reply in replies if isinstance(reply, BaseException)]
        if errors:
            await asyncio.gather(*(b.close() for b in boxes), return_exceptions=True)
            raise errors[0]
        return boxes

    async def close(self) -> None:
        """Close the underlying client."""
        await asyncio.to_thread(self._client.close)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncSandbox:
    """One sandbox, awaited; closing it destroys it."""

    def __init__(self, client: AsyncClient, sandbox_id: str) -> None:
        self.client = client
        self.id = sandbox_id
        self.closed = False

    def _common(self) -> dict[str, Any]:
        return self.client._client._common(self.id)

    async def exec(
        self, command: str | Iterable[str], *, timeout_s: float = 60.0, **options: Any
    ) -> ExecResult:
        """Run a command; see :meth:`app.sdk.Sandbox.exec` for the options."""
        request = exec_request(self._common(), command, timeout_s=timeout_s, **options)
        reply = await self.client.call(request, timeout_s + 30)
        assert isinstance(reply, ExecOutput)
        return ExecResult.from_reply(reply)

    def stream(
        self, command: str | Iterable[str], *, timeout_s: float = 60.0, **options: Any
    ) -> AsyncExecStream:
        """Run a command and iterate over its output as it comes::

        run = sandbox.stream("pytest -x")
        async for chunk in run:
            print(chunk.data.decode(), end="")
        print((await run.result()).exit_code)
        """
        return AsyncExecStream(self, command, timeout_s, options)

    def start(
        self, command: str | Iterable[str], *, timeout_s: float = 3600.0, **options: Any
    ) -> AsyncCommand:
        """Start a command in the background; see :meth:`app.sdk.Sandbox.start`."""
        sync = Sandbox(self.client._client, self.id, None)
        return AsyncCommand(sync.start(command, timeout_s=timeout_s, **options), self)

    async def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """Write ``data`` to ``path`` inside the sandbox."""
        await self.client.call(
            WriteFile(
                path=path, data_b64=base64.b64encode(data).decode(), mode=mode, **self._common()
            )
        )

    async def read_file(self, path: str, max_bytes: int = 1 << 20) -> bytes:
        """Read ``path`` from inside the sandbox."""
        reply = await self.client.call(ReadFile(path=path, max_bytes=max_bytes, **self._common()))
        assert isinstance(reply, FileContent)
        return base64.b64decode(reply.data_b64)

    async def close(self) -> None:
        """Destroy the sandbox (idempotent)."""
        if not self.closed:
            self.closed = True
            await self.client.call(DestroySandbox(**self._common()))

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncCommand:
    """A command running in the background (:meth:`AsyncSandbox.start`): the sync
    :class:`app.sdk.Command`, its waits awaited."""

    def __init__(self, command: Command, sandbox: AsyncSandbox) -> None:
        self._command = command
        self._sandbox = sandbox

    @property
    def id(self) -> uuid.UUID:
        """The command's id (its Exec request's)."""
        return self._command.id

    @property
    def done(self) -> bool:
        """True once the command's result has arrived."""
        return self._command.done

    def output(self) -> tuple[bytes, bytes]:
        """Stdout and stderr received so far."""
        return self._command.output()

    async def wait(self, timeout_s: float | None = None) -> ExecResult:
        """How the command ended; raises :class:`RequestTimeout` after ``timeout_s``."""
        try:
            await asyncio.wait_for(
                asyncio.shield(asyncio.wrap_future(self._command.reply)), timeout_s
            )
        except TimeoutError as exc:
            raise RequestTimeout(
                f"command {self.id} still running after {timeout_s}s",
                reason=TimeoutReason.STILL_RUNNING,
            ) from exc
        return self._command.wait(0)

    async def kill(self, timeout_s: float | None = None) -> bool:
        """Kill the command; True if it was running (see :meth:`app.sdk.Command.kill`)."""
        request = KillCommand(command_id=self.id, **self._sandbox._common())
        reply = await self._sandbox.client.call(request, timeout_s)
        assert isinstance(reply, Done)
        return reply.detail == "killed"


class AsyncExecStream:
    """A running command's output chunks (``async for``), then ``await result()``."""

    def __init__(
        self, sandbox: AsyncSandbox, command: str | Iterable[str], timeout_s: float, options: Any
    ) -> None:
        self._client = sandbox.client
        self._chunks: asyncio.Queue[Chunk | None] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def put(item: Chunk | None) -> None:  # called on the client's reply thread
            loop.call_soon_threadsafe(self._chunks.put_nowait, item)

        request = exec_request(
            sandbox._common(), command, timeout_s=timeout_s, stream_output=True, **options
        )
        # The final reply comes after every chunk (one partition): None ends the stream.
        self._reply = asyncio.ensure_future(self._client.call(request, timeout_s + 30, put))
        self._reply.add_done_callback(lambda _t: self._chunks.put_nowait(None))

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        while (chunk := await self._chunks.get()) is not None:
            yield chunk

    async def result(self) -> ExecResult:
        """How the command ended (typed errors as :meth:`AsyncSandbox.exec`)."""
        reply = await self._reply
        assert isinstance(reply, ExecOutput)
        return ExecResult.from_reply(reply)
