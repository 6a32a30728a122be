"""The one generator of Apache Kafka's server properties.

The embedded stack's broker, the three-broker test cluster, the multi-host test's
broker, docker/compose.yaml's brokers and the systemd unit of docs/deploy.md all take
their properties from :func:`server_properties` (the compose and systemd files are
rendered by `dsec kafka properties`, and a test holds them to it).

Every broker is a KRaft broker and controller in one process, with four listeners:

- ``CLIENT``: SASL/SCRAM over plain TCP, for clients on the same machine (the
  embedded stack binds it to loopback); left out where every client is remote;
- ``TLS``: SASL/SCRAM over TLS, for clients on other machines;
- ``INTERNAL`` (broker to broker) and ``CONTROLLER`` (the KRaft quorum): SASL/PLAIN
  as the brokers' own principal, over TLS when the brokers are on several machines.

ACLs are enforced by the StandardAuthorizer, with nothing allowed where no ACL says
so. Passwords never appear in the properties: the JAAS lines read them from a
root-only properties file through Kafka's FileConfigProvider, so the generated file
can be shown, diffed and kept in the repository.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: The brokers' own principal (PLAIN, on the internal and controller listeners).
BROKER_PRINCIPAL = "dsec-broker"
#: The key under which the secrets file holds the brokers' password.
BROKER_PASSWORD_KEY = "broker_password"
#: The SCRAM mechanism clients use.
SCRAM = "SCRAM-SHA-512"


@dataclass(frozen=True)
class Voter:
    """A controller of the quorum: its node id and controller listener."""

    node_id: int
    host: str
    port: int


@dataclass(frozen=True)
class BrokerPlan:
    """Everything one broker's properties depend on."""

    node_id: int
    #: The address it listens on (0.0.0.0 in a container) and the one it advertises.
    listen_host: str
    advertised_host: str
    #: SASL_PLAINTEXT listener for local clients (None: none).
    client_port: int | None
    #: SASL_SSL listener for remote clients (None: none).
    tls_port: int | None
    internal_port: int
    controller_port: int
    voters: Sequence[Voter]
    data_dir: str
    #: Properties file with the brokers' password (key BROKER_PASSWORD_KEY), root only.
    secrets_file: str
    #: PEM file: this broker's private key and certificate chain (TLS listeners).
    keystore: str | None = None
    #: PEM file: the CA brokers check each other with (internal TLS).
    truststore: str | None = None
    #: Broker to broker and the quorum over TLS (brokers on several machines).
    internal_tls: bool = False
    #: ``host:port`` clients are told for the CLIENT listener where it is not the
    #: broker's own (a proxy in front of it).
    client_advertised: str | None = None
    replication: int = 1
    min_insync_replicas: int = 1

    def __post_init__(self) -> None:
        if self.client_port is None and self.tls_port is None:
            raise ValueError("a broker needs a client listener or a TLS listener")
        needs_tls = self.tls_port is not None or self.internal_tls
        if needs_tls and self.keystore is None:
            raise ValueError("TLS listeners need a keystore")
        if self.internal_tls and self.truststore is None:
            raise ValueError("brokers that talk TLS to each other need a truststore")


def _plain_jaas(secrets_file: str) -> str:
    password = f"${{file:{secrets_file}:{BROKER_PASSWORD_KEY}}}"
    return (
        "org.apache.kafka.common.security.plain.PlainLoginModule required"
        f' username="{BROKER_PRINCIPAL}" password="{password}"'
        f' user_{BROKER_PRINCIPAL}="{password}";'
    )


def server_properties(plan: BrokerPlan) -> dict[str, str]:
    """The broker's server.properties, in the order written."""
    listeners: list[tuple[str, int, str]] = []  # name, port, protocol
    if plan.client_port is not None:
        listeners.append(("CLIENT", plan.client_port, "SASL_PLAINTEXT"))
    if plan.tls_port is not None:
        listeners.append(("TLS", plan.tls_port, "SASL_SSL"))
    internal = "SASL_SSL" if plan.internal_tls else "SASL_PLAINTEXT"
    listeners.append(("INTERNAL", plan.internal_port, internal))
    listeners.append(("CONTROLLER", plan.controller_port, internal))
    bound = [(name, port) for name, port, _ in listeners]
    props: dict[str, str] = {
        "process.roles": "broker,controller",
        "node.id": str(plan.node_id),
        "controller.quorum.voters": ",".join(f"{v.node_id}@{v.host}:{v.port}" for v in plan.voters),
        "listeners": ",".join(f"{n}://{plan.listen_host}:{p}" for n, p in bound),
        "advertised.listeners": ",".join(
            f"{n}://{plan.client_advertised}"
            if n == "CLIENT" and plan.client_advertised
            else f"{n}://{plan.advertised_host}:{p}"
            for n, p in bound
            if n != "CONTROLLER"
        ),
        "listener.security.protocol.map": ",".join(f"{n}:{proto}" for n, _, proto in listeners),
        "inter.broker.listener.name": "INTERNAL",
        "controller.listener.names": "CONTROLLER",
        "log.dirs": plan.data_dir,
        # Passwords come from the secrets file, never from this one.
        "config.providers": "file",
        "config.providers.file.class": (
            "org.apache.kafka.common.config.provider.FileConfigProvider"
        ),
        "sasl.enabled.mechanisms": f"{SCRAM},PLAIN",
        "sasl.mechanism.inter.broker.protocol": "PLAIN",
        "sasl.mechanism.controller.protocol": "PLAIN",
    }
    for name, _port, protocol in listeners:
        key = f"listener.name.{name.lower()}"
        if name in ("CLIENT", "TLS"):
            props[f"{key}.sasl.enabled.mechanisms"] = SCRAM
            props[f"{key}.{SCRAM.lower()}.sasl.jaas.config"] = (
                "org.apache.kafka.common.security.scram.ScramLoginModule required;"
            )
        else:
            props[f"{key}.sasl.enabled.mechanisms"] = "PLAIN"
            props[f"{key}.plain.sasl.jaas.config"] = _plain_jaas(plan.secrets_file)
        if protocol == "SASL_SSL":
            assert plan.keystore is not None
            props[f"{key}.ssl.keystore.type"] = "PEM"
            props[f"{key}.ssl.keystore.location"] = plan.keystore
            if plan.truststore is not None:
                props[f"{key}.ssl.truststore.type"] = "PEM"
                props[f"{key}.ssl.truststore.location"] = plan.truststore
    replication = str(plan.replication)
    props.update(
        {
            # Who may do what: ACLs (app/domain/kafka_access.py), nothing without one.
            "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            "allow.everyone.if.no.acl.found": "false",
            "super.users": f"User:{BROKER_PRINCIPAL};User:dsec-admin",
            # The platform makes its topics itself, with their partitions and settings.
            "auto.create.topics.enable": "false",
            "default.replication.factor": replication,
            "min.insync.replicas": str(plan.min_insync_replicas),
            "offsets.topic.replication.factor": replication,
            "transaction.state.log.replication.factor": replication,
            "transaction.state.log.min.isr": str(plan.min_insync_replicas),
            # A replica that fell out of sync never becomes leader: acknowledged
            # records (acks=all) survive a leader's death.
            "unclean.leader.election.enable": "false",
            # Clients that join a group (kafkajs, kcat -G) are not held 3 s.
            "group.initial.rebalance.delay.ms": "0",
            # A broker that died holds its registration until its session expires: its
            # successor is refused (DUPLICATE_BROKER_REGISTRATION) until then, and a
            # dead broker's partitions keep it as leader as long. Kafka's 9 s made a
            # restart take ~20 s; heartbeats every second cost nothing measurable.
            "broker.session.timeout.ms": "4000",
            "broker.heartbeat.interval.ms": "1000",
            # The controller writes a no-op record this often so brokers can tell
            # fresh metadata from stale; Kafka's 500 ms kept an idle broker busy.
            "metadata.max.idle.interval.ms": "5000",
            # Sized for small hosts; a dedicated broker host raises them.
            "num.network.threads": "2",
            "num.io.threads": "4",
        }
    )
    # Each listener has its own network threads, each waking every 300 ms with nothing
    # to do: the listener clients use keeps the pool, the others (a few connections
    # each: brokers, the quorum, remote clients where local ones have their own) one.
    clients = "CLIENT" if plan.client_port is not None else "TLS"
    for name, _port, _protocol in listeners:
        if name != clients:
            props[f"listener.name.{name.lower()}.num.network.threads"] = "1"
    return props


def render(props: dict[str, str], header: str = "") -> str:
    """A properties file's text."""
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    lines += [f"{key}={value}" for key, value in props.items()]
    return "\n".join(lines) + "\n"
