"""The SDK's librdkafka transport reaches the brokers a credential file names, as the
kafka-python one does (app/sdk/transport_rdkafka.py)."""

from __future__ import annotations

from pathlib import Path

import confluent_kafka

from app.bus import KafkaLogin
from app.config import Settings
from app.sdk.transport_rdkafka import rdkafka_config
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
