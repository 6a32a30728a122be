"""A trainer's SDK on librdkafka (``DSEC_SDK_KAFKA_CLIENT=librdkafka``): the same
requests on the same partitions, the same proven replies, and forgeries dropped."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from kafka.partitioner.default import murmur2

from app import bus
from app.config import Settings
from app.sdk import Client
from app.sdk.transport_rdkafka import RdkafkaTransport
from tests.conftest import ensure_tenant
from tests.forger import forging

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def trainer(stack: Settings) -> Iterator[Client]:
    ensure_tenant(stack, "tests")
    settings = stack.model_copy(update={"sdk_kafka_client": "librdkafka"})
    with Client(settings, tenant="tests", job_id="librdkafka") as client:
        assert isinstance(client._transport, RdkafkaTransport)
        yield client


def _partitions_holding(stack: Settings, sandbox_id: str) -> set[int]:
    """The requests topic's partitions holding a record keyed by ``sandbox_id``."""
    consumer = bus.make_consumer(stack)
    consumer.assign(bus.partitions(consumer, stack.topic_requests))
    found: set[int] = set()
    deadline = time.monotonic() + 30
    while not found and time.monotonic() < deadline:
        for tp, records in consumer.poll(timeout_ms=500).items():
            found |= {tp.partition for r in records if r.key == sandbox_id.encode()}
    consumer.close()
    return found


def test_a_trainer_on_librdkafka_drives_a_sandbox_through_its_life(
    stack: Settings, trainer: Client
) -> None:
    with trainer.create(memory_mb=64) as box:
        # Commands: exit codes and output, an output larger than a reply (in pieces)
        first = box.exec("echo on librdkafka; exit 4")
        assert (first.exit_code, first.stdout) == (4, b"on librdkafka\n")
        big = box.exec("head -c 900000 /dev/zero | tr '\\0' x")
        assert big.ok and big.stdout == b"x" * 900_000
        # Files both ways
        box.write_file("/workspace/f", b"through librdkafka")
        assert box.read_file("/workspace/f") == b"through librdkafka"
    # And its create went to the partition kafka-python's partitioner picks
    consumer = bus.make_consumer(stack)
    count = len(bus.partitions(consumer, stack.topic_requests))
    consumer.close()
    expected = (murmur2(box.id.encode()) & 0x7FFFFFFF) % count
    assert _partitions_holding(stack, box.id) == {expected}


def test_a_forged_reply_never_reaches_a_trainer_on_librdkafka(
    stack: Settings, trainer: Client
) -> None:
    with trainer.create(memory_mb=64) as box:
        # Given an outsider answering first on the trainer's replies partition (the
        # commands take long enough that it always does)
        with forging(stack, box.id, box.node_id) as forger:
            time.sleep(1.0)
            before = trainer.forged_replies
            results: list[Any] = [box.exec("sleep 0.3; echo real; exit 3") for _ in range(5)]
        # Then every answer is the real one, and the forgeries were dropped
        assert [(r.exit_code, r.stdout) for r in results] == [(3, b"real\n")] * 5
        assert forger.forged >= 1 and trainer.forged_replies > before
