"""How a :class:`app.sdk.Client` reaches the platform: it sends requests and follows
one partition of its tenant's replies topic, and nothing more.

:class:`KafkaTransport` is the one a trainer uses (a producer and an unsubscribed
consumer, built from the settings and the credential's Kafka login);
:class:`app.memory.InMemoryTransport` puts the same requests on an in-memory bus, so a
unit test drives a real client against the real dispatcher and node
(tests/unit/test_round_trip.py).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from kafka import KafkaConsumer, TopicPartition
from kafka.errors import KafkaError

from app import bus
from app.config import Settings
from app.domain.records import Record
from app.errors import ServiceUnavailable
from app.sdk.reader import ReplySource

Headers = list[tuple[str, bytes]]


class Transport(Protocol):
    """What a client sends with and reads its replies from."""

    def publish(
        self,
        topic: str,
        key: str,
        value: bytes,
        *,
        headers: Headers | None = None,
        on_failure: Callable[[BaseException], None] | None = None,
        on_stored: Callable[[], None] | None = None,
    ) -> None:
        """Send one request (keyed: its partition is its key's); ``on_stored`` hears
        that the brokers took it, ``on_failure`` that they never will."""
        ...

    def follow(self, topic: str) -> tuple[int, ReplySource] | None:
        """Follow one partition of the replies topic ``topic`` from its end (resolved
        now: replies to the first request sent after must count): its number, and
        the source of its records; None if there is no such topic."""
        ...

    def close(self) -> None:
        """Flush what was sent and let go of the brokers."""
        ...


class KafkaTransport:
    """A producer for requests, and a consumer assigned to one replies partition."""

    def __init__(
        self, settings: Settings, login: bus.KafkaLogin | None, delivery_timeout_s: float
    ) -> None:
        self._settings = settings
        self._publisher = bus.Publisher(
            settings, login=login, delivery_timeout_s=delivery_timeout_s
        )
        try:
            self._consumer = bus.make_consumer(settings, login=login, auto_offset_reset="latest")
        except BaseException:
            self._publisher.close()
            raise

    def publish(
        self,
        topic: str,
        key: str,
        value: bytes,
        *,
        headers: Headers | None = None,
        on_failure: Callable[[BaseException], None] | None = None,
        on_stored: Callable[[], None] | None = None,
    ) -> None:
        self._publisher.publish(
            topic, key, value, headers=headers, on_failure=on_failure, on_stored=on_stored
        )

    def follow(self, topic: str) -> tuple[int, ReplySource] | None:
        """One partition of ``topic``, picked at random (the consumer reads it alone)."""
        try:
            found = self._consumer.partitions_for_topic(topic)
            if not found:
                return None
            tp = TopicPartition(topic, random.choice(sorted(found)))
            self._consumer.assign([tp])
            self._consumer.seek_to_end(tp)
            self._consumer.position(tp)
        except KafkaError as exc:
            raise ServiceUnavailable(
                f"Kafka at {self._settings.kafka_bootstrap}: cannot follow {topic}: {exc}"
            ) from exc
        return tp.partition, _KafkaReplies(self._consumer)

    def close(self) -> None:
        self._publisher.close()
        self._consumer.close()


class _KafkaReplies:
    """The consumer of a replies partition as a :class:`ReplySource`, its errors the
    platform's."""

    def __init__(self, consumer: KafkaConsumer) -> None:
        self._consumer = consumer

    def poll(self, timeout_ms: int) -> Mapping[Any, Sequence[Record]]:
        try:
            found: Mapping[Any, Sequence[Record]] = self._consumer.poll(timeout_ms=timeout_ms)
        except KafkaError as exc:
            raise ServiceUnavailable(f"Kafka: reading replies: {exc}") from exc
        return found
