"""The platform's Kafka clients over librdkafka (confluent-kafka), beside kafka-python's
(:mod:`app.bus`, :mod:`app.consuming`): what a node reads its inbox and sends its
events and replies with (``DSEC_NODE_KAFKA_CLIENT``, librdkafka by default; the
settings, shared with a trainer's SDK on librdkafka, are :mod:`app.rdkafka_config`).

Why: on these machines kafka-python waits 3.0 ms p50 for a produce's acknowledgement
and spends 3.8-5.7 ms of CPU per serial record in Python threads, against 1.2 ms and a
fraction of that for librdkafka on the same broker (docs/BENCHMARKS.md, session 30).
A command crosses the node's inbox and comes back through its producer: both sit on
the exec path. With the node on librdkafka a serial command from an SDK on librdkafka
took 4.1-5.7 ms p50 against 7.3-8.6 on kafka-python (same runs, docs/BENCHMARKS.md).

The contract is kafka-python's: a record sent without a partition lands on the one
kafka-python's default partitioner picks (``murmur2_random``), so a sandbox's events
stay in one partition whichever client a node runs; producers are idempotent with
acks from every in-sync replica; a reader commits nothing anywhere and reports the
same topic id, so positions stored by one client are positions for the other.

confluent-kafka is a dependency of the server (an optional one of the SDK); it is
imported when one of these clients is made.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Collection, Sequence
from typing import Any

from app import bus, metrics
from app.config import Settings
from app.domain.records import Record, StoredOffset, first_offsets, not_a_position
from app.errors import ServiceUnavailable
from app.ports import Headers
from app.rdkafka_config import (
    Deliveries,
    consumer_config,
    inbound,
    listed_partitions,
    load,
    producer_config,
    rdkafka_config,
    take,
)

log = logging.getLogger(__name__)

#: How long a send waits for room in a full local queue before it is refused.
QUEUE_FULL_WAIT_S = 30.0
#: How often a reader says how far behind it is (metrics.CONSUMER_LAG).
LAG_EVERY_S = 5.0
#: How long a lookup of metadata or offsets at the broker may take.
LOOKUP_S = 10.0


def topic_uuid(found: Any) -> uuid.UUID:
    """confluent-kafka's Uuid as :class:`uuid.UUID` (the value kafka-python reports)."""
    high = found.get_most_significant_bits() & ((1 << 64) - 1)
    low = found.get_least_significant_bits() & ((1 << 64) - 1)
    return uuid.UUID(int=(high << 64) | low)


class RdkafkaPublisher:
    """An idempotent librdkafka producer: the :class:`app.ports.Producer` a node's
    courier sends with, and the partition counts of its metadata
    (:class:`app.partition_cache.Metadata`). Thread-safe."""

    def __init__(self, settings: Settings, *, login: bus.KafkaLogin | None = None) -> None:
        self._kafka = load()
        self._config = {**producer_config(settings, login), "error_cb": self._error}
        self._lock = threading.Lock()
        self._failures = 0
        self._last_failure: str | None = None
        self._fatal = False
        #: Partition counts the broker last gave, by topic.
        self._counts: dict[str, int] = {}
        self._producer = self._kafka.Producer(self._config)
        self._deliveries = Deliveries(self._current)

    def _current(self) -> Any:
        with self._lock:
            return self._producer

    def _error(self, error: Any) -> None:
        """librdkafka's client-wide errors: a fatal one (an idempotent producer fenced
        or out of sequence) retires this producer at the next send."""
        if error.fatal():
            log.error("Kafka producer failed for good: %s", error)
            self._fatal = True
        else:
            log.debug("Kafka producer: %s", error)

    def _delivered(self, error: Any, _message: Any) -> None:
        if error is not None:
            log.error("a record could not be delivered: %s", error)
            with self._lock:
                self._failures += 1
                self._last_failure = str(error)

    def _renew(self) -> None:
        """A new producer (a new producer id) in place of one that failed for good."""
        new = self._kafka.Producer(self._config)
        with self._lock:
            old, self._producer, self._fatal = self._producer, new, False
        old.flush(0)

    def publish(
        self,
        topic: str,
        key: str,
        value: bytes,
        /,
        *,
        partition: int | None = None,
        headers: Headers | None = None,
    ) -> None:
        """Send one record (to the partition of its key where ``partition`` is None)."""
        if self._fatal:
            log.warning("Kafka producer failed for good: a new one takes over")
            self._renew()
        options: dict[str, Any] = {"key": key.encode(), "on_delivery": self._delivered}
        if partition is not None:
            options["partition"] = partition
        if headers:
            options["headers"] = list(headers)
        deadline = time.monotonic() + QUEUE_FULL_WAIT_S
        while True:
            try:
                self._producer.produce(topic, value, **options)
                return
            except BufferError as exc:  # the local queue is full: wait for room
                if time.monotonic() > deadline:
                    raise ServiceUnavailable(f"publish to {topic}: {exc}") from exc
                self._producer.poll(0.1)
            except self._kafka.KafkaException as exc:
                raise ServiceUnavailable(f"publish to {topic}: {exc}") from exc

    def flush(self, timeout_s: float = 30.0) -> None:
        """Block until every record sent so far is acknowledged; raises
        :class:`ServiceUnavailable` if one was not, or could not be, since the last."""
        left = self._producer.flush(timeout_s)
        with self._lock:
            failures, self._failures = self._failures, 0
            last, self._last_failure = self._last_failure, None
        if left:
            raise ServiceUnavailable(f"flush: {left} record(s) not acknowledged in {timeout_s} s")
        if failures:
            raise ServiceUnavailable(f"flush: {failures} record(s) not delivered: {last}")

    def partitions_of(self, topic: str, wait_s: float) -> int | None:
        """How many partitions ``topic`` has, as the broker's metadata says (None: no
        such topic, or not one this principal may see).

        librdkafka asks the broker each time. A broker that does not answer within
        ``wait_s`` (slow, or away) gets the count it last gave for a topic (None if
        it never gave one): a slow broker must not make every reply's topic unknown,
        as kafka-python's metadata, answered locally, never did."""
        try:
            listed = listed_partitions(self._producer, topic, wait_s)
        except self._kafka.KafkaException:
            return self._counts.get(topic)
        if listed is None:
            self._counts.pop(topic, None)
            return None
        self._counts[topic] = len(listed)
        return self._counts[topic]

    def close(self) -> None:
        """Flush (10 s at most) and stop."""
        self._producer.flush(10)
        self._deliveries.stop()


class RdkafkaReader:
    """Reads chosen partitions of one topic from positions its owner stores: the
    :class:`app.ports.PositionedReader` over librdkafka. Nothing is committed.

    It keeps each partition's position itself and hands librdkafka an assignment at
    those offsets on the next poll after a move (a seek, a rewind, a reassign).

    librdkafka fetches in the background, and the broker holds a fetch that finds
    nothing for ``fetch_max_wait_ms`` (5 s) and answers the next requests of that
    connection only after it: a move or a lookup of offsets on a client that has
    fetched would wait that long. Those (rare: a node's inbox seeks once, when it
    starts) are done on a new client instead, which costs a connection and a login.
    """

    def __init__(
        self,
        settings: Settings,
        topic: str,
        name: str,
        partitions: Sequence[int] | None = None,
        *,
        login: bus.KafkaLogin | None = None,
    ) -> None:
        self._kafka = load()
        self.topic = topic
        self.name = name
        self._config = consumer_config(settings, login)
        self._consumer = self._kafka.Consumer(self._config)
        #: Whether the client may hold a fetch at the broker (it has been polled).
        self._fetching = False
        #: Whether positions moved since librdkafka was last told.
        self._moved = True
        try:
            listed = listed_partitions(self._consumer, topic, LOOKUP_S)
            found_id = self._topic_id_of(rdkafka_config(settings, login), topic)
        except self._kafka.KafkaException as exc:
            self._consumer.close()
            raise ServiceUnavailable(f"Kafka: partitions of {topic}: {exc}") from exc
        if listed is None:
            self._consumer.close()
            raise ServiceUnavailable(f"topic {topic} does not exist (is the stack up?)")
        #: Every partition of the topic (a caller may read only some).
        self.all_partitions = listed
        chosen = set(partitions) if partitions is not None else None
        #: The partitions read.
        self.partitions = [p for p in self.all_partitions if chosen is None or p in chosen]
        self._topic_id = found_id
        #: The offset of the next record of each partition read, once known (one not
        #: yet positioned is read from its beginning).
        self._next: dict[int, int] = {}
        self._lag_at = 0.0

    def _topic_id_of(self, config: dict[str, Any], topic: str) -> uuid.UUID:
        """The topic's id, asked through an admin client with ``config`` (the brokers
        and login alone)."""
        from confluent_kafka import TopicCollection
        from confluent_kafka.admin import AdminClient

        admin = AdminClient(config)
        described = admin.describe_topics(TopicCollection([topic]))[topic].result(LOOKUP_S)
        return topic_uuid(described.topic_id)

    def _tp(self, partition: int, offset: int | None = None) -> Any:
        if offset is None:
            return self._kafka.TopicPartition(self.topic, partition)
        return self._kafka.TopicPartition(self.topic, partition, offset)

    def _quiet(self) -> None:
        """A client that holds no fetch: this one, or a new one in its place."""
        if self._fetching:
            self._consumer.close()
            self._consumer = self._kafka.Consumer(self._config)
            self._fetching = False
            self._moved = True

    def _watermarks(self, partition: int) -> tuple[int, int]:
        self._quiet()
        try:
            low, high = self._consumer.get_watermark_offsets(self._tp(partition), timeout=LOOKUP_S)
        except self._kafka.KafkaException as exc:
            raise ServiceUnavailable(f"Kafka: offsets of {self.topic}: {exc}") from exc
        return int(low), int(high)

    def _assign(self) -> None:
        """Read from the positions kept, from the next poll on."""
        self._quiet()
        self._moved = True

    @property
    def topic_id(self) -> uuid.UUID:
        """The broker's id of the topic being read (owners store offsets with it)."""
        return self._topic_id

    def seek(
        self, stored: dict[int, StoredOffset], only: Collection[int] | None = None
    ) -> list[str]:
        """Read each partition (or ``only`` those) from its stored offset; see
        :meth:`app.ports.PositionedReader.seek`."""
        warnings: list[str] = []
        parts = [p for p in self.partitions if only is None or p in only]
        for p in parts:
            low, high = self._watermarks(p)
            saved = stored.get(p)
            why = (
                not_a_position(self.name, self.topic, p, saved, self.topic_id, high)
                if saved is not None
                else None
            )
            if saved is not None and why is None:
                self._next[p] = saved.next_offset
            else:
                self._next[p] = low
                if why is not None:
                    warnings.append(why)
        if parts:
            self._assign()
        for warning in warnings:
            log.warning(warning)
        return warnings

    def reassign(self, partitions: Collection[int], stored: dict[int, StoredOffset]) -> list[str]:
        """Read ``partitions`` from now on: those kept go on from where they stand, new
        ones start at their ``stored`` offsets (see :meth:`seek`)."""
        kept = set(self.partitions) & set(partitions)
        self.partitions = [p for p in self.all_partitions if p in set(partitions)]
        self._next = {p: offset for p, offset in self._next.items() if p in kept}
        new = [p for p in self.partitions if p not in kept]
        if not new:
            self._assign()
            return []
        return self.seek(stored, new)

    def poll(self, timeout_ms: int = 200, max_records: int = 2000) -> list[Record]:
        """The next records of the partitions read, in order within each; raises
        :class:`ServiceUnavailable` while no broker answers."""
        if not self.partitions:
            time.sleep(timeout_ms / 1000)
            return []
        if self._moved:
            beginning = self._kafka.OFFSET_BEGINNING
            self._consumer.assign(
                [self._tp(p, self._next.get(p, beginning)) for p in self.partitions]
            )
            self._moved = False
        self._fetching = True
        try:
            messages = take(self._consumer, timeout_ms / 1000, max_records)
        except self._kafka.KafkaException as exc:
            raise ServiceUnavailable(f"Kafka: reading {self.topic}: {exc}") from exc
        out: list[Record] = []
        for message in messages:
            error = message.error()
            if error is not None:
                if error.fatal() or error.code() == self._kafka.KafkaError._ALL_BROKERS_DOWN:
                    raise ServiceUnavailable(f"Kafka: reading {self.topic}: {error}")
                log.debug("%s: %s", self.name, error)  # librdkafka retries by itself
                continue
            partition, offset = message.partition(), message.offset()
            self._next[partition] = offset + 1
            out.append(inbound(message))
        self._measure_lag()
        return out

    def _measure_lag(self) -> None:
        """Each partition's lag every :data:`LAG_EVERY_S`, from the ends the last
        fetches reported (no request of its own)."""
        now = time.monotonic()
        if now - self._lag_at < LAG_EVERY_S:
            return
        self._lag_at = now
        for p in self.partitions:
            _low, high = self._consumer.get_watermark_offsets(self._tp(p), cached=True)
            if high >= 0 and p in self._next:
                lag = max(high - self._next[p], 0)
                metrics.CONSUMER_LAG.labels(self.name, self.topic, str(p)).set(lag)

    def rewind(self, records: Sequence[Record]) -> None:
        """Read ``records`` again: each of their partitions back to the first of them."""
        back = first_offsets(records)
        if back:
            self._next.update(back)
            self._assign()

    def ends(self) -> dict[int, int]:
        """Each partition read and its end (the offset its next record gets)."""
        return {p: self._watermarks(p)[1] for p in self.partitions}

    def position(self, partition: int) -> int:
        """The offset the next read of ``partition`` starts at."""
        if partition not in self._next:  # never positioned, nothing read: its beginning
            self._next[partition] = self._watermarks(partition)[0]
        return self._next[partition]

    def close(self) -> None:
        """Let go of the topic."""
        self._consumer.close()
