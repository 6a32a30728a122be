"""librdkafka's clients (a trainer's SDK, a node's inbox and producer) reach the
brokers a credential file names and keep kafka-python's contract (app/rdkafka_config.py,
app/rdkafka_bus.py)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import confluent_kafka
from confluent_kafka.admin import AdminClient

from app.bus import KafkaLogin
from app.config import Settings
from app.rdkafka_bus import topic_uuid
from app.rdkafka_config import consumer_config, producer_config, rdkafka_config, take
from app.stack.tls import ensure_ca


def _ca(tmp_path: Path) -> Path:
    """A real CA certificate, as `dsec up` makes one."""
    return ensure_ca(tmp_path / "ca")


def test_a_credential_files_brokers_protocol_and_ca_are_used(tmp_path: Path) -> None:
    ca_pem = _ca(tmp_path).read_text()
    # Given a trainer on another host with nothing but its credential file's login
    login = KafkaLogin(
        "t-alice", "s3cret", bootstrap="k1:9093,k2:9093", security_protocol="SASL_SSL",
        mechanism="SCRAM-SHA-512", ca_pem=ca_pem,
    )  # fmt: skip
    config = rdkafka_config(Settings(state_dir=tmp_path), login)
    # Then librdkafka gets the same brokers, login and CA, and Nagle off
    assert config["bootstrap.servers"] == "k1:9093,k2:9093"
    assert (config["security.protocol"], config["sasl.mechanism"]) == ("SASL_SSL", "SCRAM-SHA-512")
    assert (config["sasl.username"], config["sasl.password"]) == ("t-alice", "s3cret")
    assert config["ssl.ca.pem"] == ca_pem and "ssl.ca.location" not in config
    assert config["socket.nagle.disable"] is True


def test_the_settings_ca_file_wins_and_librdkafka_takes_the_config(tmp_path: Path) -> None:
    ca = _ca(tmp_path)
    settings = Settings(state_dir=tmp_path, kafka_security_protocol="SASL_SSL", kafka_ssl_cafile=ca)
    config = rdkafka_config(settings, KafkaLogin("t-bob", "pw", ca_pem=ca.read_text()))
    assert config["ssl.ca.location"] == str(ca) and "ssl.ca.pem" not in config
    # librdkafka checks every name and value when a client is made (no broker needed)
    plain = rdkafka_config(Settings(state_dir=tmp_path), KafkaLogin("t-bob", "pw"))
    confluent_kafka.Producer({**plain, "partitioner": "murmur2_random"}).flush(0)


def test_the_clients_settings_are_librdkafkas_and_partition_as_kafka_python(
    tmp_path: Path,
) -> None:
    settings = Settings(state_dir=tmp_path)
    login = KafkaLogin("n-node0", "pw")
    producer = producer_config(settings, login)
    # kafka-python's default partitioner is murmur2 of the key: a sandbox's events land
    # in one partition whichever client sends them
    assert producer["partitioner"] == "murmur2_random"
    assert (producer["enable.idempotence"], producer["acks"]) == (True, "all")
    consumer = consumer_config(settings, login)
    assert consumer["enable.auto.commit"] is False
    assert consumer["fetch.wait.max.ms"] == settings.fetch_max_wait_ms
    # librdkafka checks every name and value when a client is made (no broker needed)
    confluent_kafka.Producer(producer).flush(0)
    confluent_kafka.Consumer(consumer).close()
    AdminClient(rdkafka_config(settings, login))


def test_a_topic_id_reads_as_the_uuid_kafka_python_reports() -> None:
    # Kafka's Uuid is two signed 64-bit halves; kafka-python reads the 16 bytes
    for known in (uuid.UUID("f0e1d2c3-b4a5-9687-7869-5a4b3c2d1e0f"), uuid.uuid4()):
        high, low = known.int >> 64, known.int & ((1 << 64) - 1)
        signed = confluent_kafka.Uuid(_signed(high), _signed(low))
        assert topic_uuid(signed) == known


def _signed(half: int) -> int:
    return half - (1 << 64) if half >= 1 << 63 else half


class _Consumer:
    """What take() asks of a confluent-kafka consumer, and what it was asked."""

    def __init__(self, first: Any, rest: list[Any]) -> None:
        self.first, self.rest = first, rest
        self.asked: list[tuple[str, Any, float]] = []

    def poll(self, timeout: float) -> Any:
        self.asked.append(("poll", None, timeout))
        return self.first

    def consume(self, num_messages: int, timeout: float) -> list[Any]:
        self.asked.append(("consume", num_messages, timeout))
        return self.rest


def test_a_take_waits_for_the_first_message_alone() -> None:
    idle = _Consumer(None, [])
    assert take(idle, 2.0, 500) == []
    assert idle.asked == [("poll", None, 2.0)]
    busy = _Consumer("m0", ["m1", "m2"])
    assert take(busy, 2.0, 500) == ["m0", "m1", "m2"]
    # the rest is taken without waiting: consume() would wait for all it may take
    assert busy.asked == [("poll", None, 2.0), ("consume", 499, 0)]
    one = _Consumer("m0", ["m1"])
    assert take(one, 2.0, 1) == ["m0"]
