"""The trainer's SDK: sandboxes over Kafka only (no Postgres, no Celery).

    from app.sdk import Client

    with Client(tenant="team-a", job_id="rollout-7") as client:
        with client.create() as sandbox:
            print(sandbox.exec("echo hi").stdout)

Each request goes to the requests topic keyed by sandbox id; the answer comes back
on one partition of the replies topic that this client picked and reads alone.
"""

from __future__ import annotations

import base64
import queue
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self

from kafka import TopicPartition

from app import bus
from app.config import Settings, get_settings
from app.domain import proof
from app.domain.base import FailReason, RejectReason, new_sandbox_id
from app.domain.codec import DecodeError, decode_reply, encode
from app.domain.replies import (
    Done,
    ErrorReply,
    ExecOutput,
    FileContent,
    IncompletePieces,
    OutputChunk,
    Reply,
    ReplyPiece,
    SandboxReady,
    join_pieces,
)
from app.domain.requests import (
    CreateGroup,
    CreateSandbox,
    DestroyGroup,
    DestroySandbox,
    Exec,
    KillCommand,
    ReadFile,
    RenewLease,
    ReplyTo,
    RequestBase,
    WriteFile,
    member_request_id,
)
from app.errors import (
    ConfigError,
    ConfigReason,
    RequestTimeout,
    SandboxFailedError,
    SandboxNotFound,
    SandboxRejectedError,
    TimeoutReason,
    TransferFailed,
    TransferReason,
)
from app.sdk import credentials, transfer
from app.sdk.credentials import Credential

_REJECT_REASONS = {r.value: r for r in RejectReason}
_FAIL_REASONS = {r.value: r for r in FailReason}


@dataclass(frozen=True)
class ExecResult:
    """What a command did."""

    exit_code: int
    stdout: bytes
    stderr: bytes
    duration_ms: float
    timed_out: bool = False
    truncated: bool = False
    replayed: bool = False
    killed: bool = False

    @property
    def text(self) -> str:
        """Stdout decoded as UTF-8 (invalid bytes replaced)."""
        return self.stdout.decode(errors="replace")

    @property
    def ok(self) -> bool:
        """Exited 0 within its timeout."""
        return self.exit_code == 0 and not self.timed_out

    @classmethod
    def from_reply(cls, reply: ExecOutput) -> ExecResult:
        """The result a node's reply carries."""
        return cls(
            exit_code=reply.exit_code,
            stdout=base64.b64decode(reply.stdout_b64),
            stderr=base64.b64decode(reply.stderr_b64),
            duration_ms=reply.duration_ms,
            timed_out=reply.timed_out,
            truncated=reply.stdout_truncated or reply.stderr_truncated,
            replayed=reply.replayed,
            killed=reply.killed,
        )


@dataclass(frozen=True)
class Chunk:
    """A piece of a running command's output."""

    stream: Literal["stdout", "stderr"]
    data: bytes


OutputHandler = Callable[[Chunk], None]


def exec_request(
    common: dict[str, Any],
    command: str | Iterable[str],
    *,
    timeout_s: float,
    stdin: bytes = b"",
    stream_output: bool = False,
    **options: Any,
) -> Exec:
    """The Exec request for a command (a shell string or an argv list)."""
    return Exec(
        command=command if isinstance(command, str) else list(command),
        timeout_s=timeout_s,
        stdin_b64=base64.b64encode(stdin).decode(),
        stream_output=stream_output,
        **options,
        **common,
    )


def _raise_for(reply: ErrorReply) -> None:
    """Raise the typed error an error reply stands for, its reason as the log's enum
    (a reason this SDK does not know, from a newer platform, stays the string it came
    as, on a failure)."""
    rejected = _REJECT_REASONS.get(reply.reason)
    if rejected == RejectReason.UNKNOWN_SANDBOX:
        raise SandboxNotFound(reply.sandbox_id, rejected, reply.detail)
    if rejected is not None:
        raise SandboxRejectedError(reply.sandbox_id, rejected, reply.detail)
    reason = _FAIL_REASONS.get(reply.reason, reply.reason)
    raise SandboxFailedError(reply.sandbox_id, reason, reply.detail)


#: Destroys sent for one sandbox before its trainer hears RequestTimeout.
DESTROY_ATTEMPTS = 2


class Client:
    """A connection to the platform for one tenant and job. Thread-safe.

    Every request is signed with the tenant's credential, and a reply counts only if
    it carries the proof that the platform made it for that very request: a reply
    forged by another client of the bus is dropped (:attr:`forged_replies`).
    """

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        credential: Credential | None = None,
        tenant: str | None = None,
        job_id: str = "default",
        timeout_s: float = 120.0,
        lease: bool | str = False,
        lease_ttl_s: float = 30.0,
        lease_grace_s: float = 300.0,
    ) -> None:
        """Connect as ``credential`` (else the local credential of ``tenant``, else the
        one :func:`app.sdk.credentials.for_client` finds: ``DSEC_CREDENTIALS`` first).

        With ``lease``, every sandbox this client creates is tied to a lease it renews
        in the background (a string reattaches to an earlier lease by id): if this
        trainer dies, its sandboxes are frozen after ``lease_ttl_s`` and destroyed
        ``lease_grace_s`` later unless a client reattaches."""
        self.settings = settings or get_settings()
        self.credential = credential or credentials.for_client(self.settings, tenant)
        self.tenant, self.job_id = self.credential.subject, job_id
        self.timeout_s = timeout_s
        #: Replies dropped because their proof did not hold (forged or altered).
        self.forged_replies = 0
        self._publisher = bus.Publisher(self.settings)
        self._consumer = bus.make_consumer(self.settings, auto_offset_reset="latest")
        topic = self.settings.replies_topic(self.tenant)
        found = self._consumer.partitions_for_topic(topic)
        if not found:
            self._publisher.close()
            self._consumer.close()
            raise ConfigError(
                f"no replies topic {topic} for tenant {self.tenant}: is the tenant created "
                f"(`dsec tenant create {self.tenant}`) and the platform up?",
                reason=ConfigReason.NO_REPLIES_TOPIC,
            )
        self._partition = random.choice(sorted(found))
        tp = TopicPartition(topic, self._partition)
        self._consumer.assign([tp])
        self._consumer.seek_to_end(tp)
        self._consumer.position(tp)  # resolve now: replies to our first request must count
        self._replies = tp
        self._incarnation = bus.Incarnation(self._consumer, topic)
        self._reply_to = ReplyTo(topic=topic, partition=self._partition)
        self._waiting: dict[uuid.UUID, Future[Reply]] = {}
        # The key each awaited request's replies are proven with.
        self._reply_keys: dict[uuid.UUID, bytes] = {}
        self._output: dict[uuid.UUID, tuple[OutputHandler, list[int]]] = {}
        # The pieces of large replies not yet complete (see ReplyPiece).
        self._pieces: dict[uuid.UUID, list[ReplyPiece]] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._reader = threading.Thread(target=self._read_replies, name="dsec-replies", daemon=True)
        self._reader.start()
        self.lease_id: str | None = None
        if lease:
            self.lease_id = lease if isinstance(lease, str) else "lease-" + uuid.uuid4().hex[:20]
            self._lease_ttl_s, self._lease_grace_s = lease_ttl_s, lease_grace_s
            self._renew_lease()
            threading.Thread(target=self._keep_lease, name="dsec-lease", daemon=True).start()

    # --- plumbing ---------------------------------------------------------------

    def _read_replies(self) -> None:
        while not self._closed.is_set():
            if self._incarnation.changed():  # the broker came back empty: a new topic
                self._consumer.seek_to_beginning(self._replies)
            for records in self._consumer.poll(timeout_ms=100).values():
                for record in records:
                    value = record.value or b""
                    try:
                        reply = decode_reply(value, self.settings.max_reply_bytes)
                    except DecodeError:
                        continue  # not ours to judge: another client's garbage
                    if not self._proven(reply, value, record.headers):
                        continue
                    if isinstance(reply, OutputChunk):
                        self._pass_output(reply)
                        continue
                    if isinstance(reply, ReplyPiece):
                        with self._lock:
                            self._pieces.setdefault(reply.request_id, []).append(reply)
                        continue
                    with self._lock:
                        future = self._waiting.pop(reply.request_id, None)
                        self._output.pop(reply.request_id, None)
                        self._reply_keys.pop(reply.request_id, None)
                        pieces = self._pieces.pop(reply.request_id, [])
                    if future is not None:
                        self._complete(future, reply, pieces)

    @staticmethod
    def _complete(future: Future[Reply], reply: Reply, pieces: list[ReplyPiece]) -> None:
        """Hand ``reply`` over, with the data its pieces carried put back in."""
        if isinstance(reply, ExecOutput | FileContent) and reply.pieces:
            try:
                reply = join_pieces(reply, pieces)
            except IncompletePieces as exc:
                future.set_exception(TransferFailed(str(exc), reason=TransferReason.INCOMPLETE))
                return
        future.set_result(reply)

    def _proven(self, reply: Reply, value: bytes, headers: proof.Headers | None) -> bool:
        """The reply answers a request this client waits for, and the platform made it."""
        with self._lock:
            key = self._reply_keys.get(reply.request_id)
        if key is None:
            return False  # nobody here waits for it
        if proof.check_mac(
            key, proof.Purpose.REPLY, value, proof.header(headers, proof.HEADER_MAC)
        ):
            return True
        self.forged_replies += 1
        return False

    def _pass_output(self, chunk: OutputChunk) -> None:
        with self._lock:
            handler, expected = self._output.get(chunk.request_id, (None, [0]))
            # A producer retry can deliver a chunk twice; the partition keeps order.
            if handler is None or chunk.seq < expected[0]:
                return
            expected[0] = chunk.seq + 1
        try:
            handler(Chunk(chunk.stream, base64.b64decode(chunk.data_b64)))
        except Exception:  # the trainer's handler must not stop the reply reader
            with self._lock:
                self._output.pop(chunk.request_id, None)

    def _renew_lease(self) -> None:
        assert self.lease_id is not None
        renew = RenewLease(
            sandbox_id=self.lease_id, job_id=self.job_id,
            ttl_s=self._lease_ttl_s, grace_s=self._lease_grace_s,
        )  # fmt: skip
        self.publish(renew)

    def publish(self, request: RequestBase) -> None:
        """Sign ``request`` with this client's credential and send it (no waiting)."""
        value = encode(request)
        cred = self.credential
        signed = proof.headers(proof.Purpose.REQUEST, cred.key_id, cred.secret, value)
        self._publisher.publish(
            self.settings.topic_requests, request.sandbox_id, value, headers=signed
        )

    def _keep_lease(self) -> None:
        # Three renewals per lease period: one lost message does not lapse it.
        while not self._closed.wait(self._lease_ttl_s / 3):
            try:
                self._renew_lease()
            except Exception:  # the next round tries again; a lapse is recoverable
                continue

    def _shape(self) -> dict[str, Any]:
        return {"lease_id": self.lease_id} if self.lease_id else {}

    def _common(self, sandbox_id: str) -> dict[str, Any]:
        return {"sandbox_id": sandbox_id, "job_id": self.job_id, "reply_to": self._reply_to}

    def expect(self, request_id: uuid.UUID) -> Future[Reply]:
        """A future for the reply to ``request_id`` (register before sending)."""
        future: Future[Reply] = Future()
        key = proof.reply_key(self.credential.secret, request_id)
        with self._lock:
            self._waiting[request_id] = future
            self._reply_keys[request_id] = key
        return future

    def _forget(self, request_id: uuid.UUID) -> None:
        with self._lock:
            self._waiting.pop(request_id, None)
            self._output.pop(request_id, None)
            self._pieces.pop(request_id, None)
            self._reply_keys.pop(request_id, None)

    def send(self, request: RequestBase, on_output: OutputHandler | None = None) -> Future[Reply]:
        """Send a request; the future completes with its reply. ``on_output`` gets the
        output chunks of an Exec with ``stream_output``, in order, on the reply reader's
        thread (keep it quick)."""
        if on_output is not None:
            with self._lock:
                self._output[request.request_id] = (on_output, [0])
        future = self.expect(request.request_id)
        self.publish(request)
        return future

    def wait(self, request: RequestBase, future: Future[Reply], timeout_s: float | None) -> Reply:
        """The reply to ``request``, or a typed error."""
        try:
            reply = future.result(timeout=timeout_s or self.timeout_s)
        except FutureTimeout as exc:
            self._forget(request.request_id)
            raise RequestTimeout(
                f"{request.type} {request.sandbox_id}: no reply in {timeout_s or self.timeout_s}s"
            ) from exc
        if isinstance(reply, ErrorReply):
            _raise_for(reply)
        return reply

    def call(
        self,
        request: RequestBase,
        timeout_s: float | None = None,
        on_output: OutputHandler | None = None,
    ) -> Reply:
        """Send and wait."""
        return self.wait(request, self.send(request, on_output), timeout_s)

    # --- API --------------------------------------------------------------------

    def create(
        self, image: str | None = None, *, timeout_s: float | None = None, **options: Any
    ) -> Sandbox:
        """A new running sandbox (see :class:`CreateSandbox` for options)."""
        return self.create_many(1, image, timeout_s=timeout_s, **options)[0]

    def create_many(
        self, n: int, image: str | None = None, *, timeout_s: float | None = None, **options: Any
    ) -> list[Sandbox]:
        """``n`` sandboxes, requested at once. If any fails, the others are destroyed."""
        requests = [
            CreateSandbox(
                image=image or self.settings.default_image,
                **self._common(new_sandbox_id()),
                **{**self._shape(), **options},
            )
            for _ in range(n)
        ]
        futures = [self.send(r) for r in requests]
        ready: list[Sandbox] = []
        error: Exception | None = None
        for request, future in zip(requests, futures, strict=True):
            try:
                reply = self.wait(request, future, timeout_s)
                assert isinstance(reply, SandboxReady)
                ready.append(Sandbox(self, request.sandbox_id, reply.node_id))
            except Exception as exc:
                error = error or exc
        if error is not None:
            for sandbox in ready:
                sandbox.close()
            raise error
        return ready

    def create_group(
        self,
        n: int,
        image: str | None = None,
        *,
        group_id: str | None = None,
        timeout_s: float | None = None,
        **options: Any,
    ) -> Group:
        """A rollout group of ``n`` sandboxes, admitted all together or not at all.

        If there is no room for all of them (within ``queue_s``), none is started and
        :class:`SandboxRejectedError` says why. Destroying the group destroys them all.
        """
        gid = group_id or "grp-" + uuid.uuid4().hex[:20]
        members = [new_sandbox_id() for _ in range(n)]
        request = CreateGroup(
            image=image or self.settings.default_image,
            members=members,
            **self._common(gid),
            **{**self._shape(), **options},
        )
        futures = {m: self.expect(member_request_id(request.request_id, m)) for m in members}
        self.publish(request)
        ready: list[Sandbox] = []
        error: Exception | None = None
        for member, future in futures.items():
            try:
                reply = self._wait_id(
                    request, member_request_id(request.request_id, member), future, timeout_s
                )
                assert isinstance(reply, SandboxReady)
                ready.append(Sandbox(self, member, reply.node_id))
            except Exception as exc:
                error = error or exc
        group = Group(self, gid, ready)
        if error is not None:
            if ready:
                group.close()
            raise error
        return group

    def _wait_id(
        self,
        request: RequestBase,
        request_id: uuid.UUID,
        future: Future[Reply],
        timeout_s: float | None,
    ) -> Reply:
        try:
            reply = future.result(timeout=timeout_s or self.timeout_s)
        except FutureTimeout as exc:
            self._forget(request_id)
            raise RequestTimeout(f"{request.type} {request.sandbox_id}: no reply in time") from exc
        if isinstance(reply, ErrorReply):
            _raise_for(reply)
        return reply

    def destroy(self, sandbox_id: str, timeout_s: float | None = None) -> None:
        """Destroy the sandbox. A destroy that gets no answer (a broker that died took
        the request or its reply) is sent again, as a new request: destroying is
        idempotent, and a sandbox an earlier attempt already ended counts as done."""
        for attempt in range(DESTROY_ATTEMPTS):
            try:
                self.call(DestroySandbox(**self._common(sandbox_id)), timeout_s)
                return
            except RequestTimeout:
                if attempt == DESTROY_ATTEMPTS - 1:
                    raise
            except SandboxRejectedError as exc:
                gone = (RejectReason.UNKNOWN_SANDBOX, RejectReason.SANDBOX_NOT_RUNNING)
                if attempt == 0 or exc.reason not in gone:
                    raise
                return

    def sandbox(self, sandbox_id: str) -> Sandbox:
        """A handle on an existing sandbox."""
        return Sandbox(self, sandbox_id, node_id=None)

    def close(self) -> None:
        """Stop reading replies and flush what was sent."""
        self._closed.set()
        self._reader.join(timeout=2)
        self._publisher.close()
        self._consumer.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Group:
    """A rollout group; closing it destroys every member."""

    def __init__(self, client: Client, group_id: str, sandboxes: list[Sandbox]) -> None:
        self.client = client
        self.id = group_id
        self.sandboxes = sandboxes
        self.closed = False

    def close(self, timeout_s: float | None = None) -> None:
        """Destroy every member (idempotent)."""
        if self.closed:
            return
        self.closed = True
        request = DestroyGroup(**self.client._common(self.id))
        members = [s.id for s in self.sandboxes]
        futures = {m: self.client.expect(member_request_id(request.request_id, m)) for m in members}
        self.client.publish(request)
        for member, future in futures.items():
            rid = member_request_id(request.request_id, member)
            self.client._wait_id(request, rid, future, timeout_s)
        for sandbox in self.sandboxes:
            sandbox.closed = True

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
    while it runs, wait for it, or kill it. Several may run in one sandbox at once."""

    def __init__(
        self, sandbox: Sandbox, command: str | Iterable[str], timeout_s: float, options: Any
    ) -> None:
        self._request = exec_request(
            sandbox.client._common(sandbox.id), command, timeout_s=timeout_s,
            stream_output=True, **options,
        )  # fmt: skip
        self._sandbox = sandbox
        self._client = sandbox.client
        self._deadline = time.monotonic() + timeout_s + 30
        self._lock = threading.Lock()
        self._out: dict[str, bytearray] = {"stdout": bytearray(), "stderr": bytearray()}
        self._future = sandbox.client.send(self._request, self._take)

    @property
    def id(self) -> uuid.UUID:
        """The command's id (its Exec request's), as the log records it."""
        return self._request.request_id

    def _take(self, chunk: Chunk) -> None:
        with self._lock:
            self._out[chunk.stream] += chunk.data

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

    def wait(self, timeout_s: float | None = None) -> ExecResult:
        """How the command ended (typed errors as :meth:`Sandbox.exec`); waits at most
        ``timeout_s``, or until its own timeout (plus a margin) has passed."""
        remaining = max(0.1, self._deadline - time.monotonic())
        wait_s = remaining if timeout_s is None else min(timeout_s, remaining)
        try:
            reply = self._future.result(timeout=wait_s)
        except FutureTimeout as exc:
            if time.monotonic() < self._deadline:  # it may still end: keep listening
                raise RequestTimeout(
                    f"command {self.id} still running after {wait_s}s",
                    reason=TimeoutReason.STILL_RUNNING,
                ) from exc
        reply = self._client.wait(self._request, self._future, 0.1)
        assert isinstance(reply, ExecOutput)
        return ExecResult.from_reply(reply)

    def kill(self, timeout_s: float | None = None) -> bool:
        """Kill the command (SIGKILL to its process group); True if it was running. Its
        :meth:`wait` then returns with ``killed`` set and the output until then."""
        request = KillCommand(command_id=self.id, **self._client._common(self._sandbox.id))
        reply = self._client.call(request, timeout_s)
        assert isinstance(reply, Done)
        return reply.detail == "killed"


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
                item = self._chunks.get(timeout=max(0.0, self._deadline - time.monotonic()))
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

    def __init__(self, client: Client, sandbox_id: str, node_id: str | None) -> None:
        self.client = client
        self.id = sandbox_id
        self.node_id = node_id
        self.closed = False

    def exec(
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
    ) -> ExecResult:
        """Run a command (a shell string or an argv list) and return its result.

        With ``on_output``, the command's output also arrives while it runs, as
        :class:`Chunk` s (called on the client's reply thread, in order).
        """
        request = exec_request(
            self.client._common(self.id), command, timeout_s=timeout_s, stdin=stdin,
            stream_output=on_output is not None, env=env or {}, cwd=cwd,
            max_output_bytes=max_output_bytes, trajectory_id=trajectory_id, step=step,
        )  # fmt: skip
        reply = self.client.call(request, timeout_s + 30, on_output)
        assert isinstance(reply, ExecOutput)
        return ExecResult.from_reply(reply)

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

    def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """Write ``data`` to ``path`` inside the sandbox."""
        request = WriteFile(
            path=path,
            data_b64=base64.b64encode(data).decode(),
            mode=mode,
            **self.client._common(self.id),
        )
        self.client.call(request)

    def read_file(self, path: str, max_bytes: int = 1 << 20) -> bytes:
        """Read ``path`` from inside the sandbox (at most ``max_bytes``)."""
        request = ReadFile(path=path, max_bytes=max_bytes, **self.client._common(self.id))
        reply = self.client.call(request)
        assert isinstance(reply, FileContent)
        return base64.b64decode(reply.data_b64)

    def upload(self, src: str | Path, dest: str = "/workspace") -> str:
        """Copy a local file or directory tree into directory ``dest`` of the sandbox
        (made if missing); binary-safe, modes kept. Returns the path it landed at."""
        local = Path(src)
        data = transfer.pack(local)
        staging = f"/tmp/.dsec-upload-{uuid.uuid4().hex[:12]}"
        for i, piece in enumerate(transfer.pieces(data, transfer.UPLOAD_PIECE)):
            self.write_file(f"{staging}/{i:06d}", piece, mode=0o600)
        unpacked = self.exec(
            ["sh", "-c", _UNPACK, "sh", dest, staging], timeout_s=300, max_output_bytes=4096
        )
        if not unpacked.ok:
            raise TransferFailed(
                f"unpacking {local} into {self.id}:{dest} failed: {unpacked.stderr.decode()!r}",
                reason=TransferReason.IN_SANDBOX,
            )
        return f"{dest.rstrip('/')}/{local.resolve().name}"

    def download(self, src: str, dest: str | Path = ".") -> Path:
        """Copy file or directory ``src`` out of the sandbox into local directory
        ``dest``; returns the local path. The sandbox's archive is checked before
        anything is written: ``..``, links leaving ``dest`` and device files refuse the
        whole transfer (:class:`app.errors.TransferFailed`)."""
        staging = f"/tmp/.dsec-download-{uuid.uuid4().hex[:12]}.tar"
        packed = self.exec(["sh", "-c", _PACK, "sh", src, staging], timeout_s=300)
        try:
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
            parts = [
                self.exec(
                    ["dd", f"if={staging}", f"bs={step}", f"skip={i}", "count=1"],
                    max_output_bytes=step, timeout_s=120,
                ).stdout
                for i in range(-(-size // step))
            ]  # fmt: skip
        finally:
            self.exec(["rm", "-f", staging])
        data = b"".join(parts)
        if len(data) != size:
            raise TransferFailed(
                f"{self.id}:{src}: read {len(data)} of {size} bytes",
                reason=TransferReason.INCOMPLETE,
            )
        return transfer.unpack(data, Path(dest))[0]

    def close(self) -> None:
        """Destroy the sandbox (idempotent)."""
        if self.closed:
            return
        self.closed = True
        self.client.destroy(self.id)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
