"""The Kafka adapter: topics, a publisher and statically assigned consumers.

Consumers here never join a consumer group: partitions are assigned statically and
positions are kept by the owner (Postgres for the projector and the scheduler, the
end of the partition for a trainer waiting for replies). Group joins on Tansu take
10-30 s, and offsets stored next to the data they produced are what gives exactly
once anyway.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import NewTopic
from kafka.errors import KafkaError, TopicAlreadyExistsError
from pydantic import BaseModel

from app.codec import encode
from app.config import Settings
from app.errors import ServiceUnavailable

log = logging.getLogger(__name__)


def _servers(settings: Settings) -> list[str]:
    return [s.strip() for s in settings.kafka_bootstrap.split(",") if s.strip()]


def client_options(settings: Settings) -> dict[str, Any]:
    """Bootstrap servers and security settings every Kafka client of ours takes (TLS,
    SASL PLAIN/SCRAM, client certificates): one principal per process, the one Kafka's
    ACLs know it by (docs/security.md)."""
    options: dict[str, Any] = {
        "bootstrap_servers": _servers(settings),
        "security_protocol": settings.kafka_security_protocol,
    }
    if settings.kafka_sasl_mechanism:
        password = (
            settings.kafka_sasl_password_file.read_text().strip()
            if settings.kafka_sasl_password_file
            else None
        )
        options.update(
            sasl_mechanism=settings.kafka_sasl_mechanism,
            sasl_plain_username=settings.kafka_sasl_username,
            sasl_plain_password=password,
        )
    for name in ("cafile", "certfile", "keyfile"):
        path = getattr(settings, f"kafka_ssl_{name}")
        if path is not None:
            options[f"ssl_{name}"] = str(path)
    return options


def ensure_topics(settings: Settings, tenants: Iterable[str] = ()) -> None:
    """Create the platform's topics, and each tenant's replies topic, if missing."""
    wanted = {
        settings.topic_requests: settings.topic_partitions,
        settings.topic_events: settings.topic_partitions,
        settings.topic_dead_letters: 1,
    }
    for tenant in tenants:
        wanted[settings.replies_topic(tenant)] = settings.reply_partitions
    try:
        admin = KafkaAdminClient(**client_options(settings), request_timeout_ms=10_000)
    except KafkaError as exc:
        raise ServiceUnavailable(f"Kafka at {settings.kafka_bootstrap}: {exc}") from exc
    try:
        existing = set(admin.list_topics())
        for name, partitions in wanted.items():
            if name in existing:
                continue
            with contextlib.suppress(TopicAlreadyExistsError):  # a concurrent `up`
                admin.create_topics([NewTopic(name, partitions, 1)])
    except KafkaError as exc:
        raise ServiceUnavailable(f"Kafka at {settings.kafka_bootstrap}: {exc}") from exc
    finally:
        admin.close()


class Publisher:
    """Sends typed messages; thread-safe (one per process is enough)."""

    def __init__(self, settings: Settings, *, linger_ms: int = 0) -> None:
        try:
            self._producer = KafkaProducer(
                **client_options(settings),
                acks="all",
                linger_ms=linger_ms,
                # Replies may be large (an exec's output); consumers bound requests and
                # events themselves, by max_message_bytes.
                max_request_size=max(settings.max_message_bytes * 2, settings.max_reply_bytes),
                retries=5,
            )
        except KafkaError as exc:
            raise ServiceUnavailable(f"Kafka at {settings.kafka_bootstrap}: {exc}") from exc
        self._tracked: set[str] = set()

    def _track(self, topic: str) -> None:
        """Make the producer's metadata follow ``topic`` for good.

        kafka-python 3.0.12: a producer whose bootstrap metadata listed every topic
        tracks none of them; the first topic it must look up later (a new tenant's
        replies topic) replaces its metadata with that topic alone, the partitions it
        sent to before lose their leader, and its sender thread asks for metadata in a
        tight loop: a whole core, for good (seen on the scheduler after a tenant was
        created). Tracking each topic on first use keeps them all in every refresh.
        """
        if topic not in self._tracked:
            self._producer._sender.add_topic(topic)
            self._tracked.add(topic)

    def publish(
        self,
        topic: str,
        key: str,
        message: BaseModel | bytes,
        *,
        partition: int | None = None,
        wait: bool = False,
        headers: Sequence[tuple[str, bytes]] | None = None,
    ) -> None:
        """Send one message (with its proof in ``headers``); with ``wait`` block until
        the broker acknowledged it."""
        value = message if isinstance(message, bytes) else encode(message)
        self._track(topic)
        try:
            future = self._producer.send(
                topic, key=key.encode(), value=value, partition=partition,
                headers=list(headers) if headers else None,
            )  # fmt: skip
            if wait:
                future.get(timeout=30)
        except KafkaError as exc:
            raise ServiceUnavailable(f"publish to {topic}: {exc}") from exc

    def flush(self, timeout_s: float = 30.0) -> None:
        """Block until every message sent so far is acknowledged."""
        try:
            self._producer.flush(timeout=timeout_s)
        except KafkaError as exc:
            raise ServiceUnavailable(f"flush: {exc}") from exc

    def close(self) -> None:
        """Flush and close."""
        self._producer.close(timeout=10)


def make_consumer(settings: Settings, **overrides: Any) -> KafkaConsumer:
    """A consumer without group membership and without auto-commit."""
    options: dict[str, Any] = {
        **client_options(settings),
        "group_id": None,
        "enable_auto_commit": False,
        "fetch_max_wait_ms": settings.fetch_max_wait_ms,
        "auto_offset_reset": "earliest",
        "max_partition_fetch_bytes": max(settings.max_message_bytes * 2, 1 << 20),
    }
    options.update(overrides)
    try:
        return KafkaConsumer(**options)
    except KafkaError as exc:
        raise ServiceUnavailable(f"Kafka at {settings.kafka_bootstrap}: {exc}") from exc


def high_watermarks(
    settings: Settings, parts: Sequence[TopicPartition], timeout_s: float = 10.0
) -> dict[TopicPartition, int]:
    """The partitions' ends (next offset to be written), as fetch responses report them.

    The embedded broker answers ListOffsets (``end_offsets``) with the base offset of
    the partition's last record batch plus one: after a batch of three records at
    offsets 1-3 it says 2, not 4. A consumer that compared its stored position with
    that took a valid position for one past the end. A fetch's high watermark is right,
    so a probe consumer fetches from the claimed end and reads it.
    """
    probe = make_consumer(settings)
    try:
        probe.assign(list(parts))
        claimed: dict[TopicPartition, int] = probe.end_offsets(list(parts))
        for tp, end in claimed.items():
            probe.seek(tp, end)
        found: dict[TopicPartition, int] = {}
        deadline = time.monotonic() + timeout_s
        while len(found) < len(parts) and time.monotonic() < deadline:
            probe.poll(timeout_ms=100)
            for tp in parts:
                mark = probe.highwater(tp)
                if mark is not None:
                    found[tp] = max(mark, claimed[tp])
        if len(found) < len(parts):
            raise ServiceUnavailable(f"Kafka at {settings.kafka_bootstrap}: no high watermark")
        return found
    except KafkaError as exc:
        raise ServiceUnavailable(f"Kafka at {settings.kafka_bootstrap}: {exc}") from exc
    finally:
        probe.close()


def partitions(consumer: KafkaConsumer, topic: str) -> list[TopicPartition]:
    """All partitions of ``topic`` (raises if the topic does not exist)."""
    ids: Iterable[int] | None = consumer.partitions_for_topic(topic)
    if not ids:
        raise ServiceUnavailable(f"topic {topic} does not exist (is the stack up?)")
    return [TopicPartition(topic, p) for p in sorted(ids)]


def topic_id(consumer: KafkaConsumer, topic: str) -> uuid.UUID:
    """The broker's id for this incarnation of ``topic``.

    A broker that lost its data (the embedded one keeps topics in memory) recreates
    topics under the same names with new ids and offsets from zero; the id is how a
    consumer holding offsets in Postgres tells the two apart.
    """
    # kafka-python keeps topic ids from metadata responses on its cluster object.
    found = consumer._client.cluster.topic_id(topic)
    if found is None:
        return uuid.uuid5(uuid.NAMESPACE_URL, f"kafka-topic:{topic}")
    return found if isinstance(found, uuid.UUID) else uuid.UUID(str(found))
