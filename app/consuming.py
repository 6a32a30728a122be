"""A consumer whose position lives in Postgres, beside the data it produced."""

from __future__ import annotations

import base64
import logging
import threading
import time
import uuid
from collections.abc import Collection, Sequence
from datetime import datetime
from typing import Any

from kafka import TopicPartition
from kafka.errors import KafkaError

from app import bus, metrics
from app.config import Settings
from app.domain.base import MAX_DETAIL, utcnow
from app.domain.codec import DeadLetterReason, encode
from app.domain.dead_letter import DeadLetter
from app.domain.partitioner import key_partition
from app.domain.records import Record, StoredOffset, first_offsets, not_a_position
from app.errors import ServiceUnavailable
from app.ports import Producer

log = logging.getLogger(__name__)

#: Re-exported: the partitioner is the domain's (the gate checks it too).
__all__ = ["PositionedConsumer", "dead_letter", "key_partition"]


#: How often a consumer says how far behind it is (metrics.CONSUMER_LAG).
LAG_EVERY_S = 5.0
#: How long a consuming loop waits in one poll: a poll returns as soon as records
#: come, so the wait costs no latency; it sets how often an idle loop wakes for
#: nothing (and how soon it sees a stop). 200 ms cost the idle stack ~1 % of a core,
#: 1 s ~0.1 % more than 2 s.
IDLE_POLL_MS = 2000


class PositionedConsumer:
    """Reads assigned partitions of one topic from offsets the caller stored: the
    :class:`app.ports.PositionedReader` over Kafka.

    Position is never committed to Kafka: the owner writes it to Postgres in the same
    transaction as its effects and hands it back here on start.
    """

    def __init__(
        self,
        settings: Settings,
        topic: str,
        name: str,
        partitions: Sequence[int] | None = None,
        *,
        login: bus.KafkaLogin | None = None,
        **overrides: Any,
    ) -> None:
        self.settings = settings
        self.topic = topic
        self.name = name
        self._login, self._overrides = login, overrides
        self._consumer = bus.make_consumer(settings, login=login, **overrides)
        #: Whether a fetch may be held at the broker for this client (it has polled).
        self._fetching = False
        self._all = bus.partitions(self._consumer, topic)
        #: The partitions the caller chose (None: all of them, however many).
        self._chosen = set(partitions) if partitions is not None else None
        self._assigned = self._of_choice()
        #: Every partition of the topic (a caller may read only some).
        self.all_partitions = [tp.partition for tp in self._all]
        #: The partitions read.
        self.partitions = [tp.partition for tp in self._assigned]
        self._topic_id = bus.topic_id(self._consumer, topic)
        self._lag_at = 0.0
        if self._assigned:
            self._consumer.assign(self._assigned)

    def _of_choice(self) -> list[TopicPartition]:
        if self._chosen is None:
            return list(self._all)
        return [tp for tp in self._all if tp.partition in self._chosen]

    def reassign(self, partitions: Collection[int], stored: dict[int, StoredOffset]) -> list[str]:
        """Read ``partitions`` from now on: those kept go on from where they stand,
        those new to this consumer start at their ``stored`` offsets (see
        :meth:`seek`); returns its warnings."""
        kept = set(self.partitions) & set(partitions)
        staying = [tp for tp in self._assigned if tp.partition in kept]
        self._chosen = set(partitions)
        self._assigned = self._of_choice()
        self.partitions = [tp.partition for tp in self._assigned]
        # (kafka-python takes an empty assignment for an unsubscribe: none is read.)
        if self._fetching:
            self._reconnect({tp: self._consumer.position(tp) for tp in staying})
        else:
            self._consumer.assign(self._assigned)
        return self.seek(stored, [p for p in self.partitions if p not in kept])

    def _reconnect(self, positions: dict[TopicPartition, int]) -> None:
        """Replace the client with a new one reading the same partitions, those of
        ``positions`` from there (the caller seeks the others).

        kafka-python sends no fetch to a broker while one is held there, so a client
        that moves (new partitions, or back to a stored offset) reads from the new
        place only once its held fetch returns: up to ``fetch_max_wait_ms``, which an
        idle consumer wants long. A new client holds no fetch. Moves are rare (a
        takeover, the claims of a restart, a recovery), and a client costs a
        connection and a login.
        """
        self._consumer.close()
        self._consumer = bus.make_consumer(self.settings, login=self._login, **self._overrides)
        self._fetching = False
        self._consumer.assign(self._assigned)
        for tp, offset in positions.items():
            self._consumer.seek(tp, offset)

    def seek(
        self, stored: dict[int, StoredOffset], only: Collection[int] | None = None
    ) -> list[str]:
        """Seek every partition (or ``only`` those) to its stored offset; return
        warnings about resets.

        Stored offsets of another topic (deleted and made again under the same name:
        another topic id), or past the end of the partition (a broker restored from
        older disks), are not positions in this topic: those partitions restart at
        their beginning and the caller is told (:func:`not_a_position`).
        """
        warnings: list[str] = []
        parts = [tp for tp in self._assigned if only is None or tp.partition in only]
        if not parts:
            return warnings
        if self._fetching:
            others = [tp for tp in self._assigned if tp not in parts]
            self._reconnect({tp: self._consumer.position(tp) for tp in others})
        ends = bus.end_offsets(self._consumer, parts)
        at: dict[TopicPartition, int] = {}
        for tp in parts:
            saved = stored.get(tp.partition)
            if saved is None:
                continue
            why = not_a_position(self.name, tp.topic, tp.partition, saved, self.topic_id, ends[tp])
            if why is None:
                at[tp] = saved.next_offset
            else:
                warnings.append(why)
        # Beginnings looked up now, not left to the client's lazy reset: it fetches the
        # partitions it has a position for meanwhile, and the broker holds that fetch
        # (the idle wait) before the others can be fetched.
        at.update(bus.beginning_offsets(self._consumer, [tp for tp in parts if tp not in at]))
        for tp, offset in at.items():
            self._consumer.seek(tp, offset)
        for warning in warnings:
            log.warning(warning)
        return warnings

    def poll(self, timeout_ms: int = 200, max_records: int = 2000) -> list[Record]:
        """The next records across assigned partitions, in order within each; raises
        :class:`ServiceUnavailable` while the broker is away."""
        if not self._assigned:
            time.sleep(timeout_ms / 1000)
            return []
        self._fetching = True
        try:
            batches = self._consumer.poll(timeout_ms=timeout_ms, max_records=max_records)
        except KafkaError as exc:
            raise ServiceUnavailable(f"Kafka: reading {self.topic}: {exc}") from exc
        out: list[Record] = []
        for records in batches.values():
            out.extend(records)
        now = time.monotonic()
        if now - self._lag_at >= LAG_EVERY_S:
            self._lag_at = now
            self._measure_lag()
        return out

    def _measure_lag(self) -> None:
        """The lag of each partition, from the ends the last fetches reported (no
        request of its own)."""
        for tp in self._assigned:
            end = self._consumer.highwater(tp)
            if end is None:
                continue
            position = self._consumer.position(tp)
            lag = max(end - position, 0) if position is not None else end
            metrics.CONSUMER_LAG.labels(self.name, tp.topic, str(tp.partition)).set(lag)

    def rewind(self, records: Sequence[Record]) -> None:
        """Read ``records`` again: each partition back to the first of them (they were
        polled but not handled)."""
        for partition, offset in first_offsets(records).items():
            self._consumer.seek(TopicPartition(self.topic, partition), offset)

    @property
    def topic_id(self) -> uuid.UUID:
        """The broker's id of the topic being read (owners store offsets with it)."""
        return self._topic_id

    def ends(self) -> dict[int, int]:
        """Each assigned partition's end (the offset its next record gets)."""
        return {
            tp.partition: end for tp, end in bus.end_offsets(self._consumer, self._assigned).items()
        }

    def position(self, partition: int) -> int:
        """The offset the next read of ``partition`` starts at."""
        return int(self._consumer.position(TopicPartition(self.topic, partition)))

    def close(self) -> None:
        """Leave cleanly."""
        self._consumer.close()


def dead_letter(
    publisher: Producer,
    settings: Settings,
    consumer: str,
    record: Record,
    reason: DeadLetterReason,
    detail: str,
) -> None:
    """Send a refused record to the dead-letter topic with its reason and bytes."""
    key = record.key.decode(errors="replace") if record.key else None
    original = record.value or b""
    # Keep the dead letter itself under the broker's size limit.
    kept = original[: settings.max_message_bytes // 2]
    letter = DeadLetter(
        consumer=consumer,
        topic=record.topic,
        partition=record.partition,
        offset=record.offset,
        reason=reason.value,
        detail=detail[:MAX_DETAIL],
        original_b64=base64.b64encode(kept).decode(),
        original_size=len(original),
        original_truncated=len(kept) < len(original),
        key=key,
        headers=[
            (str(name)[:256], base64.b64encode(value or b"").decode())
            for name, value in (record.headers or [])[:16]
        ],
    )
    # Partition 0 by name: one partition, in order, however many the topic has.
    publisher.publish(settings.topic_dead_letters, key or "", encode(letter), partition=0)


#: How often a :class:`BusWatch` writes its probe.
PROBE_EVERY_S = 2.0
#: A probe acknowledged later than this finds a log that was not taking writes.
PROBE_ACK_S = 2.0
#: How long a probe is waited for (and its producer retries it) before it counts as refused.
PROBE_WAIT_S = 10.0
#: Slack beyond a probe's period and acknowledgement before a gap between two commits
#: counts as a break (a stall of this thread, a probe refused in between).
PROBE_GAP_SLACK_S = 5.0


class BusWatch:
    """Since when the log has committed writes without a break, proven by a probe
    record written every :data:`PROBE_EVERY_S` (to a topic nobody reads) from a thread
    and a producer of its own, so the caller's loop never waits on it.

    Only a write proves it. A broker that answers is not enough: with two of three
    combined brokers down, the last one answers every question from metadata it can
    no longer change (every replica still "in sync"), while no heartbeat can be
    stored; a scheduler that counted that time as a node's silence declared healthy
    nodes lost and destroyed their sandboxes. A probe late or refused ends the run;
    the next one acknowledged in time starts a new one."""

    def __init__(self, settings: Settings, topic: str, period_s: float = PROBE_EVERY_S) -> None:
        self._settings = settings
        self._topic = topic
        self._period_s = period_s
        #: Since when the log commits writes (None: the last probe was not committed).
        self.since: datetime | None = utcnow()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dsec-bus-watch", daemon=True)
        self._thread.start()

    def _probe(self, publisher: bus.Publisher) -> str | None:
        """Why the probe was not committed in time (None: it was)."""
        started = time.monotonic()
        try:
            publisher.publish(
                self._topic, "probe", b"", partition=0, wait=True, wait_s=PROBE_WAIT_S
            )
        except Exception as exc:  # any failure to commit is the answer
            return str(exc) or type(exc).__name__
        took = time.monotonic() - started
        return None if took <= PROBE_ACK_S else f"a write took {took:.1f}s"

    def _run(self) -> None:
        publisher: bus.Publisher | None = None
        committed = time.monotonic()
        while not self._stop.wait(self._period_s):
            try:
                if publisher is None:
                    publisher = bus.Publisher(self._settings, delivery_timeout_s=PROBE_WAIT_S)
                why = self._probe(publisher)
            except Exception as exc:  # no producer: no broker
                why = str(exc) or type(exc).__name__
            now = time.monotonic()
            if why is not None:
                if self.since is not None:
                    log.warning("the log commits no writes: %s", why)
                self.since = None
                continue
            # A gap between commits is time nobody proved the log worked: a new run starts.
            gap = now - committed > self._period_s + 2 * PROBE_ACK_S + PROBE_GAP_SLACK_S
            if self.since is None or gap:
                if self.since is None:
                    log.warning("the log commits writes again")
                self.since = utcnow()
            committed = now
        if publisher is not None:
            publisher.close()

    def stop(self) -> None:
        """Stop asking."""
        self._stop.set()
