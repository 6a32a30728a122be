"""What a node keeps beyond its process, as its handlers see it: the claims that make
each command run once (:class:`ClaimStore`) and the guard of trajectory steps
(:class:`StepStore`), and the sandboxes' direct routes (:class:`RouteStore`).

The node's worker keeps them in Redis (:mod:`workers.redis_state`, built by
``workers/main.py``); unit tests keep them in memory (:mod:`workers.memory_state`).
What each call guarantees is written on the Redis adapter, which is the reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from app.domain.direct import SandboxKey
from app.domain.requests import Exec
from app.domain.trajectory import RecordedStep


class ClaimStore(Protocol):
    """A node's exec claims, its commands in flight and the tasks it is doing."""

    def claim(self, request: Exec, reply_key: bytes | None) -> bool:
        """True the first time ``request`` is seen; it is then in flight until
        :meth:`answered`."""
        ...

    def claim_many(self, commands: list[tuple[Exec, bytes | None]]) -> list[bool]:
        """:meth:`claim` for each command (with its reply key), at once."""
        ...

    def answered(self, scope: str) -> None:
        """The command or task of the request of ``scope`` was answered."""
        ...

    def answered_many(self, scopes: list[str]) -> None:
        """:meth:`answered` for each of ``scopes``, at once."""
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


@dataclass(frozen=True)
class DirectRoute:
    """A sandbox's direct route as its node holds it (app/domain/direct.py)."""

    key: SandboxKey
    #: Why the sandbox ended, once it has (kept a while, so its trainer is told).
    ended: str | None = None
    #: Frozen: its commands are refused until it is thawed.
    frozen: bool = False


class RouteStore(Protocol):
    """The node's sandbox keys and the credentials it was told are revoked."""

    def keep(self, sandbox_id: str, key: SandboxKey) -> None:
        """The direct route of a sandbox created here."""
        ...

    def route(self, sandbox_id: str) -> DirectRoute | None:
        """The sandbox's route, if it has one here."""
        ...

    def frozen(self, sandbox_id: str, frozen: bool) -> None:
        """The sandbox was frozen (or thawed)."""
        ...

    def ended(self, sandbox_id: str, why: str) -> None:
        """The sandbox ended: its route answers so for a while, then is forgotten."""
        ...

    def revoke(self, key_ids: list[str]) -> None:
        """Credentials revoked: keys derived from them prove nothing any more."""
        ...

    def revoked(self) -> frozenset[str]:
        """Every credential this node was told is revoked."""
        ...
