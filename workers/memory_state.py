"""The node's claims and step guard in memory (:mod:`workers.state_port`), for unit
tests of the node's handlers without Redis. One process's memory is all they share:
unlike Redis, they neither outlive the worker nor are seen by another, and nothing
expires (a test lives shorter than any claim's TTL).
"""

from __future__ import annotations

import threading
from dataclasses import replace

from app.domain.direct import SandboxKey
from app.domain.requests import Exec
from app.domain.trajectory import RecordedStep
from workers.state_port import DirectRoute


class InMemoryClaims:
    """Claims of one node; thread-safe (one lock, as Redis runs one command at a time)."""

    def __init__(self) -> None:
        self._claimed: set[str] = set()
        self._in_flight: dict[str, tuple[Exec, bytes | None]] = {}
        self._tasks: dict[str, tuple[str, list[str]]] = {}
        self._lock = threading.Lock()

    def claim(self, request: Exec, reply_key: bytes | None) -> bool:
        """True the first time ``request``'s scope is seen."""
        with self._lock:
            if request.scope in self._claimed:
                return False
            self._claimed.add(request.scope)
            self._in_flight[request.scope] = (request, reply_key)
            return True

    def claim_many(self, commands: list[tuple[Exec, bytes | None]]) -> list[bool]:
        """:meth:`claim` for each command, in order."""
        return [self.claim(request, key) for request, key in commands]

    def answered(self, scope: str) -> None:
        """No longer in flight (the claim stays: the command never runs again)."""
        with self._lock:
            self._in_flight.pop(scope, None)
            self._tasks.pop(scope, None)

    def answered_many(self, scopes: list[str]) -> None:
        """:meth:`answered` for each of ``scopes``."""
        for scope in scopes:
            self.answered(scope)

    def hold(self, scope: str, task: str, args: list[str]) -> None:
        """Keep the task until :meth:`answered`."""
        with self._lock:
            self._tasks[scope] = (task, list(args))

    def held(self) -> list[tuple[str, tuple[str, list[str]]]]:
        """Tasks held and not answered."""
        with self._lock:
            return list(self._tasks.items())

    def unanswered(self) -> list[tuple[str, tuple[Exec, bytes | None]]]:
        """Commands claimed and not answered."""
        with self._lock:
            return list(self._in_flight.items())


class InMemoryStepGuard:
    """Trajectory steps' claims and results; thread-safe. A waiter wakes when a
    result is recorded, instead of polling as the Redis guard does."""

    def __init__(self) -> None:
        self._claims: dict[tuple[str, str, int], str] = {}
        self._results: dict[tuple[str, str, int], RecordedStep] = {}
        self._changed = threading.Condition()

    def claim(self, tenant: str, trajectory_id: str, step: int, request_id: str) -> bool:
        """True if nobody claimed the step before."""
        key = (tenant, trajectory_id, step)
        with self._changed:
            if key in self._claims:
                return False
            self._claims[key] = request_id
            return True

    def release(self, tenant: str, trajectory_id: str, step: int) -> None:
        """The step may be claimed again."""
        with self._changed:
            self._claims.pop((tenant, trajectory_id, step), None)

    def record(self, tenant: str, trajectory_id: str, recorded: RecordedStep) -> None:
        """Keep the step's result and wake its waiters."""
        with self._changed:
            self._results[(tenant, trajectory_id, recorded.step)] = recorded
            self._changed.notify_all()

    def wait(
        self, tenant: str, trajectory_id: str, step: int, timeout_s: float
    ) -> RecordedStep | None:
        """The step's result once recorded, None after ``timeout_s`` without one."""
        key = (tenant, trajectory_id, step)
        with self._changed:
            self._changed.wait_for(lambda: key in self._results, timeout=timeout_s)
            return self._results.get(key)


class InMemoryRoutes:
    """Direct routes and revocations of one node, in memory; thread-safe."""

    def __init__(self) -> None:
        self._routes: dict[str, DirectRoute] = {}
        self._revoked: frozenset[str] = frozenset()
        self._lock = threading.Lock()

    def keep(self, sandbox_id: str, key: SandboxKey) -> None:
        with self._lock:
            self._routes[sandbox_id] = DirectRoute(key)

    def route(self, sandbox_id: str) -> DirectRoute | None:
        with self._lock:
            return self._routes.get(sandbox_id)

    def frozen(self, sandbox_id: str, frozen: bool) -> None:
        with self._lock:
            found = self._routes.get(sandbox_id)
            if found is not None:
                self._routes[sandbox_id] = replace(found, frozen=frozen)

    def ended(self, sandbox_id: str, why: str) -> None:
        with self._lock:
            found = self._routes.get(sandbox_id)
            if found is not None:
                self._routes[sandbox_id] = replace(found, ended=why)

    def revoke(self, key_ids: list[str]) -> None:
        with self._lock:
            self._revoked |= frozenset(key_ids)

    def revoked(self) -> frozenset[str]:
        with self._lock:
            return self._revoked
