"""The node's claims and step guard (workers/state_port.py): one contract, run against
Redis and the in-memory stand-ins the in-process round trip uses alike."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from app.config import Settings
from app.domain.requests import Exec, ReplyTo
from app.domain.trajectory import RecordedStep
from workers.memory_state import InMemoryClaims, InMemoryStepGuard
from workers.state_port import ClaimStore, StepStore

SECRET = b"s" * 32
REPLY_KEY = b"r" * 32


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.integration)])
def stores(request: pytest.FixtureRequest) -> Iterator[tuple[ClaimStore, StepStore]]:
    if request.param == "memory":
        yield InMemoryClaims(), InMemoryStepGuard()
        return
    from workers.redis_state import Claims, StepGuard, connect, connect_claims

    stack: Settings = request.getfixturevalue("stack")
    client = connect(stack.celery_broker_url)
    # A node of its own: another test's (or node's) claims are not this one's.
    node = f"contract-{uuid.uuid4().hex[:8]}"
    own = connect_claims(stack.celery_broker_url)  # as a node's worker has it
    yield Claims(own, node, SECRET, 660), StepGuard(client)
    own.close()
    client.close()


def _exec(step: int | None = None) -> Exec:
    return Exec(
        sandbox_id="sb-contract", tenant="t", command="true",
        reply_to=ReplyTo(topic="dsec.replies.t", partition=0),
        trajectory_id="tr" if step is not None else None, step=step,
    )  # fmt: skip


def test_a_command_is_claimed_once_and_in_flight_until_answered(
    stores: tuple[ClaimStore, StepStore],
) -> None:
    claims, _ = stores
    command = _exec()

    assert claims.claim(command, REPLY_KEY)
    assert not claims.claim(command, REPLY_KEY)
    assert [(field, found.request_id, key) for field, (found, key) in claims.unanswered()] == [
        (command.scope, command.request_id, REPLY_KEY)
    ]

    claims.answered(command.scope)
    assert claims.unanswered() == []
    # Answered is not forgotten: the command never runs again.
    assert not claims.claim(command, REPLY_KEY)


def test_commands_claimed_together_are_claimed_once_each_in_order(
    stores: tuple[ClaimStore, StepStore],
) -> None:
    claims, _ = stores
    first, second, third = _exec(), _exec(), _exec()
    assert claims.claim(second, None)

    assert claims.claim_many([(first, REPLY_KEY), (second, None), (third, None)]) == [
        True, False, True
    ]  # fmt: skip
    assert claims.claim_many([(first, REPLY_KEY), (third, None)]) == [False, False]
    in_flight = {found.request_id: key for _field, (found, key) in claims.unanswered()}
    assert in_flight == {first.request_id: REPLY_KEY, second.request_id: None,
                         third.request_id: None}  # fmt: skip


def test_thousands_of_commands_answered_at_once_all_leave_the_in_flight_set(
    stores: tuple[ClaimStore, StepStore],
) -> None:
    # A node's command threads finish together (2,000 `sleep 10` end within a second):
    # a client whose pool refuses callers past a cap left refused commands in flight,
    # to be answered a second time, as interrupted, at the worker's next start.
    claims, _ = stores
    commands = [_exec() for _ in range(300)]
    assert claims.claim_many([(command, None) for command in commands]) == [True] * 300
    together = threading.Barrier(300)

    def answer(command: Exec) -> None:
        together.wait()
        claims.answered(command.scope)

    with ThreadPoolExecutor(300) as pool:
        list(pool.map(answer, commands))  # re-raises what any thread raised
    assert claims.unanswered() == []


def test_a_task_is_held_until_answered(stores: tuple[ClaimStore, StepStore]) -> None:
    claims, _ = stores
    claims.hold("t/1", "dsec.create", ["sealed"])

    assert claims.held() == [("t/1", ("dsec.create", ["sealed"]))]
    claims.answered("t/1")
    assert claims.held() == []


def test_a_step_is_claimed_once_until_released(stores: tuple[ClaimStore, StepStore]) -> None:
    _, steps = stores
    trajectory = f"tr-{uuid.uuid4().hex[:8]}"

    assert steps.claim("t", trajectory, 1, "first")
    assert not steps.claim("t", trajectory, 1, "second")
    assert not steps.claim("t", trajectory, 1, "first")
    assert steps.claim("t", trajectory, 2, "first")
    steps.release("t", trajectory, 1)
    assert steps.claim("t", trajectory, 1, "second")


def test_a_steps_result_is_shared_once_recorded(stores: tuple[ClaimStore, StepStore]) -> None:
    _, steps = stores
    trajectory = f"tr-{uuid.uuid4().hex[:8]}"
    recorded = RecordedStep(
        request_id=uuid.uuid4(), step=3, command="echo hi", exit_code=0,
        stdout_b64="aGkK", stderr_b64="", duration_ms=1.5, timed_out=False, truncated=False,
    )  # fmt: skip

    assert steps.wait("t", trajectory, 3, timeout_s=0.1) is None
    steps.record("t", trajectory, recorded)
    assert steps.wait("t", trajectory, 3, timeout_s=1.0) == recorded
