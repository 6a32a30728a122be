"""A node's Kafka clients (``DSEC_NODE_KAFKA_CLIENT``): librdkafka by default
(app/rdkafka_bus.py), kafka-python where set. On either, its inbox is read and its
events and replies sent with every guarantee: a sandbox's events in the partition
kafka-python's partitioner picks, proven replies, output in pieces, forged direct
commands dead-lettered. The rest of the suite runs on the default."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from app import bus
from app.config import Settings
from app.domain.base import utcnow
from app.domain.partitioner import key_partition
from app.errors import ServiceUnavailable
from app.kafka_admin import drop_topics, ensure_topics
from app.rdkafka_bus import RdkafkaPublisher
from app.stack import services as stack_mod
from app.stack.process import Service
from tests.conftest import ensure_tenant, scalar, wait_for
from tests.integration.test_direct_route import _ran, _refused, _send

pytestmark = pytest.mark.integration

#: The client the stack's node does not run by default.
OTHER = "kafka-python"


def _worker(settings: Settings, client: str | None) -> Service:
    """The stack's node worker, on ``client`` (None: as the settings say)."""
    plain = next(s for s in stack_mod.services(settings) if s.name == f"worker-{settings.node_id}")
    if client is None:
        return plain
    return dataclasses.replace(plain, env={**plain.env, "DSEC_NODE_KAFKA_CLIENT": client})


def _restart(settings: Settings, worker: Service) -> None:
    began = time.time()
    worker.stop(settings)
    worker.start(settings)
    node = settings.node_id
    wait_for(lambda: stack_mod.node_alive(settings, node, began), 120, f"node {node} heartbeat")
    wait_for(lambda: stack_mod.schedulers_place_on(settings, node), 30, "placement")


def _threads(pid: int) -> set[str]:
    return {p.read_text().strip() for p in Path(f"/proc/{pid}/task").glob("*/comm")}


@pytest.fixture(scope="module")
def node_on_kafka_python(stack: Settings) -> Iterator[Settings]:
    """The stack's node restarted on kafka-python; back on its default afterwards."""
    _restart(stack, _worker(stack, OTHER))
    try:
        yield stack
    finally:
        _restart(stack, _worker(stack, None))


def _runs_librdkafka(stack: Settings) -> bool:
    """Whether librdkafka's own threads run in the node's worker."""
    pid = _worker(stack, None).pid(stack)
    assert pid is not None
    return any(name.startswith("rdk:") for name in _threads(pid))


def _life(stack: Settings, client: Any, db: Any) -> None:
    """A sandbox through its life on the stack's node, and its events in the log in
    the partition kafka-python's partitioner picks for it."""
    with client.create(memory_mb=64) as box:
        # Commands through the inbox, answered through the node's producer
        first = box.exec("echo via the inbox; exit 3")
        assert (first.exit_code, first.stdout) == (3, b"via the inbox\n")
        big = box.exec("head -c 900000 /dev/zero | tr '\\0' y")
        assert big.ok and big.stdout == b"y" * 900_000
        box.write_file("/workspace/f", b"through the node")
        assert box.read_file("/workspace/f") == b"through the node"
        sandbox_id = box.id
    consumer = bus.make_consumer(stack)
    count = len(bus.partitions(consumer, stack.topic_events))
    consumer.close()
    query = "SELECT count(*) FROM events WHERE sandbox_id = :s AND type = 'CommandCompleted'"
    with db() as conn:
        wait_for(lambda: scalar(conn, query, s=sandbox_id) >= 2, what="the commands in the log")
        partitions = conn.execute(
            text("SELECT DISTINCT partition FROM events WHERE sandbox_id = :s"),
            {"s": sandbox_id},
        ).scalars()
        assert set(partitions) == {key_partition(sandbox_id, count)}


def _forged_direct_command_is_refused(stack: Settings, client: Any) -> None:
    attacker = ensure_tenant(stack, "direct-attacker")
    with client.create(memory_mb=64) as box:
        since = utcnow()
        # When another tenant writes a command for it to the node's inbox, proven under
        # the sandbox key its own key derives
        _send(stack, attacker, attacker, box.id, "echo attacker >> /workspace/ran")
        # Then it never ran, and the node's producer dead-lettered it
        assert _ran(box, "attacker") == 0
        wait_for(
            lambda: _refused(stack, since, "does not match the sandbox's key"), 20, "dead letter"
        )


def test_the_stacks_node_runs_on_librdkafka(stack: Settings, client: Any, db: Any) -> None:
    assert _runs_librdkafka(stack)
    _life(stack, client, db)
    _forged_direct_command_is_refused(stack, client)


def test_a_node_on_kafka_python_keeps_every_guarantee(
    node_on_kafka_python: Settings, client: Any, db: Any
) -> None:
    stack = node_on_kafka_python
    assert not _runs_librdkafka(stack)
    _life(stack, client, db)
    _forged_direct_command_is_refused(stack, client)


def test_the_publisher_partitions_as_kafka_python_and_says_what_it_lost(
    stack: Settings,
) -> None:
    own = stack.model_copy(update={"topic_prefix": f"rdk{uuid.uuid4().hex[:8]}"})
    ensure_topics(own)
    publisher = RdkafkaPublisher(own)
    try:
        count = publisher.partitions_of(own.topic_events, 5.0)
        assert count is not None and count > 1
        assert publisher.partitions_of(f"{own.topic_prefix}.nothing", 1.0) is None
        keys = [f"sbx-{i}" for i in range(40)]
        for key in keys:
            publisher.publish(own.topic_events, key, key.encode(), headers=[("h", b"v")])
        publisher.flush()
        consumer = bus.make_consumer(own)
        consumer.assign(bus.partitions(consumer, own.topic_events))
        landed: dict[str, int] = {}
        deadline = time.monotonic() + 30
        while len(landed) < len(keys) and time.monotonic() < deadline:
            for tp, records in consumer.poll(timeout_ms=500).items():
                for record in records:
                    assert record.headers == [("h", b"v")]
                    landed[record.key.decode()] = tp.partition
        consumer.close()
        assert landed == {key: key_partition(key, count) for key in keys}
        # A record the broker refuses (larger than the topic takes) is reported by the
        # next flush, once
        publisher.publish(own.topic_events, "k", b"v" * (own.max_message_bytes + 100_000))
        with pytest.raises(ServiceUnavailable, match="not delivered"):
            publisher.flush(10)
        publisher.flush()
        # A partition the topic lacks is refused at once
        with pytest.raises(ServiceUnavailable, match="partition"):
            publisher.publish(own.topic_events, "k", b"v", partition=count + 3)
    finally:
        publisher.close()
        drop_topics(own)
