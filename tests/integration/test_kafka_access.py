"""Kafka's own security on the stack's broker, tried as an attacker would: a tenant's
principal reads only its own replies, a client without a credential cannot connect,
and a revoked key's connection is refused within seconds."""

from __future__ import annotations

import time
import uuid

import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.errors import KafkaError, TopicAuthorizationFailedError

from app import bus
from app.bus import KafkaLogin
from app.config import Settings
from app.control import tenants
from app.domain.proof import Role
from tests.conftest import ensure_tenant, forget_tenant

pytestmark = pytest.mark.integration


def _read(settings: Settings, login: KafkaLogin | None, topic: str) -> int:
    """Records ``login`` can fetch from partition 0 of ``topic``: the broker's refusal
    reaches kafka-python as an error (a topic it may describe) or as nothing at all (a
    topic it may not even see), either way no record."""
    consumer = bus.make_consumer(settings, login=login)
    got = 0
    try:
        consumer.assign([TopicPartition(topic, 0)])
        consumer.seek_to_beginning()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not got:
            got += sum(len(r) for r in consumer.poll(timeout_ms=500).values())
    except TopicAuthorizationFailedError:
        return 0
    finally:
        consumer.close()
    return got


def _put(settings: Settings, topic: str) -> None:
    """A record on partition 0 of ``topic``, as the platform (there is something to read)."""
    publisher = bus.Publisher(settings)
    try:
        publisher.publish(topic, "x", b"{}", partition=0, wait=True)
    finally:
        publisher.close()


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
    # and records in another's replies, the requests (env values, uploaded files), a
    # node's inbox, the events and the dead letters
    topic = f"{stack.topic_prefix}.{victim}"
    _put(stack, topic)
    assert _read(stack, None, topic) > 0  # (the administrator sees them)
    # When the attacker's principal fetches them, Then the broker hands it nothing
    assert _read(stack, attacker, topic) == 0
    # while its own replies topic is its to read
    _put(stack, stack.replies_topic("kafka-attacker"))
    assert _read(stack, attacker, stack.replies_topic("kafka-attacker")) > 0


def test_a_tenant_cannot_write_events(stack: Settings) -> None:
    # (A node's inbox it may write: what the node takes from it is proven under a
    # sandbox's key, tests/integration/test_direct_route.py)
    attacker = _login(stack, "kafka-attacker")
    publisher = bus.Publisher(stack, login=attacker)
    try:
        with pytest.raises(Exception, match="Authorization"):
            publisher.publish(stack.topic_events, "x", b"{}", partition=0, wait=True)
    finally:
        publisher.close()


def test_a_client_without_a_credential_cannot_connect(stack: Settings) -> None:
    # (a refused client keeps trying until its bootstrap timeout: 5 s, not 30, here)
    # No SASL at all, on the stack's listener
    with pytest.raises(KafkaError):
        KafkaConsumer(
            bootstrap_servers=[stack.kafka_bootstrap], security_protocol="PLAINTEXT",
            bootstrap_timeout_ms=5000,
        )  # fmt: skip
    # A tenant's principal with a made-up password
    real = _login(stack, "kafka-attacker")
    with pytest.raises(KafkaError):
        KafkaProducer(
            **bus.client_options(stack, KafkaLogin(real.username, "not-the-password")),
            bootstrap_timeout_ms=5000,
        )


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
    # and a new connection is refused at its handshake (kafka-python retries a failed
    # authentication until its bootstrap timeout: 30 s by default)
    with pytest.raises(KafkaError):
        KafkaProducer(**bus.client_options(stack, login), bootstrap_timeout_ms=5000)
    forget_tenant(stack, name)
