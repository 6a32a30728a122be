"""What the scheduler does with an outbox (:class:`app.control.outbox.Outbox`): the
one way its decisions leave the process, through the ports (:mod:`app.ports`), so
the scheduler sends over Kafka and Celery and a unit test over the in-memory bus and
task queue (tests/unit/test_round_trip.py) with the same code.
"""

from __future__ import annotations

from collections.abc import Callable

from app.control.outbox import Outbox
from app.domain.proof import SCHEDULER_KEY_ID, Purpose, headers
from app.ports import Producer, TaskQueue


def send_outbox(
    out: Outbox,
    producer: Producer,
    tasks: TaskQueue,
    events_topic: str,
    secret: bytes,
    inboxes: Callable[[set[str]], None] = lambda _topics: None,
) -> None:
    """Send what one batch decided, proven with the scheduler's ``secret``: events,
    replies, tasks and node inbox records (dead letters are the caller's). ``inboxes``
    is told the node inbox topics about to be written, before they are."""
    for key, value in out.events:
        proof = headers(Purpose.EVENT, SCHEDULER_KEY_ID, secret, value)
        producer.publish(events_topic, key, value, headers=proof)
    for reply_to, key, value, proof in out.replies:
        producer.publish(reply_to.topic, key, value, partition=reply_to.partition, headers=proof)
    if out.events or out.replies:
        # Lifecycle events are acknowledged before any node hears of the sandbox,
        # so Scheduled precedes Started in the sandbox's partition.
        producer.flush()
    for task, queue, args in out.tasks:
        tasks.send(task, queue, args)
    if out.inbox:
        inboxes({topic for topic, _key, _value in out.inbox})
        for topic, key, value in out.inbox:
            # The inbox is one partition: the node's commands in the order decided.
            producer.publish(topic, key, value, partition=0)
        # Acknowledged before the requests' offsets are saved: a crash in between
        # sends them again (the node's claim makes that harmless), never loses one.
        producer.flush()
