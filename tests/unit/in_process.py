"""The platform in one process: a real SDK client, the real dispatcher and the real
node, on the in-memory bus, task queue, container driver and claims, with the
agent's double on the node's real agent sockets (tests/unit/test_round_trip.py).

Nothing here decides anything: :meth:`Platform.pump` moves what each part sent to
the part that reads it, as the scheduler's loop, the node's Celery worker and its
inbox do over Kafka and Redis, and :meth:`Platform.run` carries an SDK operation out,
pumping until each of its replies is in.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from app.config import Settings
from app.control.dispatch import Dispatcher
from app.control.outbox import Outbox
from app.control.sending import send_outbox
from app.credentials import Credential
from app.domain.events import NodeRegistered
from app.domain.partition_counts import FixedPartitions
from app.domain.proof import SCHEDULER_KEY_ID
from app.domain.records import Record
from app.memory import InMemoryBus, InMemoryPublisher, InMemoryTaskQueue, InMemoryTransport
from app.sdk import Client
from app.sdk.steps import Answer, Steps
from tests.unit.signing import KEYS
from workers import direct, inbox, tasks
from workers.agent.double import AgentDouble
from workers.agent.pool import AgentPool
from workers.containers.memory_driver import InMemoryDriver
from workers.courier import Courier
from workers.handlers import Node
from workers.memory_state import InMemoryClaims, InMemoryStepGuard
from workers.upkeep import held, payload

T = TypeVar("T")

NODE = "n0"
#: The cores the node says its host has.
HOST_CPUS = 4.0
IMAGE = "dsec/busybox:latest"
#: Requests have 8 partitions and every replies topic 16 (the gate checks both).
PARTITIONS = FixedPartitions(requests_topic=8, replies_each=16)
#: Longest a step may wait for its reply: the whole round trip takes milliseconds.
STEP_WAIT_S = 1.0


def credential(key_id: str) -> Credential:
    """The credential of a key of tests/unit/signing.py (tenants t and u, nodes n0, n1)."""
    info = KEYS.lookup(key_id)
    assert info is not None, key_id
    return Credential(key_id, info.secret, info.principal.role, info.principal.subject)


class Platform:
    """One scheduler and one node (``n0``) around an in-memory bus."""

    def __init__(self, state_dir: Path) -> None:
        self.settings = Settings(state_dir=state_dir, request_max_age_s=300)
        self.bus = InMemoryBus()
        self.queue = InMemoryTaskQueue()
        self.dispatcher = Dispatcher(self.settings, KEYS, PARTITIONS)
        self.agent = AgentDouble()
        self.driver = InMemoryDriver(
            [IMAGE], on_start=lambda spec: self.agent.start(spec.sandbox_id, spec.run_dir)
        )
        self.agents = AgentPool(hello_timeout_s=1.0)
        node_credential = credential(f"k-node-{NODE}")
        courier = Courier(self.settings, node_credential, self._publisher)
        self.node = Node(
            self.settings, NODE, self.driver, self.agents, node_credential, courier,
            InMemoryClaims(), InMemoryStepGuard(),
        )  # fmt: skip
        self._read: dict[tuple[str, int], int] = {}
        self._clients: list[Client] = []
        self.direct_rules = direct.rules(self.settings, self._reply_partitions)

    def _reply_partitions(self, topic: str) -> int | None:
        return self._partitions(topic)

    def _partitions(self, topic: str) -> int:
        if topic == self.settings.topic_requests:
            return PARTITIONS.requests_topic
        if topic.startswith(self.settings.replies_topic("")):
            return PARTITIONS.replies_each
        return 1  # events, a node's inbox, dead letters: one partition is enough here

    def _publisher(self) -> InMemoryPublisher:
        return InMemoryPublisher(self.bus, self._partitions)

    def client(self, tenant: str = "t") -> Client:
        """A trainer of ``tenant``, its requests and replies on the bus."""
        made = Client(
            self.settings, credential=credential(f"k-tenant-{tenant}"), job_id="job",
            timeout_s=STEP_WAIT_S, transport=InMemoryTransport(self.bus, self._partitions),
        )  # fmt: skip
        self._clients.append(made)
        return made

    def close(self) -> None:
        """Clients, agents and the pool let go (their threads end)."""
        for made in self._clients:
            made.close()
        self.node.commands.close()
        self.agents.close()
        self.agent.close()

    # --- moving records -----------------------------------------------------------

    def beat(self) -> None:
        """The node registers, as its upkeep's first heartbeat does, declaring a host of
        :data:`HOST_CPUS` cores whatever the machine running the test has (placement is
        then the same everywhere)."""
        images = sorted(self.driver.list_images())
        declared = payload(self.node, held(self.node), images).model_copy(
            update={"max_sandbox_cpus": HOST_CPUS, "capacity_cpus": HOST_CPUS}
        )
        self.node.courier.event(NodeRegistered(node_id=NODE, payload=declared))

    def _new(self, topic: str, partition: int = 0) -> list[Record]:
        """The records of the partition not read yet (each reader here reads alone)."""
        at = self._read.get((topic, partition), 0)
        records = self.bus.read(topic, partition, at, wait_s=0)
        if records:
            self._read[(topic, partition)] = records[-1].offset + 1
        return records

    def pump(self) -> int:
        """One round of every part: the scheduler follows the events and handles the
        requests that came, sending what it decided; the node carries out its queue's
        tasks and its inbox's commands. How many records and tasks moved."""
        moved = 0
        out = Outbox()
        for event in self._new(self.settings.topic_events):
            self.dispatcher.observe(out, event)
            moved += 1
        self.dispatcher.retry_pending(out)
        for partition in range(PARTITIONS.requests_topic):
            for request in self._new(self.settings.topic_requests, partition):
                self.dispatcher.handle(out, request)
                moved += 1
        self._send(out)
        while (task := self.queue.take(self.settings.node_queue(NODE), wait_s=0)) is not None:
            tasks.carry_out(task[0], tuple(task[1]))
            moved += 1
        records = self._new(self.settings.node_topic(NODE))
        inbox.carry_out_all(records, self.direct_rules, f"inbox {NODE}")
        moved += len(records)
        return moved

    def _send(self, out: Outbox) -> None:
        """What the scheduler decided, sent as its process sends it."""
        secret = KEYS.lookup(SCHEDULER_KEY_ID)
        assert secret is not None
        send_outbox(out, self._publisher(), self.queue, self.settings.topic_events, secret.secret)

    def node_lost(self) -> int:
        """The node is gone: the scheduler reads its inbox instead (what came since it
        was last read) and answers what it may. How many records it read."""
        out = Outbox()
        records = self._new(self.settings.node_topic(NODE))
        for record in records:
            self.dispatcher.answer_for_lost(out, record)
        self._send(out)
        return len(records)

    def pump_until(self, done: Callable[[], bool], what: str, within_s: float) -> None:
        """Pump until ``done()`` holds; fail saying ``what`` did not happen if it does
        not within ``within_s``."""
        deadline = time.monotonic() + within_s
        while not done():
            self.pump()
            assert time.monotonic() < deadline, what

    def settle(self) -> None:
        """Pump until nothing moves and no command runs on the node."""
        deadline = time.monotonic() + STEP_WAIT_S
        while self.pump() or self.node.commands.in_flight():
            assert time.monotonic() < deadline, "the platform did not settle within 1 s"
            time.sleep(0.001)

    def run(self, steps: Steps[T]) -> T:
        """Carry an SDK operation out as the sync client does (app/sdk/steps.py), but
        pumping until each reply it waits for is in, then taking it as the client
        does (its proof checked by the client's reply reader)."""
        outcome: object = None
        error: Exception | None = None
        with contextlib.closing(steps):
            while True:
                try:
                    step = steps.send(outcome) if error is None else steps.throw(error)
                except StopIteration as done:
                    return done.value  # type: ignore[no-any-return]
                if isinstance(step, Answer):
                    self._until(step)
                try:
                    outcome, error = step.block(), None
                except Exception as exc:
                    outcome, error = None, exc

    def _until(self, answer: Answer) -> None:
        deadline = time.monotonic() + STEP_WAIT_S
        while not answer.future.done():
            if not self.pump():
                assert time.monotonic() < deadline, f"no reply to {answer.request.type} in 1 s"
                time.sleep(0.001)
