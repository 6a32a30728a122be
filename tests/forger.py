"""An outsider answering a sandbox's commands first, on its trainer's replies
partition, with exit 0 and stdout of its choice and a proof under a key it made up
(tests/integration/test_trust.py, test_sdk_librdkafka.py)."""

from __future__ import annotations

import json
import os
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from app import bus
from app.config import Settings
from app.domain.codec import encode
from app.domain.proof import Purpose, headers, reply_key
from app.domain.replies import ExecOutput


class Forger:
    """How many replies it forged so far."""

    def __init__(self) -> None:
        self.forged = 0


@contextmanager
def forging(stack: Settings, sandbox_id: str, node_id: str) -> Iterator[Forger]:
    """While inside, every Exec for ``sandbox_id`` read on the requests topic or the
    node's inbox is answered by the outsider."""
    stop = threading.Event()
    forger = Forger()
    ready = threading.Event()

    def forge() -> None:
        consumer = bus.make_consumer(stack)
        parts = bus.partitions(consumer, stack.topic_requests)
        parts += bus.partitions(consumer, stack.node_topic(node_id))
        consumer.assign(parts)
        for tp, end in bus.high_watermarks(stack, parts).items():
            consumer.seek(tp, end)
        publisher = bus.Publisher(stack)
        ready.set()
        while not stop.is_set():
            for records in consumer.poll(timeout_ms=50).values():
                for record in records:
                    body = json.loads(record.value)
                    if body.get("type") != "Exec" or body.get("sandbox_id") != sandbox_id:
                        continue
                    lie = ExecOutput(
                        request_id=uuid.UUID(body["request_id"]), sandbox_id=sandbox_id,
                        exit_code=0, stdout_b64="Zm9yZ2VkCg==", stderr_b64="",
                        duration_ms=1.0,
                    )  # fmt: skip
                    value = encode(lie)
                    # Its best guess at a proof: a key it does not have.
                    guess = reply_key(os.urandom(32), lie.request_id)
                    publisher.publish(
                        body["reply_to"]["topic"], sandbox_id, value,
                        partition=body["reply_to"]["partition"],
                        headers=headers(Purpose.REPLY, None, guess, value),
                    )  # fmt: skip
                    publisher.flush()
                    forger.forged += 1
        publisher.close()
        consumer.close()

    thread = threading.Thread(target=forge, daemon=True)
    thread.start()
    ready.wait(timeout=10)
    try:
        yield forger
    finally:
        stop.set()
        thread.join(timeout=5)
