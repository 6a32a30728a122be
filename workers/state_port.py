"""What a node keeps beyond its process, as its handlers see it: the claims that make
each command run once (:class:`ClaimStore`) and the guard of trajectory steps
(:class:`StepStore`).

The node's worker keeps them in Redis (:mod:`workers.redis_state`, built by
``workers/main.py``); unit tests keep them in memory (:mod:`workers.memory_state`).
What each call guarantees is written on the Redis adapter, which is the reference.
"""

from __future__ import annotations

from typing import Protocol

from app.domain.requests import Exec
from app.domain.trajectory import RecordedStep


class ClaimStore(Protocol):
    """A node's exec claims, its commands in flight and the tasks it is doing."""

    def claim(self, request: Exec, reply_key: bytes | None) -> bool:
        """True the first time ``request`` is seen; it is then in flight until
        :meth:`answered`."""
        ...

    def answered(self, scope: str) -> None:
        """The command or task of the request of ``scope`` was answered."""
        ...

    def hold(self, scope: str, task: str, args: list[str]) -> None:
        """A lifecycle or file task is being done here until :meth:`answered`."""
        ...

    def held(self) -> list[tuple[str, tuple[str, list[str]]]]:
        """Tasks taken and never finished, each with the field it is kept under."""
        ...

    def unanswered(self) -> list[tuple[str, tuple[Exec, bytes | None]]]:
        """Commands claimed and never answered, each with the field it is kept under."""
        ...


class StepStore(Protocol):
    """Claims trajectory steps and shares their results."""

    def claim(self, tenant: str, trajectory_id: str, step: int, request_id: str) -> bool:
        """True if this request may run the step (nobody claimed it before)."""
        ...

    def release(self, tenant: str, trajectory_id: str, step: int) -> None:
        """Give the step up (the command could not be started at all)."""
        ...

    def record(self, tenant: str, trajectory_id: str, recorded: RecordedStep) -> None:
        """Keep the step's result for the requests that wait on it."""
        ...

    def wait(
        self, tenant: str, trajectory_id: str, step: int, timeout_s: float
    ) -> RecordedStep | None:
        """The result of a step someone else claimed, once it is recorded (None if it
        is not within ``timeout_s``)."""
        ...
