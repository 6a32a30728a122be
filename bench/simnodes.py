"""Simulated nodes for bench/unit.py: many nodes in one process, answering over the
real broker and Redis as node workers do, without Podman or agents.

    .venv/bin/python bench/simnodes.py --tag TAG --nodes 160 --fill 2400 --tenants 8

bench/unit.py starts it with the settings of its own platform (topic prefix and
database in the environment). Each node registers and heartbeats every 5 s with the
sandboxes it holds, proven with its own node key (enrolled in the platform's
credentials table, as an operator's `dsec node add` does); it takes its creates and
destroys from its Celery queue in Redis (acknowledged late, held in Redis while done,
as a worker does) and its commands from its inbox topic (claimed in Redis by request
id), and answers each with the node's own events and replies (workers/courier.py,
workers/exec_path.py). A command "runs" in no time: what is measured is the control
plane around it.

Before anything is asked of them, the nodes are filled: for each of their ``--fill``
sandboxes the log gets the Requested and Scheduled the scheduler would have appended
(proven with the scheduler's key) and the node's Started. That is the log and the
state a unit holds after ~2 minutes of DSec's peak, written in seconds instead of
asked for one create at a time.

Control lines on stdin: ``LIST`` (heartbeats list the sandboxes from now on: a
scheduler that has not yet read the fill would take the listed ones for orphans),
``STOP``. It prints ``REGISTERED``, ``FILLED <n> <seconds>``, ``LISTING`` and, at the
end, ``STATS <json>``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kafka import TopicPartition
from kombu.connection import Connection
from kombu.entity import Queue

from app import bus
from app.config import Settings, get_settings
from app.control.creates import placement_events
from app.control.keyring import Keyring, credential_for
from app.credentials import Credential
from app.db import credentials as stored
from app.db.engine import transaction
from app.domain.base import StopReason, derived_id, utcnow
from app.domain.codec import encode
from app.domain.direct import DirectRefusal, SandboxKey, admit_direct
from app.domain.events import (
    LastState,
    NodeHeartbeat,
    NodePayload,
    NodeRegistered,
    SandboxStarted,
    SandboxStopped,
    StartedPayload,
    StoppedPayload,
)
from app.domain.lives import RECONCILER
from app.domain.node_tasks import NodeTask, Opened, read_inbox_record, unseal
from app.domain.proof import (
    HEADER_KEY,
    SCHEDULER_KEY_ID,
    Purpose,
    Role,
    header,
    headers,
    sandbox_key,
)
from app.domain.records import Record
from app.domain.replies import Done, ExecOutput, SandboxReady
from app.domain.requests import CreateSandbox, DestroySandbox, Exec
from app.partition_cache import PartitionCache
from workers import direct
from workers.agent.messages import AgentExecResult
from workers.command_record import command_completed
from workers.courier import Courier
from workers.failures import envelope
from workers.redis_state import Claims, claim_ttl_s, connect

#: A node of DSec's shape: 30,000 cores and ~250 TB over 160 nodes, ~2,400 sandboxes
#: each (capacity with room to spare). Sandboxes ask 0.5 core and 256 MiB.
NODE_CPUS = 188.0
NODE_MEMORY_MB = 1_500_000
NODE_SANDBOXES = 3200
SANDBOX_CPUS = 0.5
SANDBOX_MEMORY_MB = 256
#: As the node worker (workers/upkeep.py).
HEARTBEAT_S = 5.0
#: What a command "printed": nothing, in no time (the node is not what is measured).
RESULT = AgentExecResult(exit_code=0, stdout=b"", stderr=b"", duration_s=0.001)


def node_ids(tag: str, n: int) -> list[str]:
    """The run's node ids (a tag per run: Redis is the stack's, shared by runs)."""
    return [f"{tag}n{i:03d}" for i in range(n)]


def tenant_names(tag: str, n: int) -> list[str]:
    """The run's tenants."""
    return [f"{tag}t{k}" for k in range(n)]


def fill_id(tag: str, node: int, j: int) -> str:
    """Fill sandbox ``j`` of node ``node`` (23 characters, like the SDK's ids)."""
    return f"sb-{tag}{node:03d}f{j:012d}"


def fill_index(tag: str, sandbox_id: str) -> int | None:
    """``j`` of a fill sandbox's id (:func:`fill_id`); None for any other id."""
    found = re.fullmatch(rf"sb-{re.escape(tag)}\d{{3}}f(\d{{12}})", sandbox_id)
    return int(found.group(1)) if found else None


def fill_tenant(j: int, tenants: int) -> int:
    """Which tenant owns fill sandbox ``j`` of any node."""
    return j % tenants


def credentials_of(settings: Settings) -> dict[str, Credential]:
    """Every credential recorded in the run's database, by subject."""
    with transaction(settings.database_url) as conn:
        rows = stored.load(conn)
    return {row.subject: credential_for(settings, row) for row in rows if row.revoked_at is None}


@dataclass
class SimNode:
    """One node: its key, its courier, its claims in Redis and the sandboxes it holds."""

    node_id: str
    credential: Credential
    courier: Courier
    claims: Claims
    held: set[str] = field(default_factory=set)
    #: Direct-route keys of the sandboxes created during the run (a fill sandbox's is
    #: derived when asked: see :meth:`Nodes.route`).
    routes: dict[str, SandboxKey] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    registered: bool = False

    def payload(self, listing: bool) -> NodePayload:
        with self.lock:
            ids = sorted(self.held)
        return NodePayload(
            capacity_sandboxes=NODE_SANDBOXES, capacity_cpus=NODE_CPUS * 8,
            capacity_memory_mb=NODE_MEMORY_MB, running=len(ids),
            images=["dsec/busybox:latest"], queue=f"node.{self.node_id}",
            sandboxes=ids if listing else None, max_sandbox_cpus=NODE_CPUS,
            max_sandbox_memory_mb=NODE_MEMORY_MB, max_sandbox_pids=4096,
        )  # fmt: skip


class Nodes:
    """The simulated nodes of one run and the threads that serve them."""

    def __init__(self, settings: Settings, tag: str, n: int) -> None:
        self.settings = settings
        self.tag = tag
        creds = credentials_of(settings)
        self.publisher = bus.Publisher(settings)
        redis = connect(settings.celery_broker_url)
        self.redis = redis
        self.nodes = {
            node_id: SimNode(
                # Every node's courier on the process's one producer: 160 producers, each
                # with its I/O thread, would cost this process more than the nodes' work.
                node_id, creds[node_id], Courier(settings, creds[node_id], self._publisher),
                Claims(redis, node_id, creds[node_id].secret,
                       claim_ttl_s(settings.request_max_age_s)),
            )
            for node_id in node_ids(tag, n)
        }  # fmt: skip
        self.tenants = {s: c for s, c in creds.items() if c.role == Role.TENANT}
        self._tenant_order = sorted(self.tenants)
        self.rules = direct.rules(settings, PartitionCache(lambda: self.publisher))
        self.listing = False
        self.stopping = threading.Event()
        self.stats: Counter[str] = Counter()
        self.heartbeat_bytes = 0
        #: Redis keys this run's claims leave behind (each kept claim_ttl_s by a real node).
        self.done_keys: list[str] = []
        self._stats_lock = threading.Lock()

    def _publisher(self) -> bus.Publisher:
        """The producer every simulated node's courier sends through."""
        return self.publisher

    def count(self, what: str, n: int = 1) -> None:
        with self._stats_lock:
            self.stats[what] += n

    # --- heartbeats ---------------------------------------------------------------

    def heartbeats(self) -> None:
        """Each node every 5 s, spread over the period as independent nodes are."""
        order = list(self.nodes.values())
        gap = HEARTBEAT_S / len(order)
        started = time.monotonic()
        i = 0
        while not self.stopping.is_set():
            due = started + i * gap
            wait = due - time.monotonic()
            if wait > 0 and self.stopping.wait(wait):
                return
            self.heartbeat(order[i % len(order)])
            i += 1

    def heartbeat(self, node: SimNode) -> None:
        cls: type[NodeRegistered | NodeHeartbeat] = (
            NodeHeartbeat if node.registered else NodeRegistered
        )
        event = cls(node_id=node.node_id, payload=node.payload(self.listing))
        node.courier.event(event)
        node.registered = True
        self.count("heartbeats")
        if self.listing:
            self.count("listed heartbeats")
            with self._stats_lock:
                self.heartbeat_bytes += len(encode(event))

    # --- the fill -----------------------------------------------------------------

    def fill(self, per_node: int) -> int:
        """Requested + Scheduled (the scheduler's key) and Started (the node's) for
        ``per_node`` sandboxes on each node; how many."""
        scheduler = Keyring.from_settings(self.settings).scheduler
        tenants = sorted(self.tenants)
        publisher = bus.Publisher(self.settings, linger_ms=5)
        topic = self.settings.topic_events
        actors = {t: f"{t}/{self.tenants[t].key_id}" for t in tenants}
        total = 0
        for i, node in enumerate(self.nodes.values()):
            cred = node.credential
            for j in range(per_node):
                tenant = tenants[fill_tenant(j, len(tenants))]
                request = CreateSandbox(
                    sandbox_id=fill_id(self.tag, i, j), job_id="unit-fill", tenant=tenant,
                    actor=actors[tenant], cpus=SANDBOX_CPUS, memory_mb=SANDBOX_MEMORY_MB,
                    ttl_s=7 * 86_400,
                )  # fmt: skip
                requested, scheduled = placement_events(request, node.node_id, {})
                for event in (requested, scheduled):
                    value = encode(event)
                    proof = headers(Purpose.EVENT, SCHEDULER_KEY_ID, scheduler.secret, value)
                    publisher.publish(topic, event.key, value, headers=proof)
                started = SandboxStarted(
                    event_id=request.event_of("started"), **envelope(request, node.node_id),
                    payload=StartedPayload(request_id=request.request_id, container_id="sim"),
                )  # fmt: skip
                value = encode(started)
                proof = headers(Purpose.EVENT, cred.key_id, cred.secret, value)
                publisher.publish(topic, started.key, value, headers=proof)
                with node.lock:
                    node.held.add(request.sandbox_id)
                total += 1
        publisher.flush(timeout_s=600)
        publisher.close()
        return total

    # --- creates and destroys: the Celery queues ------------------------------------

    def lifecycle(self) -> None:
        """Take every node's Celery tasks, one connection for all the queues."""
        queues = [
            Queue(f"node.{n}", routing_key=f"node.{n}")  # type: ignore[no-untyped-call]
            for n in self.nodes
        ]
        with (
            Connection(self.settings.celery_broker_url) as conn,  # type: ignore[no-untyped-call]
            conn.Consumer(queues, callbacks=[self._task], accept=["json"]),
        ):
            while not self.stopping.is_set():
                try:
                    conn.drain_events(timeout=1)
                except TimeoutError:
                    continue

    def _task(self, body: Any, message: Any) -> None:
        try:
            node = self.nodes[message.delivery_info["routing_key"].removeprefix("node.")]
            args = [str(a) for a in body[0]]
            self._lifecycle_task(node, NodeTask(message.headers["task"]), args)
        except Exception as exc:  # one bad task must not stop the nodes
            print(f"simnodes: task failed: {exc!r}", file=sys.stderr, flush=True)
            self.count("task failures")
        finally:
            message.ack()

    def _opened(self, node: SimNode, task: NodeTask, args: list[str]) -> Opened | None:
        opened = unseal(task, args, node.credential.key_id, node.credential.secret)
        if isinstance(opened, str):
            self.count("unproven tasks")
            return None
        return opened

    def _lifecycle_task(self, node: SimNode, task: NodeTask, args: list[str]) -> None:
        opened = self._opened(node, task, args)
        if opened is None:
            return
        body = opened.envelope.request
        if task == NodeTask.CREATE:
            create = CreateSandbox.model_validate_json(body)
            # Held in Redis while it is done, as a worker holds it (workers/tasks.py).
            node.claims.hold(create.scope, task.value, args)
            with node.courier.answering(create.request_id, opened.reply_key):
                self._create(node, create, opened)
            node.claims.answered(create.scope)
        elif task == NodeTask.DESTROY:
            destroy = DestroySandbox.model_validate_json(body)
            node.claims.hold(destroy.scope, task.value, args)
            with node.courier.answering(destroy.request_id, opened.reply_key):
                self._destroy(node, destroy)
            node.claims.answered(destroy.scope)
        else:
            self.count(f"other tasks ({task.value})")

    def _create(self, node: SimNode, request: CreateSandbox, opened: Opened) -> None:
        key_id = opened.envelope.sandbox_key_id
        with node.lock:
            node.held.add(request.sandbox_id)
            if opened.sandbox_key is not None and key_id is not None:
                node.routes[request.sandbox_id] = SandboxKey(
                    key_id, opened.sandbox_key, request.tenant, request.actor or request.tenant
                )
        node.courier.event(
            SandboxStarted(
                event_id=request.event_of("started"), **envelope(request, node.node_id),
                payload=StartedPayload(request_id=request.request_id, container_id="sim"),
            )
        )  # fmt: skip
        node.courier.reply(
            request.reply_to,
            SandboxReady(
                request_id=request.request_id,
                sandbox_id=request.sandbox_id,
                node_id=node.node_id,
                direct=request.sandbox_id in node.routes,
            ),
        )
        self.count("creates")

    def _destroy(self, node: SimNode, request: DestroySandbox) -> None:
        with node.lock:
            known = request.sandbox_id in node.held
            node.held.discard(request.sandbox_id)
            node.routes.pop(request.sandbox_id, None)
        if request.actor == RECONCILER:
            # The scheduler took a sandbox for an orphan: the simulation and the
            # scheduler disagree, which the run must show.
            self.count("orphan destroys")
        elif known:
            node.courier.event(
                SandboxStopped(
                    event_id=derived_id(request.request_id, f"{request.sandbox_id}:stopped"),
                    sandbox_id=request.sandbox_id, node_id=node.node_id, tenant=request.tenant,
                    job_id=request.job_id,
                    payload=StoppedPayload(
                        reason=StopReason(request.reason), detail=f"destroyed by {request.actor}",
                        request_id=request.request_id, actor=request.actor,
                        last_state=LastState(observed_by="node"),
                    ),
                )
            )  # fmt: skip
            self.count("destroys")
        else:
            self.count("destroys of unknown sandboxes")
        node.courier.reply(
            request.reply_to,
            Done(
                request_id=request.request_id, sandbox_id=request.sandbox_id,
                detail="destroyed" if known else "already gone",
            ),
        )  # fmt: skip

    # --- commands: the inbox topics -------------------------------------------------

    def commands(self) -> None:
        """Read every node's inbox (one partition each) with one consumer."""
        consumer = bus.make_consumer(self.settings)
        by_topic = {self.settings.node_topic(n): node for n, node in self.nodes.items()}
        consumer.assign([TopicPartition(topic, 0) for topic in by_topic])
        try:
            while not self.stopping.is_set():
                for tp, records in consumer.poll(timeout_ms=1000, max_records=500).items():
                    node = by_topic[tp.topic]
                    for record in records:
                        if header(record.headers, HEADER_KEY) is not None:
                            self._direct(node, record)
                        else:
                            self._command(node, record.value or b"")
        finally:
            consumer.close()

    def route(self, node: SimNode, sandbox_id: str) -> SandboxKey | None:
        """The direct-route key of a sandbox the node holds: kept at its create, or,
        for a fill sandbox, derived from its owner's key as the scheduler would have
        sealed it (the fill wrote no create task)."""
        with node.lock:
            found = node.routes.get(sandbox_id)
        if found is not None:
            return found
        j = fill_index(self.tag, sandbox_id)
        if j is None:
            return None
        tenant = self._tenant_order[fill_tenant(j, len(self._tenant_order))]
        cred = self.tenants[tenant]
        return SandboxKey(
            cred.key_id, sandbox_key(cred.secret, sandbox_id), tenant, f"{tenant}/{cred.key_id}"
        )

    def _direct(self, node: SimNode, record: Record) -> None:
        """A trainer's command on the direct route, checked as a node checks it
        (workers/direct.py) and answered under the sandbox's key."""
        sandbox_id = record.key.decode(errors="replace") if record.key else ""
        key = self.route(node, sandbox_id)
        verdict = admit_direct(record, key, frozenset(), utcnow(), self.rules)
        if isinstance(verdict, DirectRefusal) or key is None:
            self.count("refused direct commands")
            return
        self._answer(node, verdict, key.reply_key(verdict.request_id))

    def _command(self, node: SimNode, value: bytes) -> None:
        opened_record = read_inbox_record(value)
        if isinstance(opened_record, str):
            self.count("bad inbox records")
            return
        task, args = opened_record
        opened = self._opened(node, task, args)
        if opened is None:
            return
        if task != NodeTask.EXEC:
            self.count(f"other tasks ({task.value})")
            return
        self._answer(node, Exec.model_validate_json(opened.envelope.request), opened.reply_key)

    def _answer(self, node: SimNode, request: Exec, reply_key: bytes | None) -> None:
        # The node's claim: a request id runs at most once (workers/redis_state.py).
        if not node.claims.claim(request, reply_key):
            self.count("commands claimed before")
            return
        with self._stats_lock:
            self.done_keys.append(f"dsec:done:{request.scope}")
        with node.courier.answering(request.request_id, reply_key):
            node.courier.event(
                command_completed(request, RESULT, node.node_id, self.settings.step_output_bytes)
            )
            node.courier.reply_with_data(
                request.reply_to,
                ExecOutput(
                    request_id=request.request_id, sandbox_id=request.sandbox_id, exit_code=0,
                    stdout_b64="", stderr_b64="", duration_ms=RESULT.duration_s * 1000,
                ),
                {"stdout": RESULT.stdout, "stderr": RESULT.stderr},
            )  # fmt: skip
        node.claims.answered(request.scope)
        self.count("commands")

    # --- the end --------------------------------------------------------------------

    def done_key_bytes(self) -> int:
        """Redis's memory for one command's dedupe key (a sample's mean): what each
        command leaves there until its claim expires."""
        sample = self.done_keys[-100:]
        sizes = [self.redis.memory_usage(key) or 0 for key in sample]
        return sum(sizes) // max(1, len(sizes))

    def clean_redis(self) -> None:
        """What the run left in the stack's Redis: its queues, claims and dedupe keys."""
        keys = [*self.done_keys]
        for n in self.nodes:
            keys += [f"node.{n}", f"_kombu.binding.node.{n}", f"dsec:inflight:{n}"]
            keys += [f"dsec:inflight-tasks:{n}"]
        for lo in range(0, len(keys), 1000):
            self.redis.delete(*keys[lo : lo + 1000])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tag", required=True)
    parser.add_argument("--nodes", type=int, default=160)
    parser.add_argument("--fill", type=int, default=2400, help="sandboxes per node")
    args = parser.parse_args()
    nodes = Nodes(get_settings(), args.tag, args.nodes)
    threads = [
        threading.Thread(target=nodes.heartbeats, name="heartbeats", daemon=True),
        threading.Thread(target=nodes.lifecycle, name="lifecycle", daemon=True),
        threading.Thread(target=nodes.commands, name="commands", daemon=True),
    ]
    for thread in threads:
        thread.start()
    # Registered before the fill: a scheduler counts a placement against a node's room
    # only on a node it knows.
    time.sleep(HEARTBEAT_S + 1)
    print("REGISTERED", flush=True)
    started = time.monotonic()
    filled = nodes.fill(args.fill)
    print(f"FILLED {filled} {time.monotonic() - started:.1f}", flush=True)
    for line in sys.stdin:
        if line.strip() == "LIST":
            nodes.listing = True
            print("LISTING", flush=True)
        elif line.strip() == "STOP":
            break
    nodes.stopping.set()
    for thread in threads:
        thread.join(timeout=10)
    nodes.publisher.flush()
    done_key_bytes = nodes.done_key_bytes()
    nodes.clean_redis()
    stats = {
        **nodes.stats,
        "done_key_bytes": done_key_bytes,
        "heartbeat_bytes_mean": nodes.heartbeat_bytes // max(1, nodes.stats["listed heartbeats"]),
    }
    print("STATS " + json.dumps(stats), flush=True)


if __name__ == "__main__":
    main()
