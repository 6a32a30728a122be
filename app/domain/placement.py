"""Placement: which node gets a sandbox. Pure bookkeeping, no I/O.

A node's declared capacity (sandboxes, CPUs, memory) is never oversubscribed: the
scheduler counts its own allocations rather than trusting heartbeats, which lag.
Among nodes with room, one that already holds the image wins, then the least loaded.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Protocol

from app.domain.base import RejectReason


class NodeCapacity(Protocol):
    """What a node declares: a heartbeat's payload and a ``nodes`` row both have it."""

    @property
    def queue(self) -> str: ...
    @property
    def capacity_sandboxes(self) -> int: ...
    @property
    def capacity_cpus(self) -> float: ...
    @property
    def capacity_memory_mb(self) -> int: ...
    @property
    def images(self) -> Iterable[str]: ...


@dataclass(frozen=True)
class SandboxMax:
    """The most one sandbox may have on a host: its cores, its memory less a reserve,
    a share of its pid_max (a request beyond them would be a limit the host cannot
    keep)."""

    cpus: float
    memory_mb: int
    pids: int

    @classmethod
    def declared(cls, node: object) -> SandboxMax | None:
        """From a heartbeat's payload; None for a node that did not say."""
        cpus = getattr(node, "max_sandbox_cpus", None)
        memory = getattr(node, "max_sandbox_memory_mb", None)
        pids = getattr(node, "max_sandbox_pids", None)
        if cpus is None or memory is None or pids is None:
            return None
        return cls(float(cpus), int(memory), int(pids))

    def allows(self, cpus: float, memory_mb: int, pids: int) -> bool:
        """Within every maximum."""
        return cpus <= self.cpus + 1e-9 and memory_mb <= self.memory_mb and pids <= self.pids


@dataclass
class NodeView:
    """What the scheduler knows of one node."""

    node_id: str
    queue: str
    capacity_sandboxes: int
    capacity_cpus: float
    capacity_memory_mb: int
    images: frozenset[str] = frozenset()
    alive: bool = True
    #: Heard from since the scheduler started (recovered nodes are not, until then).
    confirmed: bool = True
    last_seen: datetime | None = None
    used_sandboxes: int = 0
    used_cpus: float = 0.0
    used_memory_mb: int = 0
    #: What one sandbox may have on this host (None: not declared).
    max_sandbox: SandboxMax | None = None

    @classmethod
    def declared(
        cls, node_id: str, node: NodeCapacity, last_seen: datetime, *, confirmed: bool = True
    ) -> NodeView:
        """The view of a node as it declares itself (no allocations counted yet)."""
        return cls(
            node_id=node_id,
            queue=node.queue,
            capacity_sandboxes=node.capacity_sandboxes,
            capacity_cpus=node.capacity_cpus,
            capacity_memory_mb=node.capacity_memory_mb,
            images=frozenset(node.images),
            last_seen=last_seen,
            confirmed=confirmed,
            max_sandbox=SandboxMax.declared(node),
        )

    @property
    def placeable(self) -> bool:
        """Alive and heard from since the scheduler started: sandboxes may go here."""
        return self.alive and self.confirmed

    def allows(self, cpus: float, memory_mb: int, pids: int) -> bool:
        """Whether this host can give one sandbox that much at all."""
        return self.max_sandbox is None or self.max_sandbox.allows(cpus, memory_mb, pids)

    def fits(self, cpus: float, memory_mb: int) -> bool:
        """Room for one more sandbox of this size."""
        return (
            self.placeable
            and self.used_sandboxes + 1 <= self.capacity_sandboxes
            and self.used_cpus + cpus <= self.capacity_cpus + 1e-9
            and self.used_memory_mb + memory_mb <= self.capacity_memory_mb
        )


@dataclass(frozen=True)
class Allocation:
    """A sandbox's share of a node."""

    sandbox_id: str
    node_id: str
    cpus: float
    memory_mb: int
    tenant: str = "unknown"
    job_id: str = "default"


@dataclass
class Placement:
    """Nodes and the sandboxes placed on them."""

    nodes: dict[str, NodeView] = field(default_factory=dict)
    allocations: dict[str, Allocation] = field(default_factory=dict)
    per_tenant: dict[str, int] = field(default_factory=dict)
    #: The allocations' sandbox ids by node: a heartbeat's check and a lost node's
    #: sweep read one node's share, not every allocation of the unit (380,000 of them).
    by_node: dict[str, set[str]] = field(default_factory=dict)

    def upsert_node(self, view: NodeView) -> None:
        """Learn of a node or refresh its capacity, keeping what is allocated on it."""
        old = self.nodes.get(view.node_id)
        if old is not None:
            view.used_sandboxes = old.used_sandboxes
            view.used_cpus = old.used_cpus
            view.used_memory_mb = old.used_memory_mb
        self.nodes[view.node_id] = view

    def mark_lost(self, node_id: str) -> list[str]:
        """The node is gone; return the sandboxes that were on it."""
        node = self.nodes.get(node_id)
        if node is not None:
            node.alive = False
        return list(self.by_node.get(node_id, ()))

    def place(
        self,
        sandbox_id: str,
        image: str,
        cpus: float,
        memory_mb: int,
        tenant: str = "unknown",
        job_id: str = "default",
        pids: int = 0,
    ) -> Allocation | RejectReason:
        """Reserve room for a sandbox, or say why there is none: ``INVALID`` when no
        live node could ever give one sandbox that much (waiting would not help)."""
        if sandbox_id in self.allocations:
            return self.allocations[sandbox_id]
        # One pass over the nodes (this runs for every create, over hundreds of nodes).
        alive = able = False
        best: NodeView | None = None
        best_key: tuple[bool, float, str] | None = None
        for n in self.nodes.values():
            if not n.placeable:
                continue
            alive = True
            if not n.allows(cpus, memory_mb, pids):
                continue
            able = True
            if not n.fits(cpus, memory_mb):
                continue
            key = (
                image not in n.images,
                n.used_sandboxes / max(n.capacity_sandboxes, 1),
                n.node_id,
            )
            if best_key is None or key < best_key:
                best, best_key = n, key
        if best is None:
            if not alive:
                return RejectReason.NO_NODES
            return RejectReason.CAPACITY if able else RejectReason.INVALID
        return self.assign(sandbox_id, best.node_id, cpus, memory_mb, tenant, job_id)

    def assign(
        self,
        sandbox_id: str,
        node_id: str,
        cpus: float,
        memory_mb: int,
        tenant: str = "unknown",
        job_id: str = "default",
    ) -> Allocation:
        """Record an allocation (also used when recovering state from the log)."""
        earlier = self.allocations.get(sandbox_id)
        if earlier is not None and earlier.node_id != node_id:
            self._unindex(earlier)
        node = self.nodes.get(node_id)
        if node is not None:
            node.used_sandboxes += 1
            node.used_cpus += cpus
            node.used_memory_mb += memory_mb
        allocation = Allocation(sandbox_id, node_id, cpus, memory_mb, tenant, job_id)
        self.allocations[sandbox_id] = allocation
        self.by_node.setdefault(node_id, set()).add(sandbox_id)
        self.per_tenant[tenant] = self.per_tenant.get(tenant, 0) + 1
        return allocation

    def release(self, sandbox_id: str) -> Allocation | None:
        """Free a sandbox's share; unknown ids are ignored."""
        allocation = self.allocations.pop(sandbox_id, None)
        if allocation is not None:
            self.per_tenant[allocation.tenant] -= 1
            self._unindex(allocation)
        if allocation is not None and allocation.node_id in self.nodes:
            node = self.nodes[allocation.node_id]
            node.used_sandboxes -= 1
            node.used_cpus -= allocation.cpus
            node.used_memory_mb -= allocation.memory_mb
        return allocation

    def largest_sandbox(self) -> SandboxMax | None:
        """The most any live node allows one sandbox (for a refusal to say)."""
        declared = [
            n.max_sandbox for n in self.nodes.values()
            if n.placeable and n.max_sandbox is not None
        ]  # fmt: skip
        if not declared:
            return None
        return SandboxMax(
            max(m.cpus for m in declared),
            max(m.memory_mb for m in declared),
            max(m.pids for m in declared),
        )

    def tenant_sandboxes(self, tenant: str) -> int:
        """Live sandboxes of a tenant (for quotas)."""
        return self.per_tenant.get(tenant, 0)

    def placed_on(self, node_id: str) -> set[str]:
        """Sandboxes allocated on a node (a copy: the caller may change it)."""
        return set(self.by_node.get(node_id, ()))

    def _unindex(self, allocation: Allocation) -> None:
        held = self.by_node.get(allocation.node_id)
        if held is not None:
            held.discard(allocation.sandbox_id)
            if not held:
                del self.by_node[allocation.node_id]

    def node_of(self, sandbox_id: str) -> NodeView | None:
        """The node a live sandbox is on."""
        allocation = self.allocations.get(sandbox_id)
        return self.nodes.get(allocation.node_id) if allocation else None
