"""The Kafka side of the plan, without a broker: who may do what (ACLs), and what a
broker's properties say."""

from __future__ import annotations

import base64

import pytest

from app.domain.kafka_access import (
    PROJECTOR,
    SCHEDULER,
    Operation,
    Resource,
    key_grants,
    principal_name,
    service_grants,
)
from app.domain.proof import Role
from app.stack.kafka_config import BrokerPlan, Voter, render, server_properties


def _reads(grants: list) -> set[str]:  # type: ignore[type-arg]
    return {
        g.name for g in grants if g.operation == Operation.READ and g.resource == Resource.TOPIC
    }


def test_a_tenant_reads_its_own_replies_and_nothing_else() -> None:
    grants = key_grants("dsec", Role.TENANT, "team-a", principal_name(Role.TENANT, "team-a", "k-1"))
    assert _reads(grants) == {"dsec.replies.team-a"}
    writes = {g.name for g in grants if g.operation == Operation.WRITE}
    # (the nodes' inboxes: a node takes only what a sandbox key proves, app/domain/direct.py)
    assert writes == {"dsec.requests", "dsec.node."}
    assert {g.name for g in grants if g.prefixed and g.resource == Resource.TOPIC} == {"dsec.node."}
    assert all(g.principal == "tenant.team-a.k-1" for g in grants)


def test_a_node_reads_only_its_own_inbox() -> None:
    grants = key_grants("dsec", Role.NODE, "node3", "node.node3.k-2")
    assert _reads(grants) == {"dsec.node.node3"}
    assert "dsec.requests" not in {g.name for g in grants}


def test_an_operator_reads_the_events_but_writes_no_event() -> None:
    grants = key_grants("dsec", Role.OPERATOR, "ops", "operator.ops.k-3")
    assert _reads(grants) == {"dsec.replies.ops", "dsec.events", "dsec.deadletters"}
    assert {g.name for g in grants if g.operation == Operation.WRITE} == {"dsec.requests"}


def test_the_scheduler_has_no_grant_a_scheduler_key_could_ask_for() -> None:
    with pytest.raises(ValueError):
        key_grants("dsec", Role.SCHEDULER, "scheduler", "x")
    principals = {g.principal for g in service_grants("dsec")}
    assert principals == {SCHEDULER, PROJECTOR}
    assert _reads([g for g in service_grants("dsec") if g.principal == PROJECTOR]) == {
        "dsec.events"
    }


def _plan(**changes: object) -> BrokerPlan:
    base: dict[str, object] = dict(
        node_id=2, listen_host="0.0.0.0", advertised_host="kafka-2", client_port=None,
        tls_port=9092, internal_port=9094, controller_port=9093,
        voters=[Voter(1, "kafka-1", 9093), Voter(2, "kafka-2", 9093)],
        data_dir="/d", secrets_file="/s/broker.properties", keystore="/s/broker.pem",
        truststore="/s/ca.pem", internal_tls=True, replication=3, min_insync_replicas=2,
    )  # fmt: skip
    base.update(changes)
    return BrokerPlan(**base)  # type: ignore[arg-type]


def test_a_brokers_properties_enforce_acls_and_hold_no_password() -> None:
    props = server_properties(_plan())
    assert props["allow.everyone.if.no.acl.found"] == "false"
    assert props["authorizer.class.name"].endswith("StandardAuthorizer")
    assert props["auto.create.topics.enable"] == "false"
    assert props["unclean.leader.election.enable"] == "false"
    assert props["controller.quorum.voters"] == "1@kafka-1:9093,2@kafka-2:9093"
    # Every listener wants SASL; between hosts, every one is TLS too
    assert set(props["listener.security.protocol.map"].split(",")) == {
        "TLS:SASL_SSL", "INTERNAL:SASL_SSL", "CONTROLLER:SASL_SSL",
    }  # fmt: skip
    # Passwords come from the secrets file, never from the properties
    text = render(props)
    values = [part.split('"')[1] for part in text.split("password=")[1:]]
    assert values and all(v == "${file:/s/broker.properties:broker_password}" for v in values)


def test_a_broker_needs_a_keystore_for_tls_and_a_listener_for_clients() -> None:
    with pytest.raises(ValueError):
        _plan(keystore=None)
    with pytest.raises(ValueError):
        _plan(client_port=None, tls_port=None)


def test_a_proxy_can_stand_in_front_of_the_client_listener() -> None:
    props = server_properties(_plan(client_port=19092, client_advertised="127.0.0.1:5555"))
    assert "CLIENT://127.0.0.1:5555" in props["advertised.listeners"]
    assert "CLIENT://0.0.0.0:19092" in props["listeners"]


def test_a_cluster_id_never_reads_as_an_option() -> None:
    # Given seeds among which the plain encoding starts with "-" one time in 64
    from app.stack.broker import cluster_id

    ids = [cluster_id(str(seed)) for seed in range(1000)]
    # Then none does, each is a UUID in Kafka's base64, and a seed always gives its own
    assert not [found for found in ids if found.startswith("-")]
    assert all(len(base64.urlsafe_b64decode(found + "==")) == 16 for found in ids)
    assert cluster_id("137") == cluster_id("137") != cluster_id("138")
