"""Reading the dead-letter topic back, and sending letters to where they came from.

A letter keeps the refused message's bytes, its key and its source topic, so once
the cause is gone (a projector upgraded to a schema version a producer already
speaks, a size limit raised) an operator can send it again. Replay is safe to repeat
for events: the log keeps one copy of an ``event_id``. A message whose cause
remains is refused again and comes back as a new letter, nothing is lost.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime

from pydantic import ValidationError

from app import bus
from app.config import Settings
from app.domain.dead_letter import DeadLetter


@dataclass(frozen=True)
class StoredLetter:
    """A letter and where it sits in the dead-letter topic."""

    partition: int
    offset: int
    letter: DeadLetter


@dataclass(frozen=True)
class LetterFilter:
    """Which letters an operator means; None matches anything."""

    reason: str | None = None
    consumer: str | None = None
    since: datetime | None = None

    def __call__(self, letter: DeadLetter) -> bool:
        """Whether ``letter`` is one of them."""
        return (
            (self.reason is None or letter.reason == self.reason)
            and (self.consumer is None or letter.consumer == self.consumer)
            and (self.since is None or letter.refused_at >= self.since)
        )


def read(
    settings: Settings,
    wanted: Callable[[DeadLetter], bool] = LetterFilter(),
    timeout_s: float = 30.0,
) -> Iterator[StoredLetter]:
    """The letters in the topic now (up to its end when called), oldest first per partition.

    Records of the topic that are not letters are skipped: this reader must not be
    the next thing that dies of a bad message.
    """
    consumer = bus.make_consumer(settings)
    try:
        parts = bus.partitions(consumer, settings.topic_dead_letters)
        ends = bus.end_offsets(consumer, parts)
        consumer.assign(parts)
        consumer.seek_to_beginning(*parts)
        left = {tp for tp in parts if ends[tp] > 0}
        deadline = time.monotonic() + timeout_s
        while left and time.monotonic() < deadline:
            for tp, records in consumer.poll(timeout_ms=200).items():
                for record in records:
                    if record.offset >= ends[tp]:
                        break
                    try:
                        letter = DeadLetter.model_validate_json(record.value or b"")
                    except ValidationError:
                        continue
                    if wanted(letter):
                        yield StoredLetter(tp.partition, record.offset, letter)
            left = {tp for tp in left if consumer.position(tp) < ends[tp]}
    finally:
        consumer.close()


@dataclass
class ReplayOutcome:
    """What a replay did."""

    sent: int = 0
    #: Letters that kept only the first bytes of a huge message: they cannot be sent.
    truncated: int = 0


def replay(settings: Settings, letters: Iterator[StoredLetter]) -> ReplayOutcome:
    """Publish each letter's original bytes to its source topic, with its key."""
    outcome = ReplayOutcome()
    publisher = bus.Publisher(settings)
    try:
        for stored in letters:
            letter = stored.letter
            if letter.original_truncated:
                outcome.truncated += 1
                continue
            original = base64.b64decode(letter.original_b64)
            proof = [(name, base64.b64decode(value)) for name, value in letter.headers]
            publisher.publish(letter.topic, letter.key or "", original, headers=proof)
            outcome.sent += 1
        publisher.flush()
    finally:
        publisher.close()
    return outcome
