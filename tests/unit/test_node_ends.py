"""A node states a sandbox's end once, and none for an orphan (issue 23, item 11: a
life ends once, avoided at the source where cheap)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.domain.events import SandboxStopped
from app.domain.lives import RECONCILER
from app.domain.requests import DestroySandbox
from workers.containers import label
from workers.containers.memory_driver import InMemoryDriver
from workers.containers.port import container_name
from workers.lifecycle import Lifecycle
from workers.memory_state import InMemoryRoutes


class _Agents:
    def unregister(self, sandbox_id: str) -> None:
        pass


class _Deadlines:
    def cancel(self, sandbox_id: str) -> None:
        pass


@dataclass
class _Courier:
    events: list[Any] = field(default_factory=list)
    replies: list[Any] = field(default_factory=list)

    def event(self, event: Any) -> None:
        self.events.append(event)

    def reply(self, reply_to: Any, reply: Any) -> None:
        self.replies.append(reply)


@dataclass
class _Node:
    """Just what a sandbox's end needs of its node."""

    tmp: Path
    node_id: str = "n0"
    driver: InMemoryDriver = field(default_factory=lambda: InMemoryDriver(["img"]))
    agents: _Agents = field(default_factory=_Agents)
    courier: _Courier = field(default_factory=_Courier)
    answers: Any = None
    deadlines: _Deadlines = field(default_factory=_Deadlines)
    activity: dict[str, Any] = field(default_factory=dict)
    routes: InMemoryRoutes = field(default_factory=InMemoryRoutes)
    egress: None = None
    ports: None = None

    def run_dir(self, sandbox_id: str) -> Path:
        return self.tmp / sandbox_id

    @contextlib.contextmanager
    def busy(self, sandbox_id: str) -> Iterator[None]:
        yield

    def mark_busy(self, sandbox_id: str) -> bool:
        return True

    def release(self, sandbox_id: str) -> None:
        pass


def _running(tmp_path: Path, sandbox_id: str) -> _Node:
    node = _Node(tmp_path)
    node.driver.add(container_name(sandbox_id), "img", {label.SANDBOX_ID: sandbox_id})
    return node


def test_a_destroy_ends_the_sandbox_once(tmp_path: Path) -> None:
    node = _running(tmp_path, "sb-1")
    ends = Lifecycle(node)  # type: ignore[arg-type]
    destroy = DestroySandbox(sandbox_id="sb-1", tenant="t", actor="t/k")
    ends.destroy(destroy)
    ends.destroy(destroy)  # redelivered: the container is gone
    stops = [e for e in node.courier.events if isinstance(e, SandboxStopped)]
    assert [s.payload.detail for s in stops] == ["destroyed by t/k"]


def test_an_orphan_is_removed_without_stating_an_end(tmp_path: Path) -> None:
    # Given a container the scheduler found no open life for (its life ended already)
    node = _running(tmp_path, "sb-orphan")
    # When the reconciler's destroy reaches the node
    destroy = DestroySandbox(sandbox_id="sb-orphan", tenant="system", actor=RECONCILER)
    Lifecycle(node).destroy(destroy)  # type: ignore[arg-type]
    # Then the container is gone and no second end is stated
    assert node.driver.get("sb-orphan") is None
    assert node.courier.events == []
