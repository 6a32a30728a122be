"""The trajectory log port's contract, run against the ``commands`` projection in
Postgres (fed as the projector feeds it: CommandCompleted events appended to the log)
and the in-memory log alike."""

from __future__ import annotations

import base64
import uuid
from collections.abc import Callable, Iterator

import pytest

from app.config import Settings
from app.domain.events import CommandCompleted, CommandPayload
from app.domain.trajectory import InMemoryTrajectoryLog, TrajectoryLog

#: Hands one CommandCompleted to the log's write side.
Complete = Callable[[CommandCompleted], None]


@pytest.fixture(params=["memory", pytest.param("postgres", marks=pytest.mark.integration)])
def port(request: pytest.FixtureRequest) -> Iterator[tuple[TrajectoryLog, Complete]]:
    if request.param == "memory":
        log = InMemoryTrajectoryLog()
        yield log, log.completed
        return
    from app.db import log as event_log
    from app.db.engine import transaction
    from app.db.trajectory import PostgresTrajectoryLog

    stack: Settings = request.getfixturevalue("stack")
    topic_id = uuid.uuid4()
    offsets = iter(range(1_000_000))

    def complete(event: CommandCompleted) -> None:
        sourced = event_log.SourcedEvent(event, "contract.trajectory", topic_id, 0, next(offsets))
        with transaction(stack.database_url) as conn:
            event_log.append_and_project(conn, [sourced])

    yield PostgresTrajectoryLog(stack.database_url), complete


@pytest.fixture
def tenant() -> str:
    """A tenant of this test alone (the Postgres log is shared by the whole suite)."""
    return f"contract-{uuid.uuid4().hex[:8]}"


def _completed(
    tenant: str, trajectory: str | None, step: int | None, out: bytes, exit_code: int = 0
) -> CommandCompleted:
    encoded = base64.b64encode(out).decode()
    return CommandCompleted(
        sandbox_id="sb-contract",
        node_id="node-contract",
        tenant=tenant,
        job_id="contract",
        payload=CommandPayload(
            request_id=uuid.uuid4(),
            actor=tenant,
            command=["echo", out.decode()],
            exit_code=exit_code,
            duration_ms=1.5,
            stdout_bytes=len(out),
            stderr_bytes=0,
            trajectory_id=trajectory,
            step=step,
            stdout_b64=encoded if trajectory is not None else None,
            stderr_b64="" if trajectory is not None else None,
        ),
    )


def test_a_completed_step_is_found_with_what_it_returned(
    port: tuple[TrajectoryLog, Complete], tenant: str
) -> None:
    log, complete = port
    event = _completed(tenant, "traj", 0, b"forty-two", exit_code=3)
    complete(event)
    found = log.lookup(tenant, "traj", 0)
    assert found is not None
    assert found.request_id == event.payload.request_id
    assert (found.step, found.exit_code, found.timed_out, found.truncated) == (0, 3, False, False)
    assert base64.b64decode(found.stdout_b64) == b"forty-two"
    assert found.command == ["echo", "forty-two"]


def test_an_unknown_step_is_not_there(port: tuple[TrajectoryLog, Complete], tenant: str) -> None:
    log, complete = port
    complete(_completed(tenant, "traj", 0, b"a"))
    assert log.lookup(tenant, "traj", 1) is None
    assert log.lookup(tenant, "other", 0) is None
    assert log.steps(tenant, "other") == []


def test_a_tenant_sees_only_its_own_steps(
    port: tuple[TrajectoryLog, Complete], tenant: str
) -> None:
    log, complete = port
    complete(_completed(tenant, "shared-name", 0, b"mine"))
    assert log.lookup(tenant + "-other", "shared-name", 0) is None
    assert log.steps(tenant + "-other", "shared-name") == []


def test_steps_come_in_step_order(port: tuple[TrajectoryLog, Complete], tenant: str) -> None:
    log, complete = port
    for step in (2, 0, 1):
        complete(_completed(tenant, "traj", step, str(step).encode()))
    assert [s.step for s in log.steps(tenant, "traj")] == [0, 1, 2]


def test_a_command_outside_any_trajectory_is_no_step(
    port: tuple[TrajectoryLog, Complete], tenant: str
) -> None:
    log, complete = port
    complete(_completed(tenant, None, None, b"plain"))
    assert log.steps(tenant, "traj") == []


def test_of_two_completions_of_one_step_the_first_is_kept(
    port: tuple[TrajectoryLog, Complete], tenant: str
) -> None:
    log, complete = port
    first = _completed(tenant, "traj", 0, b"first")
    complete(first)
    complete(_completed(tenant, "traj", 0, b"second"))
    found = log.lookup(tenant, "traj", 0)
    assert found is not None and found.request_id == first.payload.request_id
    assert [s.step for s in log.steps(tenant, "traj")] == [0]
