"""The node of this worker process (one per process: the threads pool shares it)."""

from __future__ import annotations

from workers.handlers import Node

_node: Node | None = None


def install(node: Node) -> None:
    """Make ``node`` the one the tasks use."""
    global _node
    _node = node


def node() -> Node:
    """The node the tasks use."""
    if _node is None:
        raise RuntimeError("the node runtime is not installed (run through `dsec run worker`)")
    return _node
