"""The task queue port's contract, run against Celery over Redis and the in-memory
queue alike."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from app.config import Settings
from app.memory import InMemoryTaskQueue
from app.ports import TaskQueue
from app.taskqueue import CeleryTaskQueue


@pytest.fixture(params=["memory", pytest.param("celery", marks=pytest.mark.integration)])
def tasks(request: pytest.FixtureRequest) -> Iterator[TaskQueue]:
    if request.param == "memory":
        yield InMemoryTaskQueue()
        return
    stack: Settings = request.getfixturevalue("stack")
    yield CeleryTaskQueue(stack)


@pytest.fixture
def queue() -> str:
    """A queue no node consumes."""
    return f"contract.{uuid.uuid4().hex[:8]}"


def test_a_task_is_taken_from_its_queue_with_its_name_and_args(
    tasks: TaskQueue, queue: str
) -> None:
    tasks.send("dsec.create", queue, ["sealed-envelope", "second"])
    assert tasks.take(queue, wait_s=10) == ("dsec.create", ["sealed-envelope", "second"])
    assert tasks.take(queue, wait_s=0.2) is None


def test_tasks_come_in_the_order_they_were_sent(tasks: TaskQueue, queue: str) -> None:
    for n in range(5):
        tasks.send("dsec.exec", queue, [str(n)])
    assert [tasks.take(queue, wait_s=10) for _ in range(5)] == [
        ("dsec.exec", [str(n)]) for n in range(5)
    ]


def test_queues_are_apart(tasks: TaskQueue, queue: str) -> None:
    other = queue + ".other"
    tasks.send("dsec.destroy", other, ["x"])
    assert tasks.take(queue, wait_s=0.3) is None
    assert tasks.take(other, wait_s=10) == ("dsec.destroy", ["x"])


def test_an_empty_queue_answers_none(tasks: TaskQueue, queue: str) -> None:
    assert tasks.take(queue, wait_s=0.2) is None
