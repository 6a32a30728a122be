"""The Kafka adapter: who a client is, a publisher, and statically assigned consumers.

Consumers here never join a consumer group: partitions are assigned statically and
positions are kept by the owner (Postgres for the projector and the scheduler, the
end of the partition for a trainer waiting for replies). Offsets stored next to the
data they produced are what gives exactly once; a group would add a coordinator's
rebalances and nothing else. Topics, principals and ACLs: :mod:`app.kafka_admin`.
"""

from __future__ import annotations

import logging
import ssl
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.errors import KafkaError
from pydantic import BaseModel

from app.config import Settings
from app.domain.codec import encode
from app.errors import ServiceUnavailable

log = logging.getLogger(__name__)

#: Who the stack's own administrator is to Kafka (topics, principals, ACLs).
ADMIN_PRINCIPAL = "dsec-admin"


@dataclass(frozen=True)
class KafkaLogin:
    """How one principal reaches Kafka: its SASL name and password, and, where its
    credential file says so, the brokers, the protocol and the CA to check them with
    (a trainer on another host then needs nothing but the file)."""

    username: str
    password: str
    bootstrap: str | None = None
    security_protocol: str | None = None
    mechanism: str | None = None
    #: The brokers' CA certificate, PEM (for SSL and SASL_SSL).
    ca_pem: str | None = None

    def to_json(self) -> dict[str, str]:
        """The credential file's ``kafka`` block (what is set)."""
        fields = {
            "username": self.username,
            "password": self.password,
            "bootstrap": self.bootstrap,
            "security_protocol": self.security_protocol,
            "mechanism": self.mechanism,
            "ca_pem": self.ca_pem,
        }
        return {k: v for k, v in fields.items() if v is not None}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> KafkaLogin:
        """Read a credential file's ``kafka`` block (KeyError/TypeError if malformed)."""
        optional = ("bootstrap", "security_protocol", "mechanism", "ca_pem")
        return cls(
            username=str(raw["username"]),
            password=str(raw["password"]),
            **{k: str(raw[k]) for k in optional if raw.get(k) is not None},
        )


def local_admin_login(settings: Settings) -> KafkaLogin | None:
    """The stack's administrator, where this process can read its password (root on
    the stack's host: `dsec up`, the CLI, tests and benchmarks)."""
    path = settings.kafka_logins_dir / f"{ADMIN_PRINCIPAL}.password"
    try:
        password = path.read_text().strip()
    except OSError:
        return None
    return KafkaLogin(ADMIN_PRINCIPAL, password) if password else None


def resolve_login(settings: Settings, login: KafkaLogin | None = None) -> KafkaLogin | None:
    """Who this client is to Kafka: ``login`` (a credential file's) if given, else the
    principal the settings name (DSEC_KAFKA_SASL_USERNAME and its password file), else
    the local administrator (root on the stack's host), else nobody."""
    if login is not None:
        return login
    if settings.kafka_sasl_username:
        path = settings.kafka_sasl_password_file
        try:
            password = path.read_text().strip() if path is not None else ""
        except OSError as exc:
            raise ServiceUnavailable(
                f"Kafka: cannot read the password of {settings.kafka_sasl_username} "
                f"at {path}: {exc.strerror}"
            ) from exc
        return KafkaLogin(settings.kafka_sasl_username, password)
    return local_admin_login(settings)


def _servers(bootstrap: str) -> list[str]:
    return [s.strip() for s in bootstrap.split(",") if s.strip()]


def largest_record(settings: Settings) -> int:
    """The largest record sent or read: a reply may hold an exec's whole output."""
    return max(settings.max_message_bytes * 2, settings.max_reply_bytes)


def client_options(settings: Settings, login: KafkaLogin | None = None) -> dict[str, Any]:
    """Bootstrap servers and security settings of a Kafka client of ours: one
    principal per process (:func:`resolve_login`), the one Kafka's ACLs know it by
    (docs/security.md). A credential's own brokers, protocol and CA count unless the
    settings name them explicitly."""
    who = resolve_login(settings, login)
    explicit = settings.model_fields_set
    bootstrap = settings.kafka_bootstrap
    protocol: str = settings.kafka_security_protocol
    mechanism: str | None = settings.kafka_sasl_mechanism
    if who is not None:
        if who.bootstrap and "kafka_bootstrap" not in explicit:
            bootstrap = who.bootstrap
        if who.security_protocol and "kafka_security_protocol" not in explicit:
            protocol = who.security_protocol
        if who.mechanism and "kafka_sasl_mechanism" not in explicit:
            mechanism = who.mechanism
    options: dict[str, Any] = {
        "bootstrap_servers": _servers(bootstrap),
        "security_protocol": protocol,
        # Topics are made by the platform with their partitions and settings
        # (app.kafka_admin.ensure_topics), never by a client's metadata request.
        "allow_auto_create_topics": False,
        # kafka-python backs off up to 30 s between attempts to reach a broker that went
        # away: a restarted broker (back in ~15 s) then waited on for half a minute more.
        "reconnect_backoff_max_ms": 1000,
    }
    if protocol.startswith("SASL"):
        if who is None:
            raise ServiceUnavailable(
                f"Kafka at {bootstrap} asks for SASL and this process has no principal:"
                " set DSEC_CREDENTIALS (a trainer or a node) or DSEC_KAFKA_SASL_USERNAME"
                " and DSEC_KAFKA_SASL_PASSWORD_FILE"
            )
        options.update(
            sasl_mechanism=mechanism,
            sasl_plain_username=who.username,
            sasl_plain_password=who.password,
        )
    if protocol in ("SSL", "SASL_SSL"):
        options["ssl_context"] = _tls_context(settings, who)
    return options


def broker_ca(settings: Settings, who: KafkaLogin | None) -> tuple[Path | None, str | None]:
    """What the brokers are checked against, as (CA file, CA PEM), at most one set: the
    configured CA file, else the credential's CA, else the stack's own CA where
    readable; neither: the system's."""
    cafile = settings.kafka_ssl_cafile
    if cafile is None and (who is None or who.ca_pem is None):
        local = settings.ca_dir / "ca.pem"
        cafile = local if local.exists() else None
    if cafile is not None:
        return cafile, None
    return None, who.ca_pem if who is not None else None


def _tls_context(settings: Settings, who: KafkaLogin | None) -> ssl.SSLContext:
    """Checks the brokers against :func:`broker_ca`; a client certificate where
    configured."""
    cafile, cadata = broker_ca(settings, who)
    if cafile is not None:
        context = ssl.create_default_context(cafile=str(cafile))
    elif cadata is not None:
        context = ssl.create_default_context(cadata=cadata)
    else:
        context = ssl.create_default_context()
    if settings.kafka_ssl_certfile is not None:
        keyfile = settings.kafka_ssl_keyfile
        context.load_cert_chain(
            str(settings.kafka_ssl_certfile), str(keyfile) if keyfile is not None else None
        )
    return context


#: How long a producer may go without a producer id before a new one takes over.
PRODUCER_ID_WAIT_S = 10.0
#: How long a producer follows a topic its metadata never listed (a tenant's replies
#: topic that is missing): a topic the platform made is listed within a second.
UNKNOWN_TOPIC_GRACE_S = 10.0


class Publisher:
    """Sends typed messages; thread-safe (one per process is enough).

    Idempotent (the broker drops a batch it already has, so a retry never writes a
    record twice, and order within a partition holds with several requests in flight)
    and acks=all: a record is acknowledged once every in-sync replica has it. Sends
    are retried by the client until ``delivery_timeout_ms``; a record still not
    delivered then is counted and :meth:`flush` raises.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        linger_ms: int = 0,
        login: KafkaLogin | None = None,
        delivery_timeout_s: float | None = None,
    ) -> None:
        self._settings = settings
        self._linger_ms = linger_ms
        self._login = login
        # How long a record may wait for the brokers (None: the client's default, 2 min).
        self._delivery = (
            {"delivery_timeout_ms": int(delivery_timeout_s * 1000),
             "request_timeout_ms": int(delivery_timeout_s * 500)}
            if delivery_timeout_s is not None else {}
        )  # fmt: skip
        self._lock = threading.Lock()
        #: Topics followed, with when following began.
        self._tracked: dict[str, float] = {}
        #: Tracked topics the broker's metadata has listed (a topic not yet seen may
        #: still be on its way to every broker).
        self._listed: set[str] = set()
        self._producer = self._make()
        self._failures = 0
        self._last_failure: BaseException | None = None
        # A record given up on leaves an idempotent producer's sequence out of step with
        # the broker's; kafka-python 3.0.12 then resets its producer id and never gets
        # another (every later send waits for good), nor does a producer whose first
        # request for an id found no broker. The next send goes through a new producer
        # instead (see _stuck).
        self._lost = False
        self._idless_since: float | None = None

    def _make(self) -> KafkaProducer:
        settings = self._settings
        try:
            producer = KafkaProducer(
                **client_options(settings, self._login),
                acks="all",
                enable_idempotence=True,
                linger_ms=self._linger_ms,
                max_request_size=largest_record(settings),
                **self._delivery,
            )
        except KafkaError as exc:
            raise ServiceUnavailable(f"Kafka at {settings.kafka_bootstrap}: {exc}") from exc
        producer._metadata.add_listener(lambda cluster: self._forgetting(producer, cluster))
        return producer

    def _forgetting(self, producer: KafkaProducer, cluster: Any) -> None:
        # On the client's I/O thread: whatever goes wrong here must not stop it.
        try:
            self._forget_deleted(producer, cluster)
        except Exception:
            log.exception("letting go of deleted topics failed")

    def _forget_deleted(self, producer: KafkaProducer, cluster: Any) -> None:
        """Stop following topics the broker no longer has (on the client's I/O thread,
        after each metadata update).

        kafka-python 3.0.12 asks for metadata every 100 ms, for good, while a topic it
        follows is unknown, and while its accumulator holds a partition without a
        leader, even one with nothing to send: a tenant's replies topic deleted behind
        the platform's back cost the scheduler ~5 % of a core until it restarted, and
        so did one it asked about that never existed. A topic used again is followed
        again by :meth:`_track`."""
        now = time.monotonic()
        with self._lock:
            for topic, since in list(self._tracked.items()):
                if cluster.partitions_for_topic(topic):
                    self._listed.add(topic)
                elif topic in self._listed or now - since > UNKNOWN_TOPIC_GRACE_S:
                    log.warning("topic %s is gone or never was: no longer followed", topic)
                    cluster._topics.discard(topic)
                    del self._tracked[topic]
                    self._listed.discard(topic)
        accumulator = producer._accumulator
        for tp in list(accumulator._batches):
            if tp.topic in cluster._topics or cluster.leader_for_partition(tp) is not None:
                continue
            with accumulator._tp_lock(tp):
                if not accumulator._batches[tp]:  # records still waiting expire first
                    del accumulator._batches[tp]

    def _fatal(self) -> bool:
        """The producer failed for good (kafka-python aborts every batch of an
        idempotent producer the broker fenced), without a word to send() or flush()."""
        manager = getattr(self._producer, "_transaction_manager", None)
        return manager is not None and manager.has_fatal_error()

    def _stuck(self) -> bool:
        """The producer has been without a producer id for :data:`PRODUCER_ID_WAIT_S`:
        it sends nothing, and never will (kafka-python 3.0.12)."""
        manager = getattr(self._producer, "_transaction_manager", None)
        if manager is None or manager.has_producer_id():
            self._idless_since = None
            return False
        now = time.monotonic()
        if self._idless_since is None:
            self._idless_since = now
        return now - self._idless_since > PRODUCER_ID_WAIT_S

    def _renew(self) -> None:
        """Put a new producer (a new producer id) in place of a failed one."""
        with self._lock:
            self._tracked, self._listed = {}, set()
        new = self._make()  # outside the lock: its metadata listener takes it
        with self._lock:
            old, self._producer = self._producer, new
        try:
            old.close(timeout=0)
        except Exception as exc:  # a failed producer may fail to close too
            log.debug("closing a failed producer: %s", exc)

    def _track(self, topic: str) -> None:
        """Make the producer's metadata follow ``topic`` for good.

        kafka-python 3.0.12: a producer whose bootstrap metadata listed every topic
        tracks none of them; the first topic it must look up later (a new tenant's
        replies topic) replaces its metadata with that topic alone, the partitions it
        sent to before lose their leader, and its sender thread asks for metadata in a
        tight loop: a whole core, for good. Tracking each topic on first use keeps
        them all in every refresh.
        """
        if topic in self._tracked:  # every publish asks: no lock on the common path
            return
        with self._lock:
            self._tracked[topic] = time.monotonic()
        self._producer._sender.add_topic(topic)

    def partitions_for(self, topic: str) -> int | None:
        """How many partitions ``topic`` has, from the broker's metadata (None: no such
        topic, or the broker does not say)."""
        self._track(topic)
        try:
            found = self._producer.partitions_for(topic)
        except KafkaError:
            return None
        return len(found) if found else None

    def publish(
        self,
        topic: str,
        key: str,
        message: BaseModel | bytes,
        *,
        partition: int | None = None,
        wait: bool = False,
        wait_s: float = 30.0,
        headers: Sequence[tuple[str, bytes]] | None = None,
        on_failure: Callable[[BaseException], None] | None = None,
        on_stored: Callable[[], None] | None = None,
    ) -> None:
        """Send one message (with its proof in ``headers``); with ``wait`` block until the
        broker acknowledged it (``wait_s`` at most), else ``on_failure`` hears of a record
        the brokers never took (as :meth:`flush` does) and ``on_stored`` of one they
        acknowledged (both on the client's I/O thread)."""
        value = message if isinstance(message, bytes) else encode(message)
        if self._fatal() or self._lost or self._stuck():
            log.warning("Kafka producer lost a record or failed for good: a new one takes over")
            self._lost = False
            self._idless_since = None
            self._renew()
        self._track(topic)
        try:
            future = self._producer.send(
                topic, key=key.encode(), value=value, partition=partition,
                headers=list(headers) if headers else None,
            )  # fmt: skip
            if wait:
                future.get(timeout=wait_s)
            else:
                future.add_errback(self._failed)
                if on_failure is not None:
                    future.add_errback(on_failure)
                if on_stored is not None:
                    future.add_callback(lambda _metadata: on_stored())
        except KafkaError as exc:
            raise ServiceUnavailable(f"publish to {topic}: {exc}") from exc

    def _failed(self, exc: BaseException) -> None:
        """A record the client gave up on (on its I/O thread): the next flush raises."""
        log.error("a record could not be delivered: %s", exc)
        with self._lock:
            self._failures += 1
            self._last_failure = exc
            self._lost = True

    def flush(self, timeout_s: float = 30.0) -> None:
        """Block until every message sent so far is acknowledged; raises
        :class:`ServiceUnavailable` if one could not be delivered since the last flush."""
        try:
            self._producer.flush(timeout=timeout_s)
        except KafkaError as exc:
            raise ServiceUnavailable(f"flush: {exc}") from exc
        with self._lock:
            failures, self._failures = self._failures, 0
            last, self._last_failure = self._last_failure, None
        if self._fatal():
            self._renew()
            raise ServiceUnavailable("flush: the producer failed for good (a new one takes over)")
        if failures:
            raise ServiceUnavailable(f"flush: {failures} record(s) not delivered: {last}")

    def partitions_of(self, topic: str, wait_s: float) -> int | None:
        """How many partitions ``topic`` has, as this producer's metadata says; a topic
        it does not know is asked for, waiting ``wait_s`` at most (None: still unknown,
        or refused). kafka-python's own ``partitions_for`` would wait max_block_ms (60 s)."""
        found = self._producer._metadata.partitions_for_topic(topic)
        if found is None:
            self._track(topic)  # asking follows it: let go of it if it never comes
            try:
                found = self._producer._wait_on_metadata(topic, int(wait_s * 1000))
            except (KafkaError, ValueError):  # timed out, not authorized, a bad name
                return None
        return len(found) if found else None

    def close(self) -> None:
        """Flush and close."""
        self._producer.close(timeout=10)


def make_consumer(
    settings: Settings, *, login: KafkaLogin | None = None, **overrides: Any
) -> KafkaConsumer:
    """A consumer without group membership and without auto-commit. Its fetches wait
    on the broker (long poll, answered as soon as data arrives)."""
    options: dict[str, Any] = {
        **client_options(settings, login),
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


def end_offsets(
    consumer: KafkaConsumer, parts: Sequence[TopicPartition]
) -> dict[TopicPartition, int]:
    """The partitions' ends (the offset the next record written gets)."""
    try:
        found: dict[TopicPartition, int] = consumer.end_offsets(list(parts))
    except KafkaError as exc:
        raise ServiceUnavailable(f"Kafka: end offsets: {exc}") from exc
    return found


def beginning_offsets(
    consumer: KafkaConsumer, parts: Sequence[TopicPartition]
) -> dict[TopicPartition, int]:
    """The partitions' first offsets (past what retention deleted)."""
    if not parts:
        return {}
    try:
        found: dict[TopicPartition, int] = consumer.beginning_offsets(list(parts))
    except KafkaError as exc:
        raise ServiceUnavailable(f"Kafka: beginning offsets: {exc}") from exc
    return found


def high_watermarks(
    settings: Settings, parts: Sequence[TopicPartition]
) -> dict[TopicPartition, int]:
    """The partitions' ends, asked through a consumer of its own."""
    probe = make_consumer(settings)
    try:
        return end_offsets(probe, parts)
    finally:
        probe.close()


def partitions(consumer: KafkaConsumer, topic: str) -> list[TopicPartition]:
    """All partitions of ``topic``, as the broker's metadata has them."""
    try:
        ids: Iterable[int] | None = consumer.partitions_for_topic(topic)
    except KafkaError as exc:
        raise ServiceUnavailable(f"Kafka: partitions of {topic}: {exc}") from exc
    if not ids:
        raise ServiceUnavailable(f"topic {topic} does not exist (is the stack up?)")
    return [TopicPartition(topic, p) for p in sorted(ids)]


def topic_id(consumer: KafkaConsumer, topic: str) -> uuid.UUID:
    """The broker's id for ``topic``: a topic deleted and made again under the same
    name gets a new one, and offsets stored with the old id are not its offsets."""
    # kafka-python keeps topic ids from metadata responses on its cluster object.
    found = consumer._client.cluster.topic_id(topic)
    if found is None:
        return uuid.uuid5(uuid.NAMESPACE_URL, f"kafka-topic:{topic}")
    return found if isinstance(found, uuid.UUID) else uuid.UUID(str(found))
