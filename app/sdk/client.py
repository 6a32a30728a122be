"""The trainer's SDK: sandboxes over Kafka only (no Postgres, no Celery).

    from app.sdk import Client

    with Client(tenant="team-a", job_id="rollout-7") as client:
        with client.create() as sandbox:
            print(sandbox.exec("echo hi").stdout)

Each request goes to the requests topic keyed by sandbox id; the answer comes back
on one partition of the replies topic that this client picked and reads alone.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from concurrent.futures import Future, InvalidStateError
from typing import Any, Self

from app import credentials
from app.bus import KafkaLogin
from app.config import Settings, get_settings
from app.credentials import Credential
from app.domain import proof
from app.domain.base import RejectReason, new_id, new_sandbox_id, utcnow
from app.domain.codec import encode
from app.domain.replies import (
    Reply,
    SandboxReady,
)
from app.domain.requests import (
    CreateGroup,
    CreateSandbox,
    DestroyGroup,
    DestroySandbox,
    RenewLease,
    ReplyTo,
    RequestBase,
    member_request_id,
)
from app.errors import (
    ConfigError,
    ConfigReason,
    DsecError,
    RequestTimeout,
    SandboxRejectedError,
    ServiceUnavailable,
)
from app.sdk.handles import Group, Sandbox
from app.sdk.images import Images
from app.sdk.reader import ReplyReader

# What a command did, and the request that runs one, are importable from here too.
from app.sdk.results import Chunk as Chunk
from app.sdk.results import ExecResult as ExecResult
from app.sdk.results import OutputHandler as OutputHandler
from app.sdk.results import exec_request as exec_request
from app.sdk.secrets import Secrets
from app.sdk.steps import Answer, Steps, blocking
from app.sdk.transport import KafkaTransport, Transport
from app.sdk.transport_rdkafka import RdkafkaTransport

#: A request the brokers cannot store within this long (fewer in-sync replicas than
#: the topic needs, no broker at all) fails its wait with ServiceUnavailable. Longer
#: than a broker's restart (~20 s for the embedded one, more on a loaded host), which
#: a trainer should sit out rather than hear as a failure.
DELIVERY_TIMEOUT_S = 45.0
#: Requests awaiting storage tracked before those past their delivery are dropped.
STORING_KEPT = 10_000
#: Destroys sent for one sandbox before its trainer hears RequestTimeout.
DESTROY_ATTEMPTS = 2


def _kafka_transport(
    settings: Settings, login: KafkaLogin | None, delivery_timeout_s: float
) -> Transport:
    """The Kafka transport ``settings.sdk_kafka_client`` names."""
    if settings.sdk_kafka_client == "librdkafka":
        return RdkafkaTransport(settings, login, delivery_timeout_s)
    return KafkaTransport(settings, login, delivery_timeout_s)


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
        transport: Transport | None = None,
    ) -> None:
        """Connect as ``credential`` (else the local credential of ``tenant``, else the
        one :func:`app.credentials.for_client` finds: ``DSEC_CREDENTIALS`` first).

        With ``lease``, every sandbox this client creates is tied to a lease it renews
        in the background (a string reattaches to an earlier lease by id): if this
        trainer dies, its sandboxes are frozen after ``lease_ttl_s`` and destroyed
        ``lease_grace_s`` later unless a client reattaches.

        A request the brokers have not stored within ``delivery_timeout_s`` fails with
        ServiceUnavailable (a trainer that would rather fail fast than sit out a
        broker's restart lowers it).

        ``transport`` is how requests leave and replies come back: Kafka unless given,
        through the client library ``settings.sdk_kafka_client`` names
        (:class:`app.memory.InMemoryTransport` runs a client on an in-memory bus)."""
        self.settings = settings or get_settings()
        self.credential = credential or credentials.for_client(self.settings, tenant)
        self.tenant, self.job_id = self.credential.subject, job_id
        self.timeout_s = timeout_s
        #: The tenant's own images in the hub: ``client.images.push(name, rootfs)``.
        self.images = Images(self.settings, self.credential)
        #: The tenant's egress secrets: ``client.secrets.put(host, header=, value=)``.
        self.secrets = Secrets(self.settings, self.credential)
        #: Requests sent and not yet stored by the brokers -> when their delivery ends.
        self._storing: dict[uuid.UUID, float] = {}
        self._storing_lock = threading.Lock()
        self._delivery_timeout_s = delivery_timeout_s
        self._transport: Transport = transport or _kafka_transport(
            self.settings, self.credential.kafka, delivery_timeout_s
        )
        topic = self.settings.replies_topic(self.tenant)
        try:
            followed = self._transport.follow(topic)
            if followed is None:
                raise ConfigError(
                    f"no replies topic {topic} for tenant {self.tenant}: is the tenant created "
                    f"(`dsec tenant create {self.tenant}`) and the platform up?",
                    reason=ConfigReason.NO_REPLIES_TOPIC,
                )
        except DsecError:
            self._transport.close()
            raise
        partition, source = followed
        self._reply_to = ReplyTo(topic=topic, partition=partition)
        self._replies = ReplyReader(source, self.credential.secret, self.settings.max_reply_bytes)
        self._closed = threading.Event()  # set by close(): the lease's renewals stop
        self.lease_id: str | None = None
        if lease:
            self.lease_id = lease if isinstance(lease, str) else "lease-" + uuid.uuid4().hex[:20]
            self._lease_ttl_s, self._lease_grace_s = lease_ttl_s, lease_grace_s
            self._renew_lease()
            threading.Thread(target=self._keep_lease, name="dsec-lease", daemon=True).start()

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

    def publish(
        self,
        request: RequestBase,
        waiting: list[Future[Reply]] | None = None,
        *,
        node: str | None = None,
    ) -> None:
        """Sign ``request`` with this client's credential and send it (no waiting); if
        the brokers never take it, the ``waiting`` futures fail with
        :class:`ServiceUnavailable` saying why. With ``node``, it goes straight to that
        node's inbox, proven under its sandbox's key (the direct route:
        app/domain/direct.py)."""
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

        if node is None:
            topic = self.settings.topic_requests
            signed = proof.headers(proof.Purpose.REQUEST, cred.key_id, cred.secret, value)
        else:
            topic = self.settings.node_topic(node)
            key = proof.sandbox_key(cred.secret, request.sandbox_id)
            signed = proof.headers(proof.Purpose.DIRECT, cred.key_id, key, value)
        self._transport.publish(
            topic, request.sandbox_id, value, headers=signed,
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

    def request_fields(self, sandbox_id: str) -> dict[str, Any]:
        """The fields every request about ``sandbox_id`` carries: who asks, for which
        job, where the reply goes, and when it was made."""
        return {
            **self._stamp(),
            "sandbox_id": sandbox_id,
            "job_id": self.job_id,
            "reply_to": self._reply_to,
        }

    def expect(self, request_id: uuid.UUID) -> Future[Reply]:
        """A future for the reply to ``request_id`` (register before sending)."""
        return self._replies.expect(request_id)

    def send(
        self,
        request: RequestBase,
        on_output: OutputHandler | None = None,
        *,
        node: str | None = None,
    ) -> Future[Reply]:
        """Send a request; the future completes with its reply. ``on_output`` gets the
        output chunks of an Exec with ``stream_output``, in order, on the reply reader's
        thread (keep it quick). With ``node``, straight to that node (see
        :meth:`publish`): its replies are proven under the sandbox's key."""
        key = (
            None if node is None else proof.sandbox_key(self.credential.secret, request.sandbox_id)
        )
        future = self._replies.expect(request.request_id, on_output, key)
        self.publish(request, [future], node=node)
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
        *,
        node: str | None = None,
    ) -> Answer:
        """Send ``request``; the step that waits for its reply (see :meth:`send`)."""
        return self.answer(request, self.send(request, on_output, node=node), timeout_s)

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
                **self.request_fields(new_sandbox_id()),
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
            **self.request_fields(gid),
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
                ready.append(Sandbox(self, sandbox_id, reply.node_id, reply.direct))
            except Exception as exc:
                error = error or exc
        return ready, error

    def destroy_steps(self, sandbox_id: str, timeout_s: float | None = None) -> Steps[None]:
        """Destroy the sandbox. A destroy that gets no answer (a broker that died took
        the request or its reply) is sent again, as a new request: destroying is
        idempotent, and a sandbox an earlier attempt already ended counts as done."""
        for attempt in range(DESTROY_ATTEMPTS):
            try:
                yield self.ask(DestroySandbox(**self.request_fields(sandbox_id)), timeout_s)
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
        self._transport.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
