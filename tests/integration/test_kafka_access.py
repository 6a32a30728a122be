"""Kafka's own security on the stack's broker, tried as an attacker would: a tenant's
principal reads only its own replies, a client without a credential cannot connect,
and a revoked key's connection is refused within seconds."""

from __future__ import annotations

import time
import uuid

import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.errors import KafkaError

from app import bus
from app.bus import KafkaLogin
from app.config import Settings
from app.control import tenants
from app.domain.proof import Role
from tests.conftest import ensure_tenant

pytestmark = pytest.mark.integration


def _read(settings: Settings, login: KafkaLogin | None, topic: str, **extra: object) -> None:
    """Fetch from partition 0 of ``topic`` as ``login``; raises what the broker says."""
    consumer = bus.make_consumer(settings, login=login, **extra)
    try:
        consumer.assign([TopicPartition(topic, 0)])
        consumer.seek_to_beginning()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            consumer.poll(timeout_ms=500)
    finally:
        consumer.close()


def _login(stack: Settings, name: str) -> KafkaLogin:
    credential = ensure_tenant(stack, name)
    assert credential.kafka is not None, "a tenant's credential carries its principal"
    return credential.kafka


@pytest.mark.parametrize(
    "victim",
    ["replies.kafka-victim", "requests", "node.node0", "events", "deadletters"],
)
def test_a_tenant_reads_no_topic_but_its_own_replies(stack: Settings, victim: str) -> None:
    # Given two tenants, each with its own principal
    _login(stack, "kafka-victim")
    attacker = _login(stack, "kafka-attacker")
    # When the attacker's principal fetches another's replies, anyone's requests (env
    # values, uploaded files), a node's inbox, the events or the dead letters
    # Then the broker refuses it
    with pytest.raises(KafkaError, match="Authorization"):
        _read(stack, attacker, f"{stack.topic_prefix}.{victim}")
    # while its own replies topic is its to read
    _read(stack, attacker, stack.replies_topic("kafka-attacker"))


def test_a_tenant_cannot_write_events_or_a_nodes_inbox(stack: Settings) -> None:
    attacker = _login(stack, "kafka-attacker")
    publisher = bus.Publisher(stack, login=attacker)
    try:
        for topic in (stack.topic_events, stack.node_topic("node0")):
            with pytest.raises(Exception, match="Authorization"):
                publisher.publish(topic, "x", b"{}", partition=0, wait=True)
    finally:
        publisher.close()


def test_a_client_without_a_credential_cannot_connect(stack: Settings) -> None:
    # No SASL at all, on the stack's listener
    with pytest.raises(KafkaError):
        KafkaConsumer(
            bootstrap_servers=[stack.kafka_bootstrap], security_protocol="PLAINTEXT",
            api_version_auto_timeout_ms=3000, request_timeout_ms=3000,
        )  # fmt: skip
    # A tenant's principal with a made-up password
    real = _login(stack, "kafka-attacker")
    with pytest.raises(KafkaError):
        KafkaProducer(
            **bus.client_options(stack, KafkaLogin(real.username, "not-the-password")),
            api_version_auto_timeout_ms=3000,
        )  # fmt: skip


def test_a_revoked_tenants_open_connection_is_refused_within_seconds(stack: Settings) -> None:
    # Given a tenant whose producer is connected and writing requests
    name = f"kafka-revoked-{uuid.uuid4().hex[:6]}"
    tenants.issue(stack, Role.TENANT, name)
    login = _login(stack, name)
    publisher = bus.Publisher(stack, login=login)
    try:
        publisher.publish(stack.topic_requests, "sb-x", b"{}", wait=True)
        # When an operator revokes it
        revoked_at = time.monotonic()
        tenants.revoke(stack, name)
        # Then its next writes are refused on the open connection, within seconds
        while True:
            try:
                publisher.publish(stack.topic_requests, "sb-x", b"{}", wait=True)
            except Exception as exc:
                assert "Authorization" in str(exc) or "authoriz" in str(exc).lower(), exc
                break
            assert time.monotonic() - revoked_at < 10, "still writing 10 s after revocation"
            time.sleep(0.2)
    finally:
        publisher.close()
    # and a new connection is refused at its handshake
    with pytest.raises(KafkaError):
        KafkaProducer(**bus.client_options(stack, login), api_version_auto_timeout_ms=3000)
