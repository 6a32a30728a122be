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
import queue
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import ConfigResource, ConfigResourceType, NewTopic
from kafka.errors import (
    InvalidTopicError,
    KafkaError,
    MessageSizeTooLargeError,
    TopicAlreadyExistsError,
)
from pydantic import BaseModel

from app.config import EMBEDDED_BROKER_PARTITIONS, Settings
from app.domain.codec import encode
from app.domain.records import Inbound, Record
from app.domain.topics import TopicRole, TopicRules, TopicSpec, differences, plan
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
        # Topics are made by the platform with their partitions and settings
        # (ensure_topics), never by a client's metadata request: a broker that came
        # back empty otherwise got dsec.events back with its default of 4 partitions
        # from the first producer that asked.
        "allow_auto_create_topics": False,
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


def _admin(settings: Settings) -> KafkaAdminClient:
    try:
        options = client_options(settings)
        options.pop("allow_auto_create_topics")  # not an admin client's setting
        return KafkaAdminClient(**options, request_timeout_ms=10_000)
    except KafkaError as exc:
        raise ServiceUnavailable(f"Kafka at {settings.kafka_bootstrap}: {exc}") from exc


def drop_topics(settings: Settings, names: Iterable[str] | None = None) -> None:
    """Delete ``names``, or every topic of the settings' prefix (a benchmark's or a
    test's own)."""
    admin = _admin(settings)
    try:
        listed = admin.list_topics()
        if names is None:
            mine = [t for t in listed if t.startswith(f"{settings.topic_prefix}.")]
        else:
            mine = sorted(set(listed) & set(names))
        if mine:
            admin.delete_topics(mine)
    finally:
        admin.close()


#: Room for a record's headers and batch framing above its value.
_RECORD_OVERHEAD = 64 * 1024


def topic_rules(settings: Settings) -> TopicRules:
    """The topic plan's rules, from settings."""
    hour = 3_600_000
    log_ms = settings.log_retention_hours * hour
    largest = settings.max_message_bytes + _RECORD_OVERHEAD
    return TopicRules(
        prefix=settings.topic_prefix,
        partitions=settings.topic_partitions,
        reply_partitions=settings.reply_partitions,
        replication=settings.kafka_replication_factor,
        min_insync_replicas=settings.kafka_min_insync_replicas,
        retention_ms={
            TopicRole.REQUESTS: log_ms,
            TopicRole.EVENTS: log_ms,
            TopicRole.INBOX: log_ms,
            TopicRole.REPLIES: settings.replies_retention_hours * hour,
            TopicRole.DEAD_LETTERS: settings.dead_letters_retention_hours * hour,
        },
        # Replies too: larger outputs and files travel as pieces (ReplyPiece).
        max_message_bytes=dict.fromkeys(TopicRole, largest),
        embedded_partitions=EMBEDDED_BROKER_PARTITIONS if settings.embedded_broker else None,
    )


def ensure_topics(
    settings: Settings,
    tenants: Iterable[str] = (),
    nodes: Iterable[str] = (),
    *,
    platform: bool = True,
) -> list[str]:
    """Make the topics of the plan (:mod:`app.domain.topics`) that are missing: the
    platform's (unless ``platform`` is false), each tenant's replies topic and each
    node's inbox. Those that exist are checked against it (not on the embedded broker,
    which keeps no topic settings); returns how they fall short, each also logged."""
    specs = plan(topic_rules(settings), tenants, nodes, platform=platform)
    admin = _admin(settings)
    try:
        existing = set(admin.list_topics())
        for spec in specs.values():
            if spec.name in existing:
                continue
            new = NewTopic(
                spec.name, spec.partitions, spec.replication, topic_configs=dict(spec.configs)
            )
            with contextlib.suppress(TopicAlreadyExistsError):  # a concurrent `up`
                admin.create_topics([new])
        found = []
        if not settings.embedded_broker:
            found = _check(admin, [spec for spec in specs.values() if spec.name in existing])
    except KafkaError as exc:
        raise ServiceUnavailable(f"Kafka at {settings.kafka_bootstrap}: {exc}") from exc
    finally:
        admin.close()
    for finding in found:
        log.warning("topic made beforehand differs from the plan: %s", finding)
    return found


def _check(admin: KafkaAdminClient, specs: Sequence[TopicSpec]) -> list[str]:
    """How the pre-made topics of ``specs`` fall short of them."""
    if not specs:
        return []
    described = {t["name"]: t for t in admin.describe_topics([s.name for s in specs])}
    resources = [ConfigResource(ConfigResourceType.TOPIC, s.name) for s in specs]
    configs = _topic_configs(admin.describe_configs(resources))
    found: list[str] = []
    for spec in specs:
        parts = described.get(spec.name, {}).get("partitions", [])
        replication = min((len(p.get("replica_nodes", [])) for p in parts), default=0)
        found += differences(spec, len(parts), replication, configs.get(spec.name, {}))
    return found


def _topic_configs(answer: dict[str, Any]) -> dict[str, dict[str, str]]:
    """Topic settings by topic from kafka-python's DescribeConfigs answer,
    ``{"topic": {name: {key: {"value": ...}}}}`` (only those set on the topic)."""
    return {
        name: {
            key: str(data.get("value") if isinstance(data, dict) else data)
            for key, data in (entries or {}).items()
        }
        for name, entries in (answer or {}).get("topic", {}).items()
    }


#: Times a refused send is sent again (Publisher._send_failed).
RESENDS = 5


class _Send(NamedTuple):
    """One record as handed to :meth:`Publisher.publish`."""

    topic: str
    key: str
    value: bytes
    partition: int | None
    headers: Sequence[tuple[str, bytes]] | None
    attempt: int = 0


class Publisher:
    """Sends typed messages; thread-safe (one per process is enough)."""

    def __init__(self, settings: Settings, *, linger_ms: int = 0) -> None:
        self._settings = settings
        self._linger_ms = linger_ms
        self._lock = threading.Lock()
        self._producer = self._make()
        self._tracked: set[str] = set()
        # Sends that failed and wait to be sent again (see _send_failed), and those
        # given up on since the last flush.
        self._again: queue.Queue[_Send] = queue.Queue()
        self._settled = threading.Condition()
        self._resending = 0
        self._resent = 0
        self._given_up = 0
        self._resender: threading.Thread | None = None

    def _make(self) -> KafkaProducer:
        settings = self._settings
        try:
            return KafkaProducer(
                **client_options(settings),
                acks="all",
                linger_ms=self._linger_ms,
                # Replies may be large (an exec's output); consumers bound requests and
                # events themselves, by max_message_bytes.
                max_request_size=max(settings.max_message_bytes * 2, settings.max_reply_bytes),
                # Retried until delivered or delivery_timeout_ms (2 min): a broker that
                # restarts is back within seconds, and what was sent meanwhile arrives.
                **(
                    {"enable_idempotence": False, "max_in_flight_requests_per_connection": 1}
                    if settings.embedded_broker
                    else {"enable_idempotence": True}
                ),
            )
        except KafkaError as exc:
            raise ServiceUnavailable(f"Kafka at {settings.kafka_bootstrap}: {exc}") from exc

    def _dead(self) -> bool:
        """The producer failed for good: kafka-python aborts every batch of an
        idempotent producer whose producer id the broker lost (an embedded broker that
        came back empty), without a word to send() or flush()."""
        manager = getattr(self._producer, "_transaction_manager", None)
        return manager is not None and manager.has_fatal_error()

    def _renew(self) -> None:
        """Put a new producer in place of this one. (An idempotent producer whose
        broker came back empty is dead for good: the broker no longer knows its
        producer id.)"""
        with self._lock:
            old, self._producer = self._producer, self._make()
            self._tracked = set()
        with contextlib.suppress(Exception):
            old.close(timeout=0)

    def _failed(self, what: str, exc: KafkaError) -> ServiceUnavailable:
        """A send or flush failed: the next one goes through a new producer, and the
        caller hears of the failure."""
        self._renew()
        return ServiceUnavailable(f"{what}: {exc} (a new producer takes over)")

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
        the broker acknowledged it. Without ``wait``, a send the broker refuses is sent
        again (see :meth:`_send_failed`), and :meth:`flush` waits for that too."""
        value = message if isinstance(message, bytes) else encode(message)
        self._send(_Send(topic, key, value, partition, headers), wait)

    def _send(self, send: _Send, wait: bool = False) -> None:
        topic = send.topic
        if self._dead():
            # What it held is lost (the broker it was sent to is gone); what comes now
            # goes through a new producer.
            log.warning("Kafka producer failed for good: a new one takes over")
            self._renew()
        self._track(topic)
        try:
            future = self._producer.send(
                topic, key=send.key.encode(), value=send.value, partition=send.partition,
                headers=list(send.headers) if send.headers else None,
            )  # fmt: skip
            if wait:
                future.get(timeout=30)
            else:
                future.add_errback(lambda exc: self._send_failed(send, exc))
        except KafkaError as exc:
            raise self._failed(f"publish to {topic}", exc) from exc

    def _send_failed(self, send: _Send, exc: BaseException) -> None:
        """A send the broker refused, or that ran out of time (on the producer's I/O
        thread): send it again, up to RESENDS times, from a thread of its own.

        kafka-python retries only what Kafka calls retriable. The embedded broker that
        restarted empty answers a record it cannot store with an unknown error (a
        producer with the old broker's metadata wrote where a topic made anew then
        writes again), and a producer that failed for good aborts its batches: a
        record lost there would be a trainer's request, reply or a fact of the log.
        Consumers drop what arrives twice by id.
        """
        hopeless = isinstance(exc, MessageSizeTooLargeError | InvalidTopicError)
        if hopeless or send.attempt >= RESENDS:
            self._give_up(send, exc)
            return
        log.warning("a record for %s failed (%s): sending it again", send.topic, exc)
        with self._settled:
            self._resending += 1
            self._resent += 1
            if self._resender is None:
                self._resender = threading.Thread(
                    target=self._resend_loop, name="dsec-resend", daemon=True
                )
                self._resender.start()
        self._again.put(send)

    def _give_up(self, send: _Send, exc: BaseException) -> None:
        """The record is lost: say so, and let the next flush raise."""
        log.error("a record for %s is lost: %s", send.topic, exc)
        with self._settled:
            self._given_up += 1

    def _resend_loop(self) -> None:
        while True:
            send = self._again.get()
            time.sleep(0.05 * 2**send.attempt)
            try:
                self._send(send._replace(attempt=send.attempt + 1))
            except Exception as exc:  # a send that fails at once counts as given up
                self._give_up(send, exc)
            finally:
                with self._settled:
                    self._resending -= 1
                    self._settled.notify_all()

    def flush(self, timeout_s: float = 30.0) -> None:
        """Block until every message sent so far is acknowledged (those sent again
        included); raises if one could not be delivered since the last flush."""
        deadline = time.monotonic() + timeout_s
        while True:
            resent = self._resent
            try:
                self._producer.flush(timeout=max(deadline - time.monotonic(), 0.001))
            except KafkaError as exc:
                raise self._failed("flush", exc) from exc
            if self._dead():  # its batches were aborted, not acknowledged
                raise self._failed("flush", KafkaError("the producer failed for good"))
            with self._settled:
                if not self._settled.wait_for(
                    lambda: self._resending == 0, max(deadline - time.monotonic(), 0)
                ):
                    raise ServiceUnavailable("flush: records still being sent again")
                given_up, self._given_up = self._given_up, 0
                if given_up:
                    raise ServiceUnavailable(f"flush: {given_up} record(s) could not be sent")
            if self._resent != resent:  # sent again meanwhile: flush that too
                continue
            return

    def partitions_of(self, topic: str, wait_s: float) -> int | None:
        """How many partitions ``topic`` has, as this producer's metadata says; a topic
        it does not know is asked for, waiting ``wait_s`` at most (None: still unknown,
        or refused). kafka-python's own ``partitions_for`` would wait max_block_ms (60 s)."""
        found = self._producer._metadata.partitions_for_topic(topic)
        if found is None:
            try:
                found = self._producer._wait_on_metadata(topic, int(wait_s * 1000))
            except (KafkaError, ValueError):  # timed out, not authorized, a bad name
                return None
        return len(found) if found else None

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


class KafkaBus:
    """The bus port (:class:`app.ports.Bus`) over Kafka: a :class:`Publisher` for
    writes and one unsubscribed consumer, assigned per read, for reads."""

    def __init__(self, settings: Settings, publisher: Publisher | None = None) -> None:
        self._settings = settings
        self._publisher = publisher or Publisher(settings)
        self._reader = make_consumer(settings)
        self._lock = threading.Lock()

    def publish(
        self,
        topic: str,
        key: str,
        value: bytes,
        *,
        partition: int,
        headers: Sequence[tuple[str, bytes]] | None = None,
    ) -> None:
        self._publisher.publish(topic, key, value, partition=partition, headers=headers)

    def flush(self) -> None:
        self._publisher.flush()

    def read(
        self, topic: str, partition: int, offset: int, *, limit: int = 500, wait_s: float = 1.0
    ) -> list[Record]:
        tp = TopicPartition(topic, partition)
        deadline = time.monotonic() + wait_s
        with self._lock:
            try:
                self._reader.assign([tp])
                self._reader.seek(tp, offset)
                while True:
                    left_ms = max(int((deadline - time.monotonic()) * 1000), 0)
                    got = self._reader.poll(timeout_ms=min(left_ms, 200), max_records=limit)
                    records = got.get(tp, [])
                    if records or left_ms == 0:
                        break
            except KafkaError as exc:
                raise ServiceUnavailable(
                    f"Kafka at {self._settings.kafka_bootstrap}: {exc}"
                ) from exc
        return [
            Inbound(r.topic, r.partition, r.offset, r.key, r.value, list(r.headers or []))
            for r in records
        ]

    def end(self, topic: str, partition: int) -> int:
        tp = TopicPartition(topic, partition)
        return high_watermarks(self._settings, [tp])[tp]

    def close(self) -> None:
        """Flush what was published and let go of the broker."""
        self._publisher.close()
        self._reader.close()


def partitions(consumer: KafkaConsumer, topic: str) -> list[TopicPartition]:
    """All partitions of ``topic`` (raises if the topic does not exist)."""
    ids: Iterable[int] | None = consumer.partitions_for_topic(topic)
    if not ids:
        raise ServiceUnavailable(f"topic {topic} does not exist (is the stack up?)")
    return [TopicPartition(topic, p) for p in sorted(ids)]


class Incarnation:
    """Tells a consumer when its topic was made anew: a broker that came back empty
    (the embedded one keeps topics in memory) recreates topics under their names with
    new ids and offsets from zero, and answers a fetch past the new end with nothing,
    not an error, so a consumer would wait at its old position for good. Asked every
    few seconds (one metadata request)."""

    EVERY_S = 5.0

    def __init__(self, consumer: KafkaConsumer, topic: str) -> None:
        self._consumer = consumer
        self.topic = topic
        self.topic_id = topic_id(consumer, topic)
        self._checked_at = time.monotonic()

    def changed(self) -> bool:
        """True once per new incarnation (then :attr:`topic_id` names it)."""
        if time.monotonic() - self._checked_at < self.EVERY_S:
            return False
        self._checked_at = time.monotonic()
        self._consumer._client.cluster.request_update()  # its metadata, now
        found = _known_id(self._consumer, self.topic)
        if found is None:
            return False  # no answer for the topic now: no evidence of a new one
        if found == self.topic_id:
            return False
        # An id learned for the first time (none at start) is no new incarnation.
        first = self.topic_id == _nameless_id(self.topic)
        self.topic_id = found
        return not first


def _nameless_id(topic: str) -> uuid.UUID:
    """The id taken for a topic whose broker gives none."""
    return uuid.uuid5(uuid.NAMESPACE_URL, f"kafka-topic:{topic}")


def topic_id(consumer: KafkaConsumer, topic: str) -> uuid.UUID:
    """The broker's id for this incarnation of ``topic``.

    A broker that lost its data (the embedded one keeps topics in memory) recreates
    topics under the same names with new ids and offsets from zero; the id is how a
    consumer holding offsets in Postgres tells the two apart.
    """
    return _known_id(consumer, topic) or _nameless_id(topic)


def _known_id(consumer: KafkaConsumer, topic: str) -> uuid.UUID | None:
    """The id the consumer's metadata holds for ``topic``, if any."""
    # kafka-python keeps topic ids from metadata responses on its cluster object.
    found = consumer._client.cluster.topic_id(topic)
    if found is None:
        return None
    return found if isinstance(found, uuid.UUID) else uuid.UUID(str(found))
