"""What a trainer holds: a :class:`Sandbox`, a rollout :class:`Group`, a
:class:`Command` running in the background (and its :class:`ExecStream`). Each asks
its client for what it does, through :class:`Requester` (the part of
:class:`app.sdk.client.Client` a handle uses).
"""

from __future__ import annotations

import base64
import queue
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, Self

from app.domain.replies import (
    Done,
    ExecOutput,
    FileContent,
    Reply,
)
from app.domain.requests import (
    CreateGroup,
    DestroyGroup,
    Exec,
    ExposePort,
    KillCommand,
    ReadFile,
    RequestBase,
    SnapshotSandbox,
    WriteFile,
)
from app.errors import (
    TransferFailed,
    TransferReason,
)
from app.sdk import transfer

# What a command did, and the request that runs one, are importable from here too.
from app.sdk.results import Chunk as Chunk
from app.sdk.results import ExecResult as ExecResult
from app.sdk.results import OutputHandler as OutputHandler
from app.sdk.results import exec_request as exec_request
from app.sdk.steps import Answer, Steps, Work, blocking

#: A request the brokers cannot store within this long (fewer in-sync replicas than
#: the topic needs, no broker at all) fails its wait with ServiceUnavailable. Longer
#: than a broker's restart (~20 s for the embedded one, more on a loaded host), which
#: a trainer should sit out rather than hear as a failure.


class Requester(Protocol):
    """What a handle asks of its client (:class:`app.sdk.client.Client`)."""

    def request_fields(self, sandbox_id: str) -> dict[str, Any]:
        """The fields every request about ``sandbox_id`` carries (who, which job,
        where to reply, when)."""
        ...

    def send(
        self,
        request: RequestBase,
        on_output: OutputHandler | None = None,
        *,
        node: str | None = None,
    ) -> Future[Reply]: ...

    def answer(
        self,
        request: RequestBase,
        future: Future[Reply],
        timeout_s: float | None = None,
        *,
        request_id: uuid.UUID | None = None,
        keep: bool = False,
    ) -> Answer: ...

    def ask(
        self,
        request: RequestBase,
        timeout_s: float | None = None,
        on_output: OutputHandler | None = None,
        *,
        node: str | None = None,
    ) -> Answer: ...

    def ask_members(
        self, request: CreateGroup | DestroyGroup, members: list[str], timeout_s: float | None
    ) -> list[Answer]: ...

    def destroy_steps(self, sandbox_id: str, timeout_s: float | None = None) -> Steps[None]: ...


class Group:
    """A rollout group; closing it destroys every member."""

    def __init__(self, client: Requester, group_id: str, sandboxes: list[Sandbox]) -> None:
        self.client = client
        self.id = group_id
        self.sandboxes = sandboxes
        self.closed = False

    def close_steps(self, timeout_s: float | None = None) -> Steps[None]:
        """Destroy every member (idempotent)."""
        if self.closed:
            return
        self.closed = True
        request = DestroyGroup(**self.client.request_fields(self.id))
        answers = self.client.ask_members(request, [s.id for s in self.sandboxes], timeout_s)
        for answer in answers:  # noqa: UP028 (not `yield from`: a list's iterator takes no send())
            yield answer
        for sandbox in self.sandboxes:
            sandbox.closed = True

    close = blocking(close_steps)

    def __iter__(self) -> Iterator[Sandbox]:
        return iter(self.sandboxes)

    def __len__(self) -> int:
        return len(self.sandboxes)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# $1 the destination directory, $2 the staging directory of the pieces.
_UNPACK = 'mkdir -p "$1" && cat "$2"/* | tar -x -f - -C "$1"; rc=$?; rm -rf "$2"; exit $rc'
# $1 what to pack, $2 the archive; prints its size.
_PACK = 'cd "$(dirname "$1")" && tar -c -f "$2" "$(basename "$1")" && wc -c < "$2"'


class Command:
    """A command running in the background (:meth:`Sandbox.start`): read its output
    while it runs, wait for it, or kill it. Several may run in one sandbox at once.
    ``options`` are :meth:`Sandbox.exec`'s; its ``on_output`` gets each chunk too."""

    def __init__(
        self, sandbox: Sandbox, command: str | Iterable[str], timeout_s: float, options: Any
    ) -> None:
        options = dict(options)
        self._listener: OutputHandler | None = options.pop("on_output", None)
        self._request = exec_request(
            sandbox.client.request_fields(sandbox.id), command, timeout_s=timeout_s,
            stream_output=True, **options,
        )  # fmt: skip
        self._sandbox = sandbox
        self._client = sandbox.client
        #: When (``time.monotonic()``) its reply is no longer expected: its own timeout
        #: and a margin.
        self.deadline = time.monotonic() + timeout_s + 30
        self._lock = threading.Lock()
        self._out: dict[str, bytearray] = {"stdout": bytearray(), "stderr": bytearray()}
        self._future = sandbox.client.send(
            self._request, self._take, node=sandbox.route(self._request)
        )

    @property
    def id(self) -> uuid.UUID:
        """The command's id (its Exec request's), as the log records it."""
        return self._request.request_id

    def _take(self, chunk: Chunk) -> None:
        with self._lock:
            self._out[chunk.stream] += chunk.data
        if self._listener is not None:
            self._listener(chunk)

    def output(self) -> tuple[bytes, bytes]:
        """Stdout and stderr received so far (all of it once the command ended)."""
        with self._lock:
            return bytes(self._out["stdout"]), bytes(self._out["stderr"])

    @property
    def done(self) -> bool:
        """True once the command's result has arrived."""
        return self._future.done()

    @property
    def reply(self) -> Future[Reply]:
        """Completes with the command's final reply (what :meth:`wait` reads)."""
        return self._future

    def wait_steps(self, timeout_s: float | None = None) -> Steps[ExecResult]:
        """How the command ended (typed errors as :meth:`Sandbox.exec`); waits at most
        ``timeout_s``, or until its own timeout (plus a margin) has passed. A wait that
        ends before that raises :class:`RequestTimeout` (reason ``still_running``) and
        may be tried again."""
        remaining = max(0.1, self.deadline - time.monotonic())
        wait_s = remaining if timeout_s is None else min(timeout_s, remaining)
        reply = yield self._client.answer(
            self._request, self._future, wait_s, keep=wait_s < remaining
        )
        assert isinstance(reply, ExecOutput)
        return ExecResult.from_reply(reply)

    wait = blocking(wait_steps)

    def kill_steps(self, timeout_s: float | None = None) -> Steps[bool]:
        """Kill the command (SIGKILL to its process group); True if it was running. Its
        :meth:`wait` then returns with ``killed`` set and the output until then."""
        request = KillCommand(command_id=self.id, **self._client.request_fields(self._sandbox.id))
        reply = yield self._client.ask(request, timeout_s)
        assert isinstance(reply, Done)
        return reply.detail == "killed"

    kill = blocking(kill_steps)


class ExecStream(Command):
    """A running command's output chunks (iterate), then its :attr:`result`."""

    _END = object()

    def __init__(
        self, sandbox: Sandbox, command: str | Iterable[str], timeout_s: float, options: Any
    ) -> None:
        self._chunks: queue.SimpleQueue[object] = queue.SimpleQueue()
        super().__init__(sandbox, command, timeout_s, options)
        # The final reply comes after every chunk (one partition): it ends the stream.
        self._future.add_done_callback(lambda _f: self._chunks.put(self._END))

    def _take(self, chunk: Chunk) -> None:
        super()._take(chunk)
        self._chunks.put(chunk)

    def __iter__(self) -> Iterator[Chunk]:
        while True:
            try:
                item = self._chunks.get(timeout=max(0.0, self.deadline - time.monotonic()))
            except queue.Empty:
                return  # ``result`` raises the timeout
            if item is self._END:
                return
            assert isinstance(item, Chunk)
            yield item

    @property
    def result(self) -> ExecResult:
        """How the command ended (waits for it; typed errors as :meth:`Sandbox.exec`)."""
        return self.wait()


class Sandbox:
    """One sandbox; closing it destroys it."""

    def __init__(
        self, client: Requester, sandbox_id: str, node_id: str | None, direct: bool = False
    ) -> None:
        self.client = client
        self.id = sandbox_id
        self.node_id = node_id
        #: Its commands may go straight to its node (its ready reply said so).
        self.direct = direct
        self.closed = False

    def route(self, request: Exec) -> str | None:
        """The node a command goes straight to, or None: through the scheduler (a
        sandbox created elsewhere, or a trajectory step, which the log may answer)."""
        if not self.direct or request.trajectory_id is not None or request.step is not None:
            return None
        return self.node_id

    def exec_steps(
        self,
        command: str | Iterable[str],
        *,
        timeout_s: float = 60.0,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes = b"",
        max_output_bytes: int = 1 << 20,
        trajectory_id: str | None = None,
        step: int | None = None,
        on_output: OutputHandler | None = None,
    ) -> Steps[ExecResult]:
        """Run a command (a shell string or an argv list) and return its result.

        With ``on_output``, the command's output also arrives while it runs, as
        :class:`Chunk` s (called on the client's reply thread, in order).
        """
        request = exec_request(
            self.client.request_fields(self.id), command, timeout_s=timeout_s, stdin=stdin,
            stream_output=on_output is not None, env=env or {}, cwd=cwd,
            max_output_bytes=max_output_bytes, trajectory_id=trajectory_id, step=step,
        )  # fmt: skip
        reply = yield self.client.ask(request, timeout_s + 30, on_output, node=self.route(request))
        assert isinstance(reply, ExecOutput)
        return ExecResult.from_reply(reply)

    exec = blocking(exec_steps)

    def stream(
        self, command: str | Iterable[str], *, timeout_s: float = 60.0, **options: Any
    ) -> ExecStream:
        """Run a command and iterate over its output as it comes::

            run = sandbox.stream("pytest -x")
            for chunk in run:
                print(chunk.data.decode(), end="")
            print(run.result.exit_code)

        ``options`` are :meth:`exec`'s.
        """
        return ExecStream(self, command, timeout_s, options)

    def start(
        self, command: str | Iterable[str], *, timeout_s: float = 3600.0, **options: Any
    ) -> Command:
        """Start a command in the background and return at once::

            server = sandbox.start("python -m http.server 8000")
            sandbox.exec("sleep 1; wget -qO- localhost:8000")   # runs beside it
            print(server.output()[0])                           # its output so far
            server.kill()
            print(server.wait().killed)                         # True

        ``options`` are :meth:`exec`'s. Its output arrives while it runs.
        """
        return Command(self, command, timeout_s, options)

    def write_file_steps(self, path: str, data: bytes, mode: int = 0o644) -> Steps[None]:
        """Write ``data`` to ``path`` inside the sandbox."""
        request = WriteFile(
            path=path,
            data_b64=base64.b64encode(data).decode(),
            mode=mode,
            **self.client.request_fields(self.id),
        )
        yield self.client.ask(request)

    write_file = blocking(write_file_steps)

    def read_file_steps(self, path: str, max_bytes: int = 1 << 20) -> Steps[bytes]:
        """Read ``path`` from inside the sandbox (at most ``max_bytes``)."""
        request = ReadFile(path=path, max_bytes=max_bytes, **self.client.request_fields(self.id))
        reply = yield self.client.ask(request)
        assert isinstance(reply, FileContent)
        return base64.b64decode(reply.data_b64)

    read_file = blocking(read_file_steps)

    def upload_steps(self, src: str | Path, dest: str = "/workspace") -> Steps[str]:
        """Copy a local file or directory tree into directory ``dest`` of the sandbox
        (made if missing); binary-safe, modes kept. Returns the path it landed at."""
        local = Path(src)
        data: bytes = yield Work(lambda: transfer.pack(local))
        staging = f"/tmp/.dsec-upload-{uuid.uuid4().hex[:12]}"
        for i, piece in enumerate(transfer.pieces(data, transfer.UPLOAD_PIECE)):
            yield from self.write_file_steps(f"{staging}/{i:06d}", piece, mode=0o600)
        unpacked = yield from self.exec_steps(
            ["sh", "-c", _UNPACK, "sh", dest, staging], timeout_s=300, max_output_bytes=4096
        )
        if not unpacked.ok:
            raise TransferFailed(
                f"unpacking {local} into {self.id}:{dest} failed: {unpacked.stderr.decode()!r}",
                reason=TransferReason.IN_SANDBOX,
            )
        return f"{dest.rstrip('/')}/{local.resolve().name}"

    upload = blocking(upload_steps)

    def download_steps(self, src: str, dest: str | Path = ".") -> Steps[Path]:
        """Copy file or directory ``src`` out of the sandbox into local directory
        ``dest``; returns the local path. The sandbox's archive is checked before
        anything is written: ``..``, links leaving ``dest`` and device files refuse the
        whole transfer (:class:`app.errors.TransferFailed`)."""
        staging = f"/tmp/.dsec-download-{uuid.uuid4().hex[:12]}.tar"
        try:
            data = yield from self._read_archive(src, staging)
        except Exception:
            yield from self.exec_steps(["rm", "-f", staging])
            raise
        yield from self.exec_steps(["rm", "-f", staging])
        local = Path(dest)
        unpacked: list[Path] = yield Work(lambda: transfer.unpack(data, local))
        return unpacked[0]

    download = blocking(download_steps)

    def _read_archive(self, src: str, staging: str) -> Steps[bytes]:
        """Pack ``src`` into ``staging`` inside the sandbox and read it back."""
        packed = yield from self.exec_steps(["sh", "-c", _PACK, "sh", src, staging], timeout_s=300)
        size = int(packed.stdout) if packed.ok and packed.stdout.strip().isdigit() else -1
        if size < 0:
            raise TransferFailed(
                f"packing {self.id}:{src} failed: {packed.stderr.decode()[:300]!r}",
                reason=TransferReason.IN_SANDBOX,
            )
        if size > transfer.MAX_ARCHIVE:
            raise TransferFailed(
                f"{self.id}:{src} packs to {size} bytes, more than {transfer.MAX_ARCHIVE}",
                reason=TransferReason.TOO_LARGE,
            )
        step = transfer.DOWNLOAD_PIECE
        parts = []
        for i in range(-(-size // step)):
            part = yield from self.exec_steps(
                ["dd", f"if={staging}", f"bs={step}", f"skip={i}", "count=1"],
                max_output_bytes=step, timeout_s=120,
            )  # fmt: skip
            parts.append(part.stdout)
        data = b"".join(parts)
        if len(data) != size:
            raise TransferFailed(
                f"{self.id}:{src}: read {len(data)} of {size} bytes",
                reason=TransferReason.INCOMPLETE,
            )
        return data

    def snapshot_steps(
        self, name: str, tag: str = "latest", timeout_s: float = 300.0
    ) -> Steps[str]:
        """Keep this sandbox's files (its image with what its /workspace holds now) as
        an image of its tenant, and return its name: ``client.create(image=...)`` and
        ``client.create_group(n, image=...)`` start copies of it. The sandbox's
        processes are stopped while its files are read (docs/images.md)."""
        request = SnapshotSandbox(name=name, tag=tag, **self.client.request_fields(self.id))
        reply = yield self.client.ask(request, timeout_s)
        assert isinstance(reply, Done)
        return reply.detail

    snapshot = blocking(snapshot_steps)

    def expose_steps(self, port: int, ttl_s: int = 3600, timeout_s: float = 30.0) -> Steps[str]:
        """Open ``port`` (a server in the sandbox listening on it) to HTTP and WebSocket
        clients and return its URL: it carries a signed token and works until ``ttl_s``
        has passed or the sandbox ends; without the token nothing answers."""
        request = ExposePort(port=port, ttl_s=ttl_s, **self.client.request_fields(self.id))
        reply = yield self.client.ask(request, timeout_s)
        assert isinstance(reply, Done)
        return reply.detail

    expose = blocking(expose_steps)

    def pause_steps(self, name: str | None = None, timeout_s: float = 300.0) -> Steps[str]:
        """Give the sandbox's memory, CPUs and place back and keep its files: a snapshot
        (:meth:`snapshot`), then a destroy. Returns the image ``client.create(image=...)``
        resumes it from, with its /workspace as it was (not its processes: a freeze
        keeps those, and holds its memory)."""
        image = yield from self.snapshot_steps(name or f"paused-{self.id}", "paused", timeout_s)
        yield from self.close_steps()
        return image

    pause = blocking(pause_steps)

    def close_steps(self, timeout_s: float | None = None) -> Steps[None]:
        """Destroy the sandbox (idempotent)."""
        if self.closed:
            return
        self.closed = True
        yield from self.client.destroy_steps(self.id, timeout_s)

    close = blocking(close_steps)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
