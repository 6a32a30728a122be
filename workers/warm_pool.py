"""Warm pools: started sandboxes waiting per image, so that a create is a claim.

A node keeps ``settings.warm_pool[image]`` containers of each configured image
created, started, moved into their cgroups and with their agent connected, under slot
ids ``warm-<hex>``. A create of that image whose shape the pool can serve takes one
and hands it over to the new sandbox in a few renames (~10-20 ms here) instead of a
cold start (create, init, cgroups, start, agent handshake: ~150-300 ms). A background
thread refills the pool, one container at a time, and only once no create, destroy or
stop has run on the node for :data:`REFILL_IDLE_S`: creates always come first, the
pool is what waits.

A warm container exists before the request that claims it, so everything fixed at
create time has to be dealt with at the claim:

(a) **Identity.** The sandbox id names the container (``dsec-<id>``), its cgroups,
    its run directory and its agent slot, and the TTL reaper, the reconciler, destroy,
    OOM detection and exec all find a sandbox by it, also after a worker restart. So
    the claim renames each of them to the sandbox's id: the cgroups (a cgroup v1
    ``rename(2)``; the sandbox's read-only view of them is a bind mount and follows),
    the host-owned run directory (the agent's socket is bound there; the bind mount
    into the sandbox follows too), the agent pool's slot (listener and live
    connection, :meth:`AgentPool.rename`). The run directory's rename is the commit
    point. The container (Podman's ``POST /containers/{name}/rename``, ~7 ms here: most
    of a claim) is renamed after the trainer has its answer, inside the create's
    transition (:meth:`WarmPool.finish`): until then its slot stays the pool's (the
    reconciler leaves it alone), and whatever reaches a container by name (destroy,
    snapshot, expiry) waits for the transition. Labels cannot change after create, so
    the driver takes a sandbox's id from the container's name
    (:attr:`SandboxContainer.claimed`) and what the labels would have said (tenant,
    job, expiry) is in a claim record in the run directory (workers/claim_record.py),
    written before the commit.
(b) **Limits.** memory, pids and CPU are written into the (still warm) cgroups at the
    claim (:meth:`CgroupLimiter.update`); Podman's own copies keep the pool's values,
    which rootless Podman never enforces here anyway. Network and the tmpfs sizes are
    fixed at create: a pool serves only creates without network and with the default
    ``disk_mb`` (and /tmp's fixed 64 MiB); any other shape is a cold start. cgroup v2
    has no rename: there the pool stays off (logged) rather than leave sandboxes in
    cgroups named after slots.
(c) **Agent.** The slot's connection is re-keyed, not reopened: no handshake on the
    claim. A slot whose agent has hung up is thrown away and the next one is tried.
(d) **Environment.** A container's environment is fixed at create. The request's
    ``env`` goes into the agent slot as its default environment
    (:attr:`AgentConnection.default_env`), which every command gets under its own
    ``env``; exec needs no change. After a worker restart the reconciler registers the
    slot again with the env from the claim record.
(e) **Accounting.** Warm containers are no sandboxes: they are not in heartbeats
    (the scheduler would call them orphans), have no expiry and are billed to nobody;
    ``SandboxStarted.payload.warm`` says a sandbox was claimed.

Crashes. Before the commit the claim is undone (the slot is thrown away, the create
goes cold); a worker that dies in the middle leaves a warm container (removed at the
next start) and cgroups named after the sandbox without a container (the reconciler's
sweep and the redelivered create deal with them). A worker that dies after the commit
and before the container's rename leaves a warm container whose slot a sandbox's claim
record names: the next start finishes the rename. After that the sandbox is an
ordinary one whose labels say "warm".

Lifetime. The pool lives in memory: at start the node removes every unclaimed warm
container it finds (a previous life's, or one the pool no longer wants: a smaller or
different ``DSEC_WARM_POOL`` is applied by restarting the worker), and a clean worker
stop (``dsec down``) removes the pool's containers. The reconciler removes a warm
container that died or that the pool does not know.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import threading
import time
import uuid
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from app.domain.requests import SandboxShape
from workers.claim_record import ClaimRecord, read_record, write_record
from workers.containers import label
from workers.containers.port import ContainerDriver, SandboxContainer
from workers.containers.spec import SandboxSpec
from workers.errors import NodeError


class AgentLine(Protocol):
    """A connection to a sandbox's agent, as far as the pool tests it."""

    def ping(self) -> None: ...


class PoolAgents(Protocol):
    """What a warm pool does with its node's agents (:class:`workers.agent.pool.AgentPool`
    is one): listen for a new container's agent, move a claimed one's slot, let go."""

    def register(
        self, sandbox_id: str, run_dir: Path, env: Mapping[str, str] | None = None
    ) -> Path: ...
    def rename(
        self, old: str, new: str, run_dir: Path, env: Mapping[str, str] | None = None
    ) -> None: ...
    def unregister(self, sandbox_id: str) -> None: ...
    def is_connected(self, sandbox_id: str) -> bool: ...
    def connection(self, sandbox_id: str, wait_s: float) -> AgentLine: ...


class PoolHost(Protocol):
    """What a warm pool needs of its node (:class:`workers.handlers.Node` is one)."""

    node_id: str
    driver: ContainerDriver
    agent_dir: Path
    sandbox_root: Path
    #: When a create, destroy or stop last ran (time.monotonic()).
    last_transition: float

    @property
    def agents(self) -> PoolAgents: ...
    def run_dir(self, sandbox_id: str) -> Path: ...
    def busy_ids(self) -> set[str]: ...


log = logging.getLogger(__name__)

#: Slot ids (and container names ``dsec-warm-<hex>``) of warm containers.
SLOT_PREFIX = "warm-"
#: The refill waits until no create, destroy or stop has run for this long.
REFILL_IDLE_S = 0.2
#: How long a new warm container's agent has to call home.
AGENT_CONNECT_S = 15.0
#: Longest pause after failed refills (doubling from 1 s).
MAX_BACKOFF_S = 60.0
#: The shape a warm container has; a claim rewrites memory, pids and CPU.
POOL_SHAPE = SandboxShape()


@dataclass(frozen=True)
class _Slot:
    slot_id: str
    container_id: str
    image: str


class WarmPool:
    """The node's warm containers: claimed by creates, refilled in the background.

    Thread-safe. ``_lock`` guards the slot sets only; no I/O happens under it, so a
    claim never waits for the refill (which holds no slot another thread could take
    until its container answers).
    """

    def __init__(
        self, node: PoolHost, sizes: Mapping[str, int], *, idle_s: float = REFILL_IDLE_S
    ) -> None:
        self.node = node
        self.sizes = {image: n for image, n in sizes.items() if n > 0}
        if self.sizes and not node.driver.can_rename_cgroups:
            log.warning("warm pools need cgroup v1 (cgroup2 cannot rename): pools are off")
            self.sizes = {}
        self.idle_s = idle_s
        self.claims = 0
        self.misses = 0
        self._lock = threading.Lock()
        self._ready: dict[str, deque[_Slot]] = {image: deque() for image in self.sizes}
        self._filling: str | None = None
        self._claiming: set[str] = set()
        #: Claimed sandboxes whose container still has its slot's name: sandbox -> slot.
        self._handing: dict[str, str] = {}
        self._records: dict[str, ClaimRecord] = {}
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dsec-warm-pool", daemon=True)

    # --- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        """Remove a previous life's warm containers, then keep the pools filled."""
        self._reap()
        self._thread.start()

    def close(self, drain: bool = True) -> None:
        """Stop refilling; with ``drain``, remove the waiting containers."""
        self._stopping.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=AGENT_CONNECT_S + 5)
        if drain:
            with self._lock:
                slots = [slot for ready in self._ready.values() for slot in ready]
                for ready in self._ready.values():
                    ready.clear()
            for slot in slots:
                self._scrap(slot.slot_id)
            if slots:
                log.info("warm pool: removed %d waiting containers", len(slots))

    def ready(self, image: str | None = None) -> int:
        """Warm containers waiting (for ``image``, or in all pools)."""
        with self._lock:
            if image is not None:
                return len(self._ready.get(image, ()))
            return sum(len(r) for r in self._ready.values())

    # --- claims ---------------------------------------------------------------------

    def matches(self, spec: SandboxSpec) -> bool:
        """A pool can serve this shape (its container is then rewritten, not made)."""
        return (
            spec.image in self.sizes
            and not spec.network
            and spec.disk_mb == POOL_SHAPE.disk_mb
            and spec.tmp_mb == SandboxSpec.tmp_mb
        )

    def claim(self, spec: SandboxSpec) -> str | None:
        """Hand a warm container over to ``spec``'s sandbox and return its container id;
        None if there is none to hand (the caller starts one cold). The container keeps
        its slot's name until :meth:`finish` (or :meth:`abandon`), which the caller
        calls before it lets the sandbox go.

        The caller holds the sandbox busy. A run directory that already exists means a
        redelivered create whose container may exist: the cold path finds it.
        """
        if not self.matches(spec) or spec.run_dir.exists():
            return None
        while True:
            with self._lock:
                ready = self._ready[spec.image]
                if not ready:
                    self.misses += 1
                    return None
                slot = ready.popleft()
                self._claiming.add(slot.slot_id)
            self._wake.set()
            try:
                if self.node.agents.is_connected(slot.slot_id):
                    self._hand_over(slot, spec)
                    with self._lock:
                        self._handing[spec.sandbox_id] = slot.slot_id
                    self.claims += 1
                    return slot.container_id
                log.warning("warm slot %s lost its agent: thrown away", slot.slot_id)
                self._scrap(slot.slot_id)
            except Exception as exc:
                log.warning("claim of %s for %s failed: %s", slot.slot_id, spec.sandbox_id, exc)
                self._scrap(slot.slot_id, spec.sandbox_id)
                self._let_go(slot.slot_id)
                return None
            self._let_go(slot.slot_id)  # the next slot is tried

    def finish(self, sandbox_id: str) -> None:
        """Give a claimed container its sandbox's name (after the trainer was answered,
        inside the create's transition). If Podman refuses, the container is removed and
        the error raised: the caller ends the sandbox."""
        with self._lock:
            slot_id = self._handing.pop(sandbox_id, None)
        if slot_id is None:
            return
        try:
            self.node.driver.rename(slot_id, sandbox_id)
        except Exception:
            self._scrap(slot_id)
            raise
        finally:
            self._let_go(slot_id)

    def abandon(self, sandbox_id: str) -> None:
        """Remove a claimed container that will never be renamed (its create failed
        after the claim); the caller removes what carries the sandbox's name."""
        with self._lock:
            slot_id = self._handing.pop(sandbox_id, None)
        if slot_id is not None:
            self._scrap(slot_id)
            self._let_go(slot_id)

    def _let_go(self, slot_id: str) -> None:
        with self._lock:
            self._claiming.discard(slot_id)

    def _hand_over(self, slot: _Slot, spec: SandboxSpec) -> None:
        """Rename everything of the slot but its container to the sandbox."""
        node, w, s = self.node, slot.slot_id, spec.sandbox_id
        record = ClaimRecord(s, w, spec.image, dict(spec.labels), dict(spec.env))
        write_record(node.run_dir(w), record)
        node.driver.update_limits(w, spec.memory_mb, spec.pids_limit, spec.cpus)
        node.driver.rename_cgroups(w, s)
        node.run_dir(w).rename(spec.run_dir)  # the commit point (a restart finishes it)
        node.agents.rename(w, s, spec.run_dir, spec.env)
        with self._lock:
            self._records[s] = record

    # --- what the reconciler asks -----------------------------------------------------

    def record(self, sandbox_id: str) -> ClaimRecord | None:
        """The claim record of a claimed sandbox (cached; read back after a restart)."""
        with self._lock:
            found = self._records.get(sandbox_id)
        if found is None:
            found = read_record(self.node.run_dir(sandbox_id))
            if found is not None and found.sandbox_id == sandbox_id:
                with self._lock:
                    self._records[sandbox_id] = found
        return found

    def labels_of(self, box: SandboxContainer) -> dict[str, str]:
        """The labels a sandbox answers to: a claimed one's from its claim record."""
        if not box.claimed:
            return box.labels
        record = self.record(box.sandbox_id)
        if record is None:
            log.warning("claimed sandbox %s has no claim record", box.sandbox_id)
            return {**box.labels, label.SANDBOX_ID: box.sandbox_id}
        return record.labels

    def env_of(self, box: SandboxContainer) -> dict[str, str]:
        """A claimed sandbox's default environment (for its agent slot)."""
        record = self.record(box.sandbox_id) if box.claimed else None
        return record.env if record is not None else {}

    def forget(self, live: set[str]) -> None:
        """Drop cached claim records of sandboxes no longer in ``live``."""
        with self._lock:
            for sandbox_id in set(self._records) - live:
                del self._records[sandbox_id]

    def owns(self, slot_id: str) -> bool:
        """The slot is waiting, being filled or being claimed."""
        return slot_id in self.slot_ids()

    def slot_ids(self) -> set[str]:
        """The slots waiting, being filled or being claimed: no sandboxes (yet)."""
        with self._lock:
            ids = {s.slot_id for ready in self._ready.values() for s in ready} | self._claiming
            if self._filling is not None:
                ids.add(self._filling)
            return ids

    def check(self, box: SandboxContainer) -> None:
        """Reconcile one warm container: a dead one, or one the pool does not know
        (a previous life's, or the pool shrank), is removed."""
        w = box.sandbox_id
        with self._lock:
            if w == self._filling or w in self._claiming:
                return
            ready = self._ready.get(box.labels.get(label.WARM, ""), deque())
            slot = next((s for s in ready if s.slot_id == w), None)
            if slot is not None:
                if box.running and not box.oom_killed:
                    return
                ready.remove(slot)
        log.info("warm container %s (%s) removed", w, box.state if slot else "not in the pool")
        self._scrap(w)
        self._wake.set()

    # --- refill ---------------------------------------------------------------------

    def _run(self) -> None:
        failures = 0
        while not self._stopping.is_set():
            image = self._wanted()
            if image is None:
                self._wake.wait(5.0)
                self._wake.clear()
                continue
            if not self._quiet():
                self._stopping.wait(0.05)
                continue
            if self._fill(image):
                failures = 0
            else:
                failures += 1
                self._stopping.wait(min(MAX_BACKOFF_S, 2.0 ** (failures - 1)))

    def _wanted(self) -> str | None:
        with self._lock:
            for image, size in self.sizes.items():
                if len(self._ready[image]) < size:
                    return image
        return None

    def _quiet(self) -> bool:
        """No sandbox of the node is in a transition, nor was for ``idle_s``."""
        node = self.node
        return not node.busy_ids() and time.monotonic() - node.last_transition >= self.idle_s

    def _slot_spec(self, image: str, slot_id: str) -> SandboxSpec:
        return SandboxSpec(
            sandbox_id=slot_id,
            image=image,
            cpus=POOL_SHAPE.cpus,
            memory_mb=POOL_SHAPE.memory_mb,
            pids_limit=POOL_SHAPE.pids_limit,
            disk_mb=POOL_SHAPE.disk_mb,
            labels={
                label.SANDBOX_ID: slot_id,
                label.WARM: image,
                label.NODE: self.node.node_id,
            },
            agent_bin_dir=self.node.agent_dir,
            run_dir=self.node.run_dir(slot_id),
        )

    def _fill(self, image: str) -> bool:
        """Start one warm container; False if that failed."""
        slot_id = SLOT_PREFIX + uuid.uuid4().hex[:16]
        spec = self._slot_spec(image, slot_id)
        with self._lock:
            self._filling = slot_id
        try:
            spec.run_dir.mkdir(parents=True, exist_ok=True, mode=0o755)
            self.node.agents.register(slot_id, spec.run_dir)
            container_id = self.node.driver.create_and_start(spec)
            self.node.agents.connection(slot_id, AGENT_CONNECT_S).ping()
        except Exception as exc:
            log.warning("warm pool %s: could not start a container: %s", image, exc)
            self._scrap(slot_id)
            with self._lock:
                self._filling = None
            return False
        with self._lock:
            self._filling = None
            self._ready[image].append(_Slot(slot_id, container_id, image))
        return True

    # --- removal --------------------------------------------------------------------

    def _reap(self) -> None:
        """Remove unclaimed warm containers and warm run dirs a previous life left."""
        try:
            boxes = self.node.driver.list_sandboxes()
        except NodeError:
            log.exception("warm pool: listing containers at start")
            return
        stale = [box.sandbox_id for box in boxes if box.warm]
        claimed = self._claims_left() if stale else {}
        stale = [
            slot_id for slot_id in stale
            if slot_id not in claimed or not self._finish_left(slot_id, claimed[slot_id])
        ]  # fmt: skip
        for slot_id in stale:
            self._scrap(slot_id)
        with contextlib.suppress(FileNotFoundError):
            for path in self.node.sandbox_root.glob(f"{SLOT_PREFIX}*"):
                shutil.rmtree(path, ignore_errors=True)
        if stale:
            log.info("warm pool: removed %d warm containers of a previous run", len(stale))

    def _claims_left(self) -> dict[str, str]:
        """Slots that a sandbox's claim record names (slot -> sandbox), from the run
        directories: a previous life that died between a claim's commit and its
        container's rename left such a slot's container under the slot's name."""
        found: dict[str, str] = {}
        with contextlib.suppress(FileNotFoundError):
            for path in self.node.sandbox_root.iterdir():
                if path.name.startswith(SLOT_PREFIX) or not path.is_dir():
                    continue
                record = read_record(path)
                if record is not None and record.sandbox_id == path.name:
                    found[record.slot_id] = record.sandbox_id
        return found

    def _finish_left(self, slot_id: str, sandbox_id: str) -> bool:
        try:
            self.node.driver.rename(slot_id, sandbox_id)
        except NodeError:
            log.exception("finishing the claim of %s by %s", slot_id, sandbox_id)
            return False
        log.info("warm pool: finished the claim of %s by %s (the worker died in it)",
                 slot_id, sandbox_id)  # fmt: skip
        return True

    def _scrap(self, slot_id: str, sandbox_id: str | None = None) -> None:
        """Remove a warm container and everything of it, under either name.

        ``sandbox_id``: a claim failed part-way; whatever already carries the sandbox's
        name is of that failed claim (the caller holds the sandbox busy and its run
        directory did not exist before), so it goes too.
        """
        node = self.node
        for name in (slot_id, sandbox_id):
            if name is None:
                continue
            # The agent slot first: the node's heartbeat lists registered slots the pool
            # does not own, and this one may already have left the pool.
            node.agents.unregister(name)
            try:
                node.driver.remove(name)
            except NodeError:
                log.exception("removing %s", name)
            node.driver.remove_cgroups(name)
            shutil.rmtree(node.run_dir(name), ignore_errors=True)
        if sandbox_id is not None:
            with self._lock:
                self._records.pop(sandbox_id, None)
