"""Placement never oversubscribes a node and prefers nodes holding the image."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from app.domain.base import RejectReason
from app.domain.placement import Allocation, NodeView, Placement, SandboxMax


def node(
    node_id: str,
    sandboxes: int = 10,
    cpus: float = 4,
    memory: int = 4096,
    images: frozenset[str] = frozenset(),
) -> NodeView:
    return NodeView(node_id, f"node.{node_id}", sandboxes, cpus, memory, images)


def test_no_nodes_is_its_own_reason() -> None:
    assert Placement().place("sb-1", "img", 1, 128) == RejectReason.NO_NODES


def test_prefers_node_with_image() -> None:
    placement = Placement()
    placement.upsert_node(node("a"))
    placement.upsert_node(node("b", images=frozenset({"img"})))
    placed = placement.place("sb-1", "img", 1, 128)
    assert isinstance(placed, Allocation) and placed.node_id == "b"


def test_release_frees_room() -> None:
    placement = Placement()
    placement.upsert_node(node("a", sandboxes=1))
    assert isinstance(placement.place("sb-1", "img", 1, 128), Allocation)
    assert placement.place("sb-2", "img", 1, 128) == RejectReason.CAPACITY
    placement.release("sb-1")
    assert isinstance(placement.place("sb-2", "img", 1, 128), Allocation)


def test_lost_node_gets_nothing_and_reports_its_sandboxes() -> None:
    placement = Placement()
    placement.upsert_node(node("a"))
    placement.place("sb-1", "img", 1, 128)
    assert placement.mark_lost("a") == ["sb-1"]
    assert placement.place("sb-2", "img", 1, 128) == RejectReason.NO_NODES


@given(
    st.lists(
        st.tuples(st.floats(0.1, 4), st.integers(16, 2048), st.booleans()), min_size=1, max_size=200
    )
)
def test_capacity_is_never_exceeded(ops: list[tuple[float, int, bool]]) -> None:
    placement = Placement()
    for name in ("a", "b", "c"):
        placement.upsert_node(node(name, sandboxes=5, cpus=6, memory=4096))
    live: list[str] = []
    for i, (cpus, memory, release) in enumerate(ops):
        if release and live:
            placement.release(live.pop(0))
        elif isinstance(placement.place(f"sb-{i}", "img", cpus, memory), Allocation):
            live.append(f"sb-{i}")
        for view in placement.nodes.values():
            assert view.used_sandboxes <= view.capacity_sandboxes
            assert view.used_cpus <= view.capacity_cpus + 1e-6
            assert view.used_memory_mb <= view.capacity_memory_mb


def test_a_sandbox_no_host_can_hold_is_invalid_not_waiting_for_room() -> None:
    placement = Placement()
    small = node("a", cpus=64)
    small.max_sandbox = SandboxMax(cpus=2, memory_mb=4000, pids=8192)
    big = node("b", cpus=64)
    big.max_sandbox = SandboxMax(cpus=8, memory_mb=4000, pids=8192)
    placement.upsert_node(small)
    placement.upsert_node(big)
    # More than every host: invalid, whatever room there is
    assert placement.place("sb-1", "img", 16, 128) == RejectReason.INVALID
    assert placement.place("sb-2", "img", 1, 128, pids=65_536) == RejectReason.INVALID
    # More than one host but not the other: placed on the one that can
    placed = placement.place("sb-3", "img", 4, 128)
    assert isinstance(placed, Allocation) and placed.node_id == "b"
    assert placement.largest_sandbox() == SandboxMax(8, 4000, 8192)


@given(
    st.lists(
        st.tuples(st.integers(0, 30), st.sampled_from(["a", "b", "c", None])),
        min_size=1,
        max_size=300,
    )
)
def test_what_is_placed_on_a_node_is_what_its_allocations_say(
    ops: list[tuple[int, str | None]],
) -> None:
    # Given assignments (to a node, again to another) and releases in any order
    placement = Placement()
    for name in ("a", "b", "c"):
        placement.upsert_node(node(name, sandboxes=100))
    for number, node_id in ops:
        if node_id is None:
            placement.release(f"sb-{number}")
        else:
            placement.assign(f"sb-{number}", node_id, 1, 16)
        # Then each node's share, read from the index, is the allocations' own
        for name in ("a", "b", "c"):
            expected = {a.sandbox_id for a in placement.allocations.values() if a.node_id == name}
            assert placement.placed_on(name) == expected
            assert sorted(placement.mark_lost(name)) == sorted(expected)
