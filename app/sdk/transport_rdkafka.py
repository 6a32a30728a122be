"""A client's transport over librdkafka (confluent-kafka), for trainers that count
milliseconds: ``DSEC_SDK_KAFKA_CLIENT=librdkafka`` (or
``Client(transport=RdkafkaTransport(settings, credential.kafka))``).

kafka-python carries every request and reply in Python threads: on these machines a
produce waits 3.0 ms p50 for its acknowledgement and one hop takes 3.6 ms, against
1.2 and 1.5 ms for librdkafka on the same broker, and a trainer's process spent ~5.8
ms of CPU per serial command against ~0.9 in its own code (docs/BENCHMARKS.md,
session 30). This transport keeps the same contract as
:class:`app.sdk.transport.KafkaTransport`: requests keyed by sandbox land on the
partition kafka-python's default partitioner picks (``murmur2_random``), every
producer is idempotent with acks from all in-sync replicas, and one partition of the
tenant's replies topic is followed from the end it has when the client starts.

confluent-kafka is not a dependency of the SDK: install its ``librdkafka`` extra
(``pip install 'dsec-sdk[librdkafka]'``, confluent-kafka 2.6.1 or newer for SCRAM
against Kafka 4). The settings are the platform's (:mod:`app.rdkafka_config`).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from app import bus
from app.config import Settings
from app.domain.records import Inbound
from app.errors import ServiceUnavailable
from app.rdkafka_config import (
    Deliveries,
    consumer_config,
    inbound,
    listed_partitions,
    load,
    producer_config,
    take,
)
from app.sdk.reader import ReplySource
from app.sdk.transport import Headers

#: Most replies taken in one poll.
BATCH = 500


class RdkafkaTransport:
    """An idempotent librdkafka producer for requests, and a librdkafka consumer
    assigned to one replies partition (no group: nothing is committed)."""

    def __init__(
        self,
        settings: Settings,
        login: bus.KafkaLogin | None = None,
        delivery_timeout_s: float = 120.0,
    ) -> None:
        self._kafka = confluent_kafka = load()
        self._settings = settings
        self._producer = confluent_kafka.Producer(
            producer_config(settings, login, delivery_timeout_s)
        )
        self._consumer = confluent_kafka.Consumer(consumer_config(settings, login))
        self._deliveries = Deliveries(lambda: self._producer)

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
        def delivered(error: Any, _message: Any) -> None:
            if error is not None:
                if on_failure is not None:
                    on_failure(ServiceUnavailable(f"Kafka: {topic}: {error}"))
            elif on_stored is not None:
                on_stored()

        try:
            sent: list[tuple[str, str | bytes | None]] | None = list(headers) if headers else None
            self._producer.produce(
                topic, value, key=key.encode(), headers=sent, on_delivery=delivered
            )
        except (self._kafka.KafkaException, BufferError) as exc:
            raise ServiceUnavailable(f"Kafka: sending to {topic}: {exc}") from exc

    def follow(self, topic: str) -> tuple[int, ReplySource] | None:
        """One partition of ``topic``, picked at random, from its end now."""
        kafka = self._kafka
        try:
            listed = listed_partitions(self._consumer, topic, 10)
            if listed is None:
                return None
            partition = random.choice(listed)
            part = kafka.TopicPartition(topic, partition)
            _low, high = self._consumer.get_watermark_offsets(part, timeout=10)
            self._consumer.assign([kafka.TopicPartition(topic, partition, high)])
        except kafka.KafkaException as exc:
            raise ServiceUnavailable(
                f"Kafka at {self._settings.kafka_bootstrap}: cannot follow {topic}: {exc}"
            ) from exc
        return partition, _RdkafkaReplies(self._consumer, kafka)

    def close(self) -> None:
        self._producer.flush(10)
        self._deliveries.stop()
        self._consumer.close()


class _RdkafkaReplies:
    """The consumer of a replies partition as a :class:`ReplySource`."""

    def __init__(self, consumer: Any, kafka: Any) -> None:
        self._consumer = consumer
        self._kafka = kafka

    def poll(self, timeout_ms: int) -> Mapping[Any, Sequence[Inbound]]:
        try:
            messages = take(self._consumer, timeout_ms / 1000, BATCH)
        except self._kafka.KafkaException as exc:
            raise ServiceUnavailable(f"Kafka: reading replies: {exc}") from exc
        found: dict[tuple[str, int], list[Inbound]] = {}
        for message in messages:
            error = message.error()
            if error is not None:
                if error.fatal():
                    raise ServiceUnavailable(f"Kafka: reading replies: {error}")
                continue  # transient: librdkafka retries by itself
            record = inbound(message)
            found.setdefault((record.topic, record.partition), []).append(record)
        return found
