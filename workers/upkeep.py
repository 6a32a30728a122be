"""The node's background duties: heartbeats, TTL reaping and reconciliation.

Every few seconds the node compares what Podman runs with what it should: a
container that exited is stopped in the log with the reason Podman gives (OOM or
failure), one whose cgroup saw an OOM kill is ended (oom), an expired one is reaped
(ttl), and a live one gets its agent listener back after a worker restart. Cgroups
left without a container are removed. Then it tells the scheduler its load.
"""

from __future__ import annotations

import logging
import os
import threading

from app.domain.base import StopReason
from app.domain.events import NodeHeartbeat, NodePayload, NodeRegistered
from workers.handlers import LABEL_JOB, LABEL_TENANT, Node, expired

log = logging.getLogger(__name__)

HEARTBEAT_S = 5.0
#: Podman states of a container whose process has ended.
ENDED_STATES = frozenset({"exited", "stopped", "dead"})


def _capacity(node: Node) -> tuple[float, int]:
    s = node.settings
    cpus = s.node_capacity_cpus or float(os.cpu_count() or 1) * 8  # sandboxes idle mostly
    memory = s.node_capacity_memory_mb or (
        os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1 << 20) * 4
    )
    return cpus, int(memory)


def payload(node: Node, running: int) -> NodePayload:
    """The node's capacity and load as a heartbeat carries it."""
    cpus, memory = _capacity(node)
    try:
        images = sorted(node.driver.list_images())
    except Exception:
        images = []
    return NodePayload(
        capacity_sandboxes=node.settings.node_capacity_sandboxes,
        capacity_cpus=cpus,
        capacity_memory_mb=memory,
        running=running,
        images=images,
        queue=node.settings.node_queue(node.node_id),
    )


def reconcile(node: Node) -> int:
    """Make Podman and the log agree; return how many sandboxes run."""
    # Listed before the containers: a cgroup made by a create that finishes meanwhile
    # then either has its container listed or is busy; and rmdir refuses a cgroup that
    # still holds processes, so the sweep can never empty a live sandbox.
    leftovers = set(node.driver.cgroup_sandbox_ids())
    running = 0
    for box in node.driver.list_sandboxes():
        leftovers.discard(box.sandbox_id)
        if node.is_busy(box.sandbox_id):
            running += 1
            continue
        tenant = box.labels.get(LABEL_TENANT, "unknown")
        job = box.labels.get(LABEL_JOB, "default")
        if box.running and expired(box.labels):
            node.stop(box.sandbox_id, tenant, job, StopReason.TTL, "time to live reached")
        elif box.running and box.oom_killed:
            node.stop(box.sandbox_id, tenant, job, StopReason.OOM, "out of memory (OOM kill)")
        elif box.state in ENDED_STATES:
            reason = StopReason.OOM if box.oom_killed else StopReason.FAILED
            node.stop(
                box.sandbox_id,
                tenant,
                job,
                reason,
                f"container exited with {box.exit_code}"
                + (" (OOM killed)" if box.oom_killed else ""),
            )
        elif not box.running:
            # Created or initialised but not started: a create that finished after
            # the list was taken (it is no longer busy). Judged next round.
            running += 1
        else:
            running += 1
            if not node.agents.is_registered(box.sandbox_id):
                # After a worker restart: listen again, the agent calls back.
                node.agents.register(box.sandbox_id, node.run_dir(box.sandbox_id))
    for sandbox_id in sorted(leftovers):
        if not node.is_busy(sandbox_id) and node.driver.remove_cgroups(sandbox_id):
            log.info("removed leftover cgroups of %s", sandbox_id)
    return running


class Upkeep(threading.Thread):
    """Runs :func:`reconcile` and sends a heartbeat every few seconds."""

    def __init__(self, node: Node, interval_s: float = HEARTBEAT_S) -> None:
        super().__init__(name="dsec-upkeep", daemon=True)
        self.node = node
        self.interval_s = interval_s
        self.stopping = threading.Event()

    def run(self) -> None:
        first = True
        while not self.stopping.is_set():
            try:
                running = reconcile(self.node)
                cls = NodeRegistered if first else NodeHeartbeat
                self.node.outlet.event(
                    cls(node_id=self.node.node_id, payload=payload(self.node, running))
                )
                self.node.outlet.flush()
                first = False
            except Exception:
                log.exception("upkeep round failed")
            self.stopping.wait(self.interval_s)
