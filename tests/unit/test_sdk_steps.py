"""The SDK's seam (app/sdk/steps.py) without services: an operation written once
runs the same blocking and awaited; a reply not in time is a RequestTimeout that says
whether the SDK still listens."""

from __future__ import annotations

import asyncio
import threading
import uuid
from concurrent.futures import Future
from dataclasses import replace

import pytest

from app.domain.replies import Done, ErrorReply, Reply
from app.domain.requests import DestroySandbox
from app.errors import (
    RequestTimeout,
    SandboxFailedError,
    SandboxRejectedError,
    ServiceUnavailable,
    TimeoutReason,
)
from app.sdk.steps import Answer, Steps, Work, awaited, blocking, run, run_async

SANDBOX = "sbx-steps"


def error_reply(reason: str, detail: str = "why") -> ErrorReply:
    return ErrorReply(request_id=uuid.uuid4(), sandbox_id=SANDBOX, reason=reason, detail=detail)


def done() -> Done:
    return Done(request_id=uuid.uuid4(), sandbox_id=SANDBOX, detail="ok")


class Forgets:
    """What an Answer's ``forget`` was told."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1


def answer(future: Future[Reply], forget: Forgets | None = None, keep: bool = False) -> Answer:
    """The step waiting 50 ms for the reply to a destroy."""
    request = DestroySandbox(sandbox_id=SANDBOX)
    return Answer(request, future, 0.05, forget or Forgets(), keep)


def settled(reply: Reply) -> Future[Reply]:
    future: Future[Reply] = Future()
    future.set_result(reply)
    return future


# --- an Answer: blocking and awaited alike ----------------------------------------


def test_an_answer_returns_its_reply_or_raises_its_error() -> None:
    reply = done()
    assert answer(settled(reply)).block() == reply
    assert asyncio.run(answer(settled(reply)).wait()) == reply
    with pytest.raises(SandboxRejectedError):
        answer(settled(error_reply("quota"))).block()
    with pytest.raises(SandboxRejectedError):
        asyncio.run(answer(settled(error_reply("quota"))).wait())


def test_no_reply_in_time_stops_listening_and_says_so() -> None:
    for wait in (lambda a: a.block(), lambda a: asyncio.run(a.wait())):
        forget = Forgets()
        with pytest.raises(RequestTimeout) as timed_out:
            wait(answer(Future(), forget))
        assert timed_out.value.reason is TimeoutReason.NO_REPLY
        assert f"DestroySandbox {SANDBOX}: no reply in 0.05s" in str(timed_out.value)
        assert forget.calls == 1


def test_a_kept_answer_times_out_still_listening() -> None:
    forget = Forgets()
    with pytest.raises(RequestTimeout) as timed_out:
        answer(Future(), forget, keep=True).block()
    assert timed_out.value.reason is TimeoutReason.STILL_RUNNING
    assert forget.calls == 0


def test_an_awaited_timeout_leaves_the_future_for_the_reply_reader() -> None:
    # Given an awaited answer that timed out
    future: Future[Reply] = Future()
    with pytest.raises(RequestTimeout):
        asyncio.run(answer(future, keep=True).wait())
    # Then the future is not cancelled: the reader may still complete it
    assert not future.cancelled()
    future.set_result(done())


def _later(
    future: Future[Reply],
    after_s: float,
    reply: Reply | None = None,
    error: BaseException | None = None,
) -> None:
    def settle() -> None:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(reply or done())

    threading.Timer(after_s, settle).start()


def test_a_request_the_brokers_have_not_stored_yet_waits_for_them() -> None:
    for wait in (lambda a: a.block(), lambda a: asyncio.run(a.wait())):
        # Given a request still being stored (a broker restarting) when the reply's
        # 50 ms are up, whose reply comes once it is stored
        future: Future[Reply] = Future()
        reply = done()
        _later(future, 0.3, reply)
        step = replace(answer(future), storing=lambda: 30.0)
        # Then the trainer gets the reply, not a timeout
        assert wait(step) == reply


def test_a_request_never_stored_fails_with_the_brokers_reason_not_a_timeout() -> None:
    for wait in (lambda a: a.block(), lambda a: asyncio.run(a.wait())):
        future: Future[Reply] = Future()
        _later(future, 0.3, error=ServiceUnavailable("not stored by Kafka: timed out"))
        with pytest.raises(ServiceUnavailable, match="not stored"):
            wait(replace(answer(future), storing=lambda: 30.0))


# --- operations: written once, run blocking or awaited ---------------------------


class Box:
    """A sync class with one operation: two replies, an error caught, local work."""

    def __init__(self, replies: list[Reply]) -> None:
        self.replies = replies
        self.worked_on: list[str] = []

    def tally_steps(self, label: str, *, then: int = 0) -> Steps[str]:
        """Waits for every reply, counting the refused ones."""
        refused = 0
        for reply in self.replies:
            try:
                yield answer(settled(reply))
            except SandboxRejectedError:
                refused += 1
        thread: str = yield Work(lambda: threading.current_thread().name)
        self.worked_on.append(thread)
        return f"{label}: {len(self.replies) - refused} done, {refused} refused, {then}"

    tally = blocking(tally_steps)


class AsyncBox:
    def __init__(self, sync: Box) -> None:
        self.sync = sync

    tally = awaited(Box.tally_steps)


def test_one_operation_runs_the_same_blocking_and_awaited() -> None:
    box = Box([done(), error_reply("capacity"), done()])
    assert box.tally("sync", then=1) == "sync: 2 done, 1 refused, 1"
    assert asyncio.run(AsyncBox(box).tally("async", then=2)) == "async: 2 done, 1 refused, 2"
    # The sync run works on its own thread, the async one off the event loop's
    assert box.worked_on[0] == threading.current_thread().name
    assert box.worked_on[1] != threading.current_thread().name
    assert (Box.tally.__name__, AsyncBox.tally.__name__) == ("tally", "tally")


def test_an_error_the_operation_does_not_catch_leaves_it() -> None:
    def steps() -> Steps[None]:
        yield answer(settled(error_reply("runtime_error")))

    with pytest.raises(SandboxFailedError):
        run(steps())
    with pytest.raises(SandboxFailedError):
        asyncio.run(run_async(steps()))
