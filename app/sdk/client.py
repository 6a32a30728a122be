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
import contextlib
import queue
import random
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, InvalidStateError
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from kafka import TopicPartition
from kafka.errors import KafkaError

from app import bus
from app.config import Settings, get_settings
from app.domain import proof
from app.domain.base import RejectReason, new_id, new_sandbox_id, utcnow
from app.domain.codec import encode
from app.domain.replies import (
    Done,
    ExecOutput,
    FileContent,
    Reply,
    SandboxReady,
)
from app.domain.requests import (
    CreateGroup,
    CreateSandbox,
    DestroyGroup,
    DestroySandbox,
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
    DsecError,
    RequestTimeout,
    SandboxRejectedError,
    ServiceUnavailable,
    TransferFailed,
    TransferReason,
)
from app.sdk import credentials, transfer
from app.sdk.credentials import Credential
from app.sdk.reader import ReplyReader

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
DELIVERY_TIMEOUT_S = 45.0
#: Requests awaiting storage tracked before those past their delivery are dropped.
STORING_KEPT = 10_000
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
        delivery_timeout_s: float = DELIVERY_TIMEOUT_S,
    ) -> None:
        """Connect as ``credential`` (else the local credential of ``tenant``, else the
        one :func:`app.sdk.credentials.for_client` finds: ``DSEC_CREDENTIALS`` first).

        With ``lease``, every sandbox this client creates is tied to a lease it renews
        in the background (a string reattaches to an earlier lease by id): if this
        trainer dies, its sandboxes are frozen after ``lease_ttl_s`` and destroyed
        ``lease_grace_s`` later unless a client reattaches.

        A request the brokers have not stored within ``delivery_timeout_s`` fails with
        ServiceUnavailable (a trainer that would rather fail fast than sit out a
        broker's restart lowers it)."""
        self.settings = settings or get_settings()
        self.credential = credential or credentials.for_client(self.settings, tenant)
        self.tenant, self.job_id = self.credential.subject, job_id
        self.timeout_s = timeout_s
        #: Requests sent and not yet stored by the brokers -> when their delivery ends.
        self._storing: dict[uuid.UUID, float] = {}
        self._storing_lock = threading.Lock()
        login = self.credential.kafka
        self._publisher = bus.Publisher(
            self.settings, login=login, delivery_timeout_s=delivery_timeout_s
        )
        self._delivery_timeout_s = delivery_timeout_s
        self._consumer = bus.make_consumer(self.settings, login=login, auto_offset_reset="latest")
        topic = self.settings.replies_topic(self.tenant)
        try:
            tp = self._follow(topic)
        except DsecError:
            self._publisher.close()
            self._consumer.close()
            raise
        self._reply_to = ReplyTo(topic=topic, partition=tp.partition)
        self._replies = ReplyReader(
            self._consumer, tp, self.credential.secret, self.settings.max_reply_bytes
        )
        self._closed = threading.Event()  # set by close(): the lease's renewals stop
        self.lease_id: str | None = None
        if lease:
            self.lease_id = lease if isinstance(lease, str) else "lease-" + uuid.uuid4().hex[:20]
            self._lease_ttl_s, self._lease_grace_s = lease_ttl_s, lease_grace_s
            self._renew_lease()
            threading.Thread(target=self._keep_lease, name="dsec-lease", daemon=True).start()

    def _follow(self, topic: str) -> TopicPartition:
        """Read replies from one partition of ``topic``, picked at random, from its end
        (resolved now: replies to this client's first request must count)."""
        try:
            found = self._consumer.partitions_for_topic(topic)
            if not found:
                raise ConfigError(
                    f"no replies topic {topic} for tenant {self.tenant}: is the tenant created "
                    f"(`dsec tenant create {self.tenant}`) and the platform up?",
                    reason=ConfigReason.NO_REPLIES_TOPIC,
                )
            tp = TopicPartition(topic, random.choice(sorted(found)))
            self._consumer.assign([tp])
            self._consumer.seek_to_end(tp)
            self._consumer.position(tp)
        except KafkaError as exc:
            raise ServiceUnavailable(
                f"Kafka at {self.settings.kafka_bootstrap}: cannot follow {topic}: {exc}"
            ) from exc
        return tp

    # --- plumbing ---------------------------------------------------------------

    @property
    def forged_replies(self) -> int:
        """Replies dropped because their proof did not hold (forged or altered)."""
        return self._replies.forged

    def _renew_lease(self) -> None:
        assert self.lease_id is not None
        renew = RenewLease(
            **self._stamp(), sandbox_id=self.lease_id, job_id=self.job_id,
            ttl_s=self._lease_ttl_s, grace_s=self._lease_grace_s,
        )  # fmt: skip
        self.publish(renew)

    def publish(self, request: RequestBase, waiting: list[Future[Reply]] | None = None) -> None:
        """Sign ``request`` with this client's credential and send it (no waiting); if
        the brokers never take it, the ``waiting`` futures fail with
        :class:`ServiceUnavailable` saying why."""
        value = encode(request)
        cred = self.credential
        rid = request.request_id
        with self._storing_lock:
            now = time.monotonic()
            if len(self._storing) > STORING_KEPT:  # settled by a producer since replaced
                self._storing = {k: end for k, end in self._storing.items() if end > now}
            self._storing[rid] = now + self._delivery_timeout_s

        def stored() -> None:
            with self._storing_lock:
                self._storing.pop(rid, None)

        def undelivered(exc: BaseException) -> None:
            stored()  # settled: the futures fail now
            failure = ServiceUnavailable(
                f"{request.type} {request.sandbox_id} was not stored by Kafka at"
                f" {self.settings.kafka_bootstrap}: {exc}"
            )
            for future in waiting or []:
                # The reply reader may complete it at the same moment: the reply wins.
                with contextlib.suppress(InvalidStateError):
                    future.set_exception(failure)

        signed = proof.headers(proof.Purpose.REQUEST, cred.key_id, cred.secret, value)
        self._publisher.publish(
            self.settings.topic_requests, request.sandbox_id, value, headers=signed,
            on_failure=undelivered, on_stored=stored,
        )  # fmt: skip

    def storing_for(self, request_id: uuid.UUID) -> float:
        """How much longer the brokers may take to store request ``request_id`` before
        its wait fails with ServiceUnavailable; 0 once stored (or failed)."""
        with self._storing_lock:
            deadline = self._storing.get(request_id)
        return 0.0 if deadline is None else max(0.0, deadline - time.monotonic())

    def _keep_lease(self) -> None:
        # Three renewals per lease period: one lost message does not lapse it.
        while not self._closed.wait(self._lease_ttl_s / 3):
            try:
                self._renew_lease()
            except Exception:  # the next round tries again; a lapse is recoverable
                continue

    def _shape(self) -> dict[str, Any]:
        return {"lease_id": self.lease_id} if self.lease_id else {}

    @staticmethod
    def _stamp() -> dict[str, Any]:
        """What every request carries as its own (the platform requires both, and signed:
        a copy of the same bytes is then a replay): a new id, and when it was made."""
        return {"request_id": new_id(), "sent_at": utcnow()}

    def _common(self, sandbox_id: str) -> dict[str, Any]:
        return {
            **self._stamp(),
            "sandbox_id": sandbox_id,
            "job_id": self.job_id,
            "reply_to": self._reply_to,
        }

    def expect(self, request_id: uuid.UUID) -> Future[Reply]:
        """A future for the reply to ``request_id`` (register before sending)."""
        return self._replies.expect(request_id)

    def send(self, request: RequestBase, on_output: OutputHandler | None = None) -> Future[Reply]:
        """Send a request; the future completes with its reply. ``on_output`` gets the
        output chunks of an Exec with ``stream_output``, in order, on the reply reader's
        thread (keep it quick)."""
        future = self._replies.expect(request.request_id, on_output)
        self.publish(request, [future])
        return future

    def answer(
        self,
        request: RequestBase,
        future: Future[Reply],
        timeout_s: float | None = None,
        *,
        request_id: uuid.UUID | None = None,
        keep: bool = False,
    ) -> Answer:
        """The step that waits for the reply to ``request``, sent (``future`` from
        :meth:`send` or :meth:`expect`): at most ``timeout_s``, else this client's
        timeout. ``request_id`` is the id the reply carries where it is not the
        request's (a group member's); with ``keep``, a timeout leaves it awaited."""
        rid = request_id or request.request_id
        limit = timeout_s or self.timeout_s
        return Answer(
            request, future, limit, lambda: self._replies.forget(rid), keep,
            storing=lambda: self.storing_for(request.request_id),
        )  # fmt: skip

    def ask(
        self,
        request: RequestBase,
        timeout_s: float | None = None,
        on_output: OutputHandler | None = None,
    ) -> Answer:
        """Send ``request``; the step that waits for its reply (see :meth:`send`)."""
        return self.answer(request, self.send(request, on_output), timeout_s)

    def ask_members(
        self, request: CreateGroup | DestroyGroup, members: list[str], timeout_s: float | None
    ) -> list[Answer]:
        """Send a group's request; a step per member, each waiting for its own reply."""
        answers = []
        for member in members:
            rid = member_request_id(request.request_id, member)
            answers.append(self.answer(request, self.expect(rid), timeout_s, request_id=rid))
        self.publish(request, [a.future for a in answers])
        return answers

    def wait(self, request: RequestBase, future: Future[Reply], timeout_s: float | None) -> Reply:
        """The reply to ``request``, or a typed error."""
        return self.answer(request, future, timeout_s).block()

    def call(
        self,
        request: RequestBase,
        timeout_s: float | None = None,
        on_output: OutputHandler | None = None,
    ) -> Reply:
        """Send and wait."""
        return self.ask(request, timeout_s, on_output).block()

    # --- API: each operation is a generator of steps (app/sdk/steps.py), run here by
    # blocking and by AsyncClient by awaiting -----------------------------------------

    def create(
        self, image: str | None = None, *, timeout_s: float | None = None, **options: Any
    ) -> Sandbox:
        """A new running sandbox (see :class:`CreateSandbox` for options)."""
        return self.create_many(1, image, timeout_s=timeout_s, **options)[0]

    def create_many_steps(
        self, /, n: int, image: str | None = None, *, timeout_s: float | None = None, **options: Any
    ) -> Steps[list[Sandbox]]:
        """``n`` sandboxes, requested at once. If any fails, the others are destroyed."""
        requests = [
            CreateSandbox(
                image=image or self.settings.default_image,
                **self._common(new_sandbox_id()),
                **{**self._shape(), **options},
            )
            for _ in range(n)
        ]
        asked = [(request.sandbox_id, self.ask(request, timeout_s)) for request in requests]
        ready, error = yield from self._started(asked)
        if error is not None:
            for sandbox in ready:
                yield from sandbox.close_steps()
            raise error
        return ready

    create_many = blocking(create_many_steps)

    def create_group_steps(
        self,
        /,
        n: int,
        image: str | None = None,
        *,
        group_id: str | None = None,
        timeout_s: float | None = None,
        **options: Any,
    ) -> Steps[Group]:
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
        answers = self.ask_members(request, members, timeout_s)
        ready, error = yield from self._started(list(zip(members, answers, strict=True)))
        group = Group(self, gid, ready)
        if error is not None:
            if ready:
                yield from group.close_steps()
            raise error
        return group

    create_group = blocking(create_group_steps)

    def _started(
        self, asked: list[tuple[str, Answer]]
    ) -> Steps[tuple[list[Sandbox], Exception | None]]:
        """Wait for every create asked: the sandboxes that started, and the first error."""
        ready: list[Sandbox] = []
        error: Exception | None = None
        for sandbox_id, answer in asked:
            try:
                reply = yield answer
                assert isinstance(reply, SandboxReady)
                ready.append(Sandbox(self, sandbox_id, reply.node_id))
            except Exception as exc:
                error = error or exc
        return ready, error

    def destroy_steps(self, sandbox_id: str, timeout_s: float | None = None) -> Steps[None]:
        """Destroy the sandbox. A destroy that gets no answer (a broker that died took
        the request or its reply) is sent again, as a new request: destroying is
        idempotent, and a sandbox an earlier attempt already ended counts as done."""
        for attempt in range(DESTROY_ATTEMPTS):
            try:
                yield self.ask(DestroySandbox(**self._common(sandbox_id)), timeout_s)
                return
            except RequestTimeout:
                if attempt == DESTROY_ATTEMPTS - 1:
                    raise
            except SandboxRejectedError as exc:
                gone = (RejectReason.UNKNOWN_SANDBOX, RejectReason.SANDBOX_NOT_RUNNING)
                if attempt == 0 or exc.reason not in gone:
                    raise
                return

    destroy = blocking(destroy_steps)

    def sandbox(self, sandbox_id: str) -> Sandbox:
        """A handle on an existing sandbox."""
        return Sandbox(self, sandbox_id, node_id=None)

    def close(self) -> None:
        """Stop reading replies and flush what was sent."""
        self._closed.set()
        self._replies.close()
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

    def close_steps(self, timeout_s: float | None = None) -> Steps[None]:
        """Destroy every member (idempotent)."""
        if self.closed:
            return
        self.closed = True
        request = DestroyGroup(**self.client._common(self.id))
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
            sandbox.client._common(sandbox.id), command, timeout_s=timeout_s,
            stream_output=True, **options,
        )  # fmt: skip
        self._sandbox = sandbox
        self._client = sandbox.client
        #: When (``time.monotonic()``) its reply is no longer expected: its own timeout
        #: and a margin.
        self.deadline = time.monotonic() + timeout_s + 30
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
        request = KillCommand(command_id=self.id, **self._client._common(self._sandbox.id))
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

    def __init__(self, client: Client, sandbox_id: str, node_id: str | None) -> None:
        self.client = client
        self.id = sandbox_id
        self.node_id = node_id
        self.closed = False

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
            self.client._common(self.id), command, timeout_s=timeout_s, stdin=stdin,
            stream_output=on_output is not None, env=env or {}, cwd=cwd,
            max_output_bytes=max_output_bytes, trajectory_id=trajectory_id, step=step,
        )  # fmt: skip
        reply = yield self.client.ask(request, timeout_s + 30, on_output)
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
            **self.client._common(self.id),
        )
        yield self.client.ask(request)

    write_file = blocking(write_file_steps)

    def read_file_steps(self, path: str, max_bytes: int = 1 << 20) -> Steps[bytes]:
        """Read ``path`` from inside the sandbox (at most ``max_bytes``)."""
        request = ReadFile(path=path, max_bytes=max_bytes, **self.client._common(self.id))
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
