"""The bus port (:class:`app.ports.Bus`) over Kafka, for what reads a partition from a
place of its choosing and the port's contract suite (tests/contracts/test_bus.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from kafka import TopicPartition
from kafka.errors import KafkaError

from app.bus import Publisher, end_offsets, make_consumer
from app.config import Settings
from app.domain.records import Inbound, Record
from app.errors import ServiceUnavailable


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
                    got = self._reader.poll(timeout_ms=left_ms, max_records=limit)
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
        with self._lock:
            return end_offsets(self._reader, [tp])[tp]

    def close(self) -> None:
        """Flush what was published and let go of the broker."""
        self._publisher.close()
        self._reader.close()
