"""The seam between the SDK's two clients: each operation written once, waited on twice.

An operation of the SDK (an exec, a create, a group's destroy, an upload) is a
generator, the sync classes' ``*_steps`` methods. It sends its requests, then yields
each thing it must wait for (a :class:`Answer`, or :class:`Work` on the local disk) and
is sent back the outcome, or has the error thrown in. :func:`run` waits by blocking:
that is :class:`app.sdk.Client`. :func:`run_async` waits by awaiting: that is
:class:`app.sdk.AsyncClient`, which holds a sync client and runs its steps. So the two
clients differ only in how they wait::

    class Sandbox:
        def read_file_steps(self, path: str) -> Steps[bytes]:
            reply = yield self.client.ask(ReadFile(path=path, ...))
            return base64.b64decode(reply.data_b64)

        read_file = blocking(read_file_steps)               # Sandbox.read_file

    class AsyncSandbox:
        read_file = awaited(Sandbox.read_file_steps)        # AsyncSandbox.read_file

A step waits for requests already sent; awaiting one holds no thread, so a thousand
awaited execs are a thousand futures, not a thousand threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable, Coroutine, Generator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Concatenate, Generic, ParamSpec, Protocol, TypeVar, cast

from app.domain.base import FailReason, RejectReason
from app.domain.replies import ErrorReply, Reply
from app.domain.requests import RequestBase
from app.errors import (
    RequestTimeout,
    SandboxError,
    SandboxFailedError,
    SandboxIdInUse,
    SandboxNotFound,
    SandboxRejectedError,
    TimeoutReason,
)

T = TypeVar("T")
S = TypeVar("S")
S_co = TypeVar("S_co", covariant=True)
P = ParamSpec("P")

_REJECT_REASONS = {r.value: r for r in RejectReason}
_FAIL_REASONS = {r.value: r for r in FailReason}


def error_for(reply: ErrorReply) -> SandboxError:
    """The typed error an error reply stands for, its reason as the log's enum
    (:class:`RejectReason` or :class:`FailReason`; a reason this SDK does not know,
    from a newer platform, stays the string it came as, on a failure)."""
    rejected = _REJECT_REASONS.get(reply.reason)
    if rejected == RejectReason.UNKNOWN_SANDBOX:
        return SandboxNotFound(reply.sandbox_id, rejected, reply.detail)
    if rejected == RejectReason.ID_IN_USE:
        return SandboxIdInUse(reply.sandbox_id, rejected, reply.detail)
    if rejected is not None:
        return SandboxRejectedError(reply.sandbox_id, rejected, reply.detail)
    reason = _FAIL_REASONS.get(reply.reason, reply.reason)
    return SandboxFailedError(reply.sandbox_id, reason, reply.detail)


@dataclass(frozen=True)
class Answer:
    """Step: the reply to a request already sent. An error reply raises its typed
    error (:func:`error_for`); no reply within ``timeout_s`` raises
    :class:`RequestTimeout`."""

    #: The request sent (named in a timeout's message).
    request: RequestBase
    #: Completes with the reply (the client's reply reader sets it).
    future: Future[Reply]
    timeout_s: float
    #: Stops listening for the reply, called on a timeout unless ``keep``.
    forget: Callable[[], None]
    #: A timeout leaves the reply awaited (a background command that may still end).
    keep: bool = False
    #: How much longer the brokers may take to store the request (0 once stored).
    storing: Callable[[], float] = lambda: 0.0

    def block(self) -> Reply:
        """The reply, waited for by blocking this thread."""
        try:
            reply = self.future.result(timeout=self.timeout_s)
        except TimeoutError:
            try:
                reply = self.future.result(timeout=self._unstored_grace())
            except TimeoutError as exc:
                raise self._timed_out() from exc
        return self._settled(reply)

    async def wait(self) -> Reply:
        """The reply, awaited. The future is shielded: a timeout or a cancelled task
        never cancels it under the reply reader, which may be completing it."""
        future = asyncio.wrap_future(self.future)
        try:
            reply = await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
        except TimeoutError:
            try:
                reply = await asyncio.wait_for(asyncio.shield(future), self._unstored_grace())
            except TimeoutError as exc:
                raise self._timed_out() from exc
        return self._settled(reply)

    def _unstored_grace(self) -> float:
        """More time for a request the brokers have not stored yet (one restarting):
        the reply's clock starts once it is stored, and a request never stored fails
        with ServiceUnavailable when its delivery ends, not with a timeout first."""
        left = self.storing()
        return left + self.timeout_s if left > 0 else 0.0

    def _timed_out(self) -> RequestTimeout:
        what = f"{self.request.type} {self.request.sandbox_id}"
        if self.keep:
            return RequestTimeout(
                f"{what}: still running after {self.timeout_s}s",
                reason=TimeoutReason.STILL_RUNNING,
            )
        self.forget()
        return RequestTimeout(
            f"{what}: no reply in {self.timeout_s}s", reason=TimeoutReason.NO_REPLY
        )

    @staticmethod
    def _settled(reply: Reply) -> Reply:
        if isinstance(reply, ErrorReply):
            raise error_for(reply)
        return reply


@dataclass(frozen=True)
class Work(Generic[T]):
    """Step: local work that blocks a while (packing or unpacking an archive). The
    sync client does it in place, the async one on a thread."""

    do: Callable[[], T]

    def block(self) -> T:
        """Do it on this thread."""
        return self.do()

    async def wait(self) -> T:
        """Do it on a thread, awaited."""
        return await asyncio.to_thread(self.do)


Step = Answer | Work[Any]
#: An operation: yields steps, is sent their outcomes, returns its result.
Steps = Generator[Step, Any, T]


#: What a step came to: its outcome, or the error it raised.
Settled = tuple[Any, Exception | None]


def _next(steps: Steps[T], settled: Settled) -> tuple[bool, Any]:
    """Hand the last step's outcome (or error) to the operation: (True, its result) if
    it finished, else (False, its next step)."""
    outcome, error = settled
    try:
        return False, steps.send(outcome) if error is None else steps.throw(error)
    except StopIteration as done:
        return True, done.value


def _blocked(step: Step) -> Settled:
    try:
        return step.block(), None
    except Exception as exc:
        return None, exc


async def _awaited(step: Step) -> Settled:
    try:
        return await step.wait(), None
    except Exception as exc:
        return None, exc


def run(steps: Steps[T]) -> T:
    """Carry an operation out, blocking on each step."""
    with contextlib.closing(steps):
        finished, step = _next(steps, (None, None))
        while not finished:
            finished, step = _next(steps, _blocked(step))
        return cast(T, step)


async def run_async(steps: Steps[T]) -> T:
    """Carry an operation out, awaiting each step: :func:`run`'s loop, with ``await``
    where it blocks (the one place the two clients differ)."""
    with contextlib.closing(steps):
        finished, step = _next(steps, (None, None))
        while not finished:
            finished, step = _next(steps, await _awaited(step))
        return cast(T, step)


def blocking(operation: Callable[Concatenate[S, P], Steps[T]]) -> Callable[Concatenate[S, P], T]:
    """The sync method of an operation: ``exec = blocking(exec_steps)``."""

    @functools.wraps(operation)
    def method(self: S, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return run(operation(self, *args, **kwargs))

    method.__name__ = operation.__name__.removesuffix("_steps")
    method.__qualname__ = operation.__qualname__.removesuffix("_steps")
    return method


class Awaits(Protocol[S_co]):
    """An async class over a sync one (``AsyncSandbox`` over ``Sandbox``)."""

    @property
    def sync(self) -> S_co:
        """The sync object whose steps it awaits."""
        ...


def awaited(
    operation: Callable[Concatenate[S, P], Steps[T]],
) -> Callable[Concatenate[Awaits[S], P], Coroutine[Any, Any, T]]:
    """The async method of a sync class's operation, run on its ``sync`` object:
    ``exec = awaited(Sandbox.exec_steps)``."""

    @functools.wraps(operation)
    async def method(self: Awaits[S], /, *args: P.args, **kwargs: P.kwargs) -> T:
        return await run_async(operation(self.sync, *args, **kwargs))

    method.__name__ = operation.__name__.removesuffix("_steps")
    method.__qualname__ = operation.__qualname__.removesuffix("_steps")
    return method
