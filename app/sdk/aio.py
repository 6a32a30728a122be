"""The asyncio flavour of the SDK: the sync client, awaited.

    from app.sdk import AsyncClient

    async with AsyncClient(tenant="team-a", job_id="rollout-7") as client:
        boxes = await client.create_many(8)
        results = await asyncio.gather(*(b.exec("pytest -q") for b in boxes))
        await asyncio.gather(*(b.close() for b in boxes))

Each class here holds its sync twin (``.sync``: :class:`app.sdk.Client`, ``Sandbox``,
``Group``, ``Command``) and awaits that twin's operations, the ``*_steps`` generators
of :mod:`app.sdk.steps`. Requests, replies, typed errors and retries are the sync
client's own; only the waiting differs, and it happens on the event loop, so thousands
of sandboxes can be driven from one coroutine-based trainer. What needs no waiting is
read on ``.sync`` (``client.sync.tenant``, ``client.sync.lease_id``,
``client.sync.forged_replies``).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any, Self

from app.config import Settings
from app.domain.replies import Reply
from app.domain.requests import RequestBase
from app.sdk.client import Chunk, Client, ExecResult, OutputHandler
from app.sdk.handles import Command, Group, Sandbox
from app.sdk.steps import awaited, run_async


class AsyncClient:
    """An asyncio client for one tenant and job; ``options`` are :class:`Client`'s."""

    def __init__(self, settings: Settings | None = None, **options: Any) -> None:
        #: The sync client whose operations this one awaits.
        self.sync = Client(settings, **options)
        #: The tenant's images in the hub (blocking calls: run them in a thread).
        self.images = self.sync.images
        #: The tenant's egress secrets (blocking calls too).
        self.secrets = self.sync.secrets

    async def call(
        self,
        request: RequestBase,
        timeout_s: float | None = None,
        on_output: OutputHandler | None = None,
    ) -> Reply:
        """Send a request and await its reply (typed errors as in the sync client)."""
        return await self.sync.ask(request, timeout_s, on_output).wait()

    async def create(
        self, image: str | None = None, *, timeout_s: float | None = None, **options: Any
    ) -> AsyncSandbox:
        """A new running sandbox (see :meth:`Client.create`)."""
        return (await self.create_many(1, image, timeout_s=timeout_s, **options))[0]

    async def create_many(
        self, n: int, image: str | None = None, *, timeout_s: float | None = None, **options: Any
    ) -> list[AsyncSandbox]:
        """``n`` sandboxes at once; if any fails, the others are destroyed and it raises."""
        steps = self.sync.create_many_steps(n, image, timeout_s=timeout_s, **options)
        return [AsyncSandbox(self, box) for box in await run_async(steps)]

    async def create_group(
        self,
        n: int,
        image: str | None = None,
        *,
        group_id: str | None = None,
        timeout_s: float | None = None,
        **options: Any,
    ) -> AsyncGroup:
        """A rollout group of ``n`` sandboxes, all or none (see :meth:`Client.create_group`)."""
        steps = self.sync.create_group_steps(
            n, image, group_id=group_id, timeout_s=timeout_s, **options
        )
        return AsyncGroup(self, await run_async(steps))

    destroy = awaited(Client.destroy_steps)

    def sandbox(self, sandbox_id: str) -> AsyncSandbox:
        """A handle on an existing sandbox, by id."""
        return AsyncSandbox(self, self.sync.sandbox(sandbox_id))

    async def close(self) -> None:
        """Close the underlying client."""
        await asyncio.to_thread(self.sync.close)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncSandbox:
    """One sandbox, awaited; closing it destroys it. The methods are :class:`Sandbox`'s."""

    def __init__(self, client: AsyncClient, sandbox: Sandbox) -> None:
        self.client = client
        #: The sync sandbox whose operations this one awaits.
        self.sync = sandbox

    @property
    def id(self) -> str:
        """The sandbox's id."""
        return self.sync.id

    @property
    def node_id(self) -> str | None:
        """The node it runs on, if this client created it."""
        return self.sync.node_id

    @property
    def closed(self) -> bool:
        """True once this client destroyed it (itself or with its group)."""
        return self.sync.closed

    exec = awaited(Sandbox.exec_steps)
    write_file = awaited(Sandbox.write_file_steps)
    read_file = awaited(Sandbox.read_file_steps)
    upload = awaited(Sandbox.upload_steps)
    download = awaited(Sandbox.download_steps)
    snapshot = awaited(Sandbox.snapshot_steps)
    expose = awaited(Sandbox.expose_steps)
    pause = awaited(Sandbox.pause_steps)
    close = awaited(Sandbox.close_steps)

    def stream(
        self, command: str | Iterable[str], *, timeout_s: float = 60.0, **options: Any
    ) -> AsyncExecStream:
        """Run a command and iterate over its output as it comes::

        run = sandbox.stream("pytest -x")
        async for chunk in run:
            print(chunk.data.decode(), end="")
        print((await run.result()).exit_code)
        """
        return AsyncExecStream(self.sync, command, timeout_s, options)

    def start(
        self, command: str | Iterable[str], *, timeout_s: float = 3600.0, **options: Any
    ) -> AsyncCommand:
        """Start a command in the background; see :meth:`Sandbox.start`."""
        return AsyncCommand(self.sync.start(command, timeout_s=timeout_s, **options))

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncGroup:
    """A rollout group, awaited; closing it destroys every member."""

    def __init__(self, client: AsyncClient, group: Group) -> None:
        self.client = client
        #: The sync group whose operations this one awaits.
        self.sync = group
        self.sandboxes = [AsyncSandbox(client, box) for box in group.sandboxes]

    @property
    def id(self) -> str:
        """The group's id."""
        return self.sync.id

    @property
    def closed(self) -> bool:
        """True once this client destroyed it."""
        return self.sync.closed

    close = awaited(Group.close_steps)

    def __iter__(self) -> Iterator[AsyncSandbox]:
        return iter(self.sandboxes)

    def __len__(self) -> int:
        return len(self.sandboxes)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncCommand:
    """A command running in the background (:meth:`AsyncSandbox.start`), awaited."""

    def __init__(self, command: Command) -> None:
        #: The sync command whose waits this one awaits.
        self.sync = command

    @property
    def id(self) -> uuid.UUID:
        """The command's id (its Exec request's)."""
        return self.sync.id

    @property
    def done(self) -> bool:
        """True once the command's result has arrived."""
        return self.sync.done

    def output(self) -> tuple[bytes, bytes]:
        """Stdout and stderr received so far."""
        return self.sync.output()

    wait = awaited(Command.wait_steps)
    kill = awaited(Command.kill_steps)


class AsyncExecStream(AsyncCommand):
    """A running command's output chunks (``async for``), then ``await result()``."""

    def __init__(
        self, sandbox: Sandbox, command: str | Iterable[str], timeout_s: float, options: Any
    ) -> None:
        self._chunks: asyncio.Queue[Chunk | None] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def put(item: Chunk | None) -> None:  # called on the client's reply thread
            loop.call_soon_threadsafe(self._chunks.put_nowait, item)

        super().__init__(sandbox.start(command, timeout_s=timeout_s, on_output=put, **options))
        # The final reply comes after every chunk (one partition): None ends the stream.
        self.sync.reply.add_done_callback(lambda _f: put(None))

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        while True:
            remaining = max(0.0, self.sync.deadline - time.monotonic())
            try:
                chunk = await asyncio.wait_for(self._chunks.get(), remaining)
            except TimeoutError:
                return  # ``result`` raises the timeout
            if chunk is None:
                return
            yield chunk

    async def result(self) -> ExecResult:
        """How the command ended (typed errors as :meth:`AsyncSandbox.exec`)."""
        return await self.wait()
