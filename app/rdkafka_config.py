"""librdkafka's settings for the platform's clients and a trainer's SDK alike: the
names confluent-kafka takes for what :func:`app.bus.client_options` gives kafka-python,
and the producer and consumer settings that keep librdkafka's clients to
kafka-python's contract (:mod:`app.rdkafka_bus`, :mod:`app.sdk.transport_rdkafka`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

from app import bus
from app.config import Settings
from app.domain.records import Inbound
from app.errors import ServiceUnavailable


def rdkafka_config(settings: Settings, login: bus.KafkaLogin | None) -> dict[str, Any]:
    """librdkafka's names for what :func:`app.bus.client_options` gives kafka-python:
    brokers, security protocol, SASL login and the CA the brokers are checked with."""
    options = bus.client_options(settings, login)
    config: dict[str, Any] = {
        "bootstrap.servers": ",".join(options["bootstrap_servers"]),
        "security.protocol": options["security_protocol"],
        "reconnect.backoff.max.ms": options["reconnect_backoff_max_ms"],
        "allow.auto.create.topics": False,
        "socket.nagle.disable": True,
    }
    if "sasl_mechanism" in options:
        config.update({
            "sasl.mechanism": options["sasl_mechanism"],
            "sasl.username": options["sasl_plain_username"],
            "sasl.password": options["sasl_plain_password"],
        })  # fmt: skip
    if options["security_protocol"] in ("SSL", "SASL_SSL"):
        cafile, cadata = bus.broker_ca(settings, bus.resolve_login(settings, login))
        if cafile is not None:
            config["ssl.ca.location"] = str(cafile)
        elif cadata is not None:
            config["ssl.ca.pem"] = cadata
        if settings.kafka_ssl_certfile is not None:
            config["ssl.certificate.location"] = str(settings.kafka_ssl_certfile)
            if settings.kafka_ssl_keyfile is not None:
                config["ssl.key.location"] = str(settings.kafka_ssl_keyfile)
    return config


#: How long a delivery thread waits for its producer's reports when none come: it is
#: woken by each one, so this sets only how often an idle client wakes.
DELIVERY_POLL_S = 2.0


def producer_config(
    settings: Settings, login: bus.KafkaLogin | None, delivery_timeout_s: float = 120.0
) -> dict[str, Any]:
    """An idempotent producer's settings, partitioning as kafka-python does."""
    return {
        **rdkafka_config(settings, login),
        "acks": "all",
        "enable.idempotence": True,
        "linger.ms": 0,
        "partitioner": "murmur2_random",
        "message.max.bytes": bus.largest_record(settings),
        "delivery.timeout.ms": int(delivery_timeout_s * 1000),
    }


def consumer_config(settings: Settings, login: bus.KafkaLogin | None) -> dict[str, Any]:
    """A consumer that only assigns (no group is joined, nothing is committed) and
    whose fetches wait on the broker, answered as soon as data arrives."""
    return {
        **rdkafka_config(settings, login),
        # librdkafka asks for a group id even of a consumer that never joins one.
        "group.id": "dsec-unused",
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "auto.offset.reset": "earliest",
        "fetch.wait.max.ms": settings.fetch_max_wait_ms,
        "fetch.message.max.bytes": bus.largest_record(settings),
        "enable.partition.eof": False,
    }


def load() -> ModuleType:
    """confluent-kafka, or a clear error where it is not installed."""
    try:
        import confluent_kafka
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise ServiceUnavailable(
            "librdkafka clients need confluent-kafka: a dependency of dsec, and of"
            " dsec-sdk's `librdkafka` extra (pip install 'dsec-sdk[librdkafka]')"
        ) from exc
    return confluent_kafka


def take(consumer: Any, timeout_s: float, most: int) -> list[Any]:
    """Up to ``most`` messages of a confluent-kafka consumer, waiting ``timeout_s`` for
    the first alone: ``consume(n, timeout)`` would wait for all n, so what came with
    the first is taken without waiting."""
    first = consumer.poll(timeout_s)
    if first is None:
        return []
    if most <= 1:
        return [first]
    return [first, *consumer.consume(num_messages=most - 1, timeout=0)]


def inbound(message: Any) -> Inbound:
    """A confluent-kafka message as the platform's records read."""
    return Inbound(
        message.topic(), message.partition(), message.offset(),
        message.key(), message.value(), message.headers() or [],
    )  # fmt: skip


class Deliveries:
    """The thread a librdkafka producer's delivery reports run on: they run on whoever
    polls the producer (``producer()``: the one in use now)."""

    def __init__(self, producer: Callable[[], Any]) -> None:
        self._producer = producer
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dsec-rdkafka-delivery", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._closing.is_set():
            self._producer().poll(DELIVERY_POLL_S)

    def stop(self) -> None:
        """Stop after the current wait."""
        self._closing.set()
        self._thread.join(timeout=DELIVERY_POLL_S + 1)


def listed_partitions(client: Any, topic: str, timeout_s: float) -> list[int] | None:
    """The partitions of ``topic`` as the broker's metadata lists them, asked through
    a confluent-kafka client (None: no such topic, or not one this principal may
    see); a broker that does not answer in ``timeout_s`` raises KafkaException."""
    listed = client.list_topics(topic, timeout=timeout_s).topics.get(topic)
    if listed is None or listed.error is not None or not listed.partitions:
        return None
    return sorted(listed.partitions)
