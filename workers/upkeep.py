"""The node's background duties: heartbeats, TTL reaping and reconciliation.

Every few seconds the node compares what Podman runs with what it should: a
container that exited is stopped in the log with the reason Podman gives (OOM or
failure), one whose cgroup saw an OOM kill is ended (oom; once a command in flight
there has been answered, for a little while at most), an expired one is reaped
(ttl), and a live one gets its agent listener back after a worker restart. Cgroups
left without a container are removed, and so are the agent listener and run directory
of a sandbox whose container vanished behind the node's back (the scheduler ends it in
the log: it no longer appears in heartbeats). Warm-pool containers are the pool's
business (:meth:`WarmPool.check`) and are no sandboxes: heartbeats leave them out.

Heartbeats go out on their own clock, from a thread that never waits for Podman: a
round's length grows with the node's sandboxes (listing 2,000 containers takes ~2 s
here, several times that while Podman is busy removing), and a node whose heartbeats
waited for it was declared lost (no heartbeat for 20 s) with 2,000 healthy sandboxes.
The sandbox list a heartbeat carries is not a listing either: a listing is as old as
its round, and the scheduler compares it with what it knows when the heartbeat
arrives, so two slow rounds in a row "lost" sandboxes started after their listings
(33 of 1,000 here). It is the node's own view at sending time (:func:`held`): the
sandboxes whose agent it listens for (registered when a create begins, dropped when
a sandbox ends, and by the reconciler when a container vanished) plus those in a
transition, minus warm slots. Until the first round has re-registered what runs
(after a worker restart) heartbeats carry no list (``None``, "not reported").
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

from app.domain.base import StopReason
from app.domain.events import NodeHeartbeat, NodePayload, NodeRegistered
from workers.containers import label
from workers.deadlines import Due
from workers.handlers import Node

log = logging.getLogger(__name__)

HEARTBEAT_S = 5.0
#: How often a node that holds no sandbox looks at Podman. Only its warm pool's
#: containers (and whatever was started behind its back) are there to check, and a
#: listing of containers and images costs the Podman service and the worker ~0.15 % of
#: a core every 5 s; the first sandbox a node holds brings the rounds back to every
#: :data:`HEARTBEAT_S` within one of them.
IDLE_ROUND_S = 15.0
#: Rounds start at least this many times their own length apart. A round's listing
#: grows with the node's containers: 1,000 cost the Podman service ~0.9 s of CPU here
#: (~2 s for 2,000), so rounds every 5 s took 20-40 % of a core from the commands and
#: creates of a full node. Spaced by their length, rounds cost Podman at most a tenth
#: of a core; what they find (a container that exited, an OOM kill in a background
#: process, a leftover cgroup) is found that much later on a full node: ~20 s at
#: 2,000 sandboxes instead of ~7. Commands to a dead container fail at once anyway
#: (its agent's connection breaks), and deadlines have a thread of their own.
ROUND_SPACING = 10.0
#: Longest pause between rounds, however slow the last one was: a listing made while
#: Podman removes a thousand containers can take 15 s, and what a round finds (an
#: exited container, billed until the node ends it) must not wait minutes for it.
ROUND_PAUSE_MAX_S = 30.0
#: Podman states of a container whose process has ended.
ENDED_STATES = frozenset({"exited", "stopped", "dead"})
#: Longest the reconciler leaves a running sandbox the OOM killer hit to a command in
#: flight there: the killed command's answer (exit -9) goes to its trainer first, and
#: the exec path ends the sandbox right after it.
OOM_ANSWER_GRACE_S = 10.0


def _host_memory_mb() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1 << 20)


def _pid_max() -> int:
    try:
        return int(Path("/proc/sys/kernel/pid_max").read_text())
    except (OSError, ValueError):
        return 32_768


def _usable_memory_mb(node: Node) -> int:
    """The host's memory less what the node keeps for itself."""
    return max(0, _host_memory_mb() - node.settings.node_memory_reserve_mb)


def _capacity(node: Node) -> tuple[float, int]:
    """What the node promises in all: its host times the configured overcommit."""
    s = node.settings
    cpus = s.node_capacity_cpus or float(os.cpu_count() or 1) * s.node_cpu_overcommit
    memory = s.node_capacity_memory_mb or _usable_memory_mb(node) * s.node_memory_overcommit
    return cpus, int(memory)


def _sandbox_max(node: Node) -> tuple[float, int, int]:
    """The most one sandbox may have: the host's cores, its memory less the reserve,
    a share of its pid_max (a limit beyond them is one the host could not keep)."""
    share = node.settings.node_pids_share
    return float(os.cpu_count() or 1), _usable_memory_mb(node), int(_pid_max() * share)


def held(node: Node) -> list[str]:
    """The sandboxes the node runs or is creating, as it knows them now."""
    ids = node.agents.registered() | node.busy_ids()
    if node.warm is not None:
        ids -= node.warm.slot_ids()
    return sorted(ids)


def payload(node: Node, sandboxes: list[str] | None, images: list[str]) -> NodePayload:
    """The node's capacity and load as a heartbeat carries it."""
    cpus, memory = _capacity(node)
    max_cpus, max_memory, max_pids = _sandbox_max(node)
    running = len(sandboxes if sandboxes is not None else held(node))
    node.tally.sandboxes(running)
    if node.warm is not None:
        for image in node.warm.sizes:
            node.tally.warm_ready(image, node.warm.ready(image))
    return NodePayload(
        max_sandbox_cpus=max_cpus,
        max_sandbox_memory_mb=max_memory,
        max_sandbox_pids=max_pids,
        capacity_sandboxes=node.settings.node_capacity_sandboxes,
        capacity_cpus=cpus,
        capacity_memory_mb=memory,
        running=running,
        images=images,
        queue=node.settings.node_queue(node.node_id),
        sandboxes=sandboxes,
    )


def reconcile(node: Node) -> list[str]:
    """Make Podman and the log agree; return the sandboxes the node runs or creates."""
    # Listed before the containers: a cgroup made by a create that finishes meanwhile
    # then either has its container listed or is busy; and rmdir refuses a cgroup that
    # still holds processes, so the sweep can never empty a live sandbox. The same
    # holds for agent listeners: one registered before the listing whose sandbox is
    # neither listed nor busy (before or after it) lost its container.
    leftovers = set(node.driver.cgroup_sandbox_ids())
    listening = node.agents.registered()
    busy_before = node.busy_ids()
    listed_at = time.monotonic()
    live: set[str] = set()
    for box in node.driver.list_sandboxes():
        leftovers.discard(box.sandbox_id)
        listening.discard(box.sandbox_id)
        if box.warm:
            if node.warm is not None:
                node.warm.check(box)
            continue
        # Busy before the listing too: a create that finished while it ran is listed
        # as it was then (created, "configured"), not as it is.
        if box.sandbox_id in busy_before or node.is_busy(box.sandbox_id):
            live.add(box.sandbox_id)
            continue
        if node.ended_after(box.sandbox_id, listed_at):
            # Listed as it was before a transition that ended meanwhile: a destroy
            # unregistered its listener (re-registering it put a removed sandbox in every
            # heartbeat until the next round) and stated its end. The next round sees
            # it as it is.
            if node.agents.is_registered(box.sandbox_id):
                live.add(box.sandbox_id)
            continue
        labels = node.warm.labels_of(box) if node.warm is not None else box.labels
        tenant = labels.get(label.TENANT, "unknown")
        job = labels.get(label.JOB, "default")
        deadline = label.expires_at(labels)
        if box.running and deadline is not None and deadline <= datetime.now(UTC):
            # Missed by the deadlines thread (the worker was down): billed to the deadline.
            node.lifecycle.stop(
                box.sandbox_id, tenant, job, StopReason.TTL, "time to live reached",
                ended_at=deadline,
            )  # fmt: skip
        elif box.running and box.oom_killed and _answer_first(node, box.sandbox_id):
            live.add(box.sandbox_id)
        elif box.running and box.oom_killed:
            node.lifecycle.stop(
                box.sandbox_id, tenant, job, StopReason.OOM, "out of memory (OOM kill)"
            )
        elif box.state in ENDED_STATES:
            reason = StopReason.OOM if box.oom_killed else StopReason.FAILED
            node.lifecycle.stop(
                box.sandbox_id,
                tenant,
                job,
                reason,
                f"container exited with {box.exit_code}"
                + (" (OOM killed)" if box.oom_killed else ""),
            )
        else:
            live.add(box.sandbox_id)
            if not node.agents.is_registered(box.sandbox_id):
                # After a worker restart: listen again, the agent calls back.
                env = node.warm.env_of(box) if node.warm is not None else {}
                node.agents.register(box.sandbox_id, node.run_dir(box.sandbox_id), env)
            if deadline is not None and not node.deadlines.is_watched(box.sandbox_id):
                node.deadlines.watch(Due(deadline, box.sandbox_id, tenant, job))
    # A warm container being made is nobody's transition but the pool's own.
    busy = busy_before | node.busy_ids()
    warm = node.warm
    for sandbox_id in sorted(leftovers - busy):
        if (warm is None or not warm.owns(sandbox_id)) and node.driver.remove_cgroups(sandbox_id):
            log.info("removed leftover cgroups of %s", sandbox_id)
    for sandbox_id in sorted(listening - busy):
        if warm is None or not warm.owns(sandbox_id):
            log.info("container of %s vanished: dropping its listener", sandbox_id)
            node.agents.unregister(sandbox_id)
            shutil.rmtree(node.run_dir(sandbox_id), ignore_errors=True)
    if warm is not None:
        warm.forget(live | busy)
    return sorted(live | node.busy_ids())


def _answer_first(node: Node, sandbox_id: str) -> bool:
    """True while a sandbox the OOM killer hit is left to the command in flight there
    (the one killed, most likely) for up to :data:`OOM_ANSWER_GRACE_S`. Stopped here at
    once, the sandbox took the agent down before the command's answer was read, and the
    trainer got "sandbox not running" instead of its command's -9."""
    now = time.monotonic()
    for other, seen in list(node.oom_seen.items()):
        if now - seen > 2 * OOM_ANSWER_GRACE_S:
            del node.oom_seen[other]  # ended since, or stopped below
    if not node.commands.running_in(sandbox_id):
        return False
    return now - node.oom_seen.setdefault(sandbox_id, now) < OOM_ANSWER_GRACE_S


def pause_after(round_s: float, interval_s: float) -> float:
    """How long the reconciler waits after a round that took ``round_s``: the rest of
    ``interval_s``, at least 1 s, and long enough that rounds start at least
    :data:`ROUND_SPACING` times their length apart, but never more than
    :data:`ROUND_PAUSE_MAX_S`."""
    spaced = min(ROUND_PAUSE_MAX_S, round_s * (ROUND_SPACING - 1))
    return max(1.0, interval_s - round_s, spaced)


class Upkeep(threading.Thread):
    """Sends a heartbeat every few seconds; a second thread runs :func:`reconcile`
    rounds, one every ``interval_s`` (further apart when rounds are slow: see
    :func:`pause_after`), or every :data:`IDLE_ROUND_S` while the node holds no
    sandbox."""

    def __init__(self, node: Node, interval_s: float = HEARTBEAT_S) -> None:
        super().__init__(name="dsec-heartbeat", daemon=True)
        self.node = node
        self.interval_s = interval_s
        self.stopping = threading.Event()
        #: Images in the node's store, as the last round found them.
        self.images: list[str] = []
        self.rounds = threading.Event()  # set once a first round has completed
        self._rounds = threading.Thread(target=self._reconcile, name="dsec-reconcile", daemon=True)

    def start(self) -> None:
        self._rounds.start()
        super().start()

    def _reconcile(self) -> None:
        last: float | None = None  # when the last round started
        while not self.stopping.is_set():
            started = time.monotonic()
            if last is None or held(self.node) or started - last >= IDLE_ROUND_S:
                last = started
                try:
                    reconcile(self.node)
                    self.images = sorted(self.node.driver.list_images())
                    self.rounds.set()
                except Exception:
                    log.exception("reconcile round failed")
            self.stopping.wait(pause_after(time.monotonic() - started, self.interval_s))

    def run(self) -> None:
        # The first round, if it is quick, makes the registration complete.
        self.rounds.wait(self.interval_s)
        cls: type[NodeRegistered | NodeHeartbeat] = NodeRegistered
        while not self.stopping.is_set():
            sandboxes = held(self.node) if self.rounds.is_set() else None
            try:
                self.node.courier.event(
                    cls(
                        node_id=self.node.node_id,
                        payload=payload(self.node, sandboxes, self.images),
                    )
                )
                self.node.courier.flush()
                cls = NodeHeartbeat
            except Exception:
                log.exception("heartbeat failed")
            self.stopping.wait(self.interval_s)
