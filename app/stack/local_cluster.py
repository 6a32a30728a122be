"""Apache Kafka brokers of one's own on this host, beside the stack's: the
three-broker cluster of the failover test and of `bench/chaos.py --cluster`, and a
single broker a test slows down or a multi-host test runs in a network namespace.

Each broker takes its properties from the one generator (:mod:`app.stack.kafka_config`)
with the stack's jars, brokers' password and CA; once the quorum stands, the stack's
administrator and control-plane principals are made on it as on the stack's broker,
and the credentials named by the caller get their principals and ACLs for the
cluster's topic prefix.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from app import kafka_admin
from app.config import Settings
from app.errors import ServiceUnavailable
from app.stack import broker, kafka_dist
from app.stack.kafka_config import BrokerPlan, Voter


def _free_port() -> int:
    """A port free on loopback now (in a network namespace of its own, any port is)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.3):
            return True
    except OSError:
        return False


@dataclass
class Member:
    """One broker of the cluster and its process."""

    plan: BrokerPlan
    properties: Path
    log: Path
    command: list[str]
    netns: str | None = None
    process: subprocess.Popen[bytes] | None = None

    @property
    def client(self) -> str:
        """Its client listener (or TLS listener, where it has no other)."""
        port = self.plan.client_port or self.plan.tls_port
        return f"{self.plan.advertised_host}:{port}"

    def start(self) -> None:
        """Start it (again): its log directory keeps what it had."""
        argv = (
            self.command
            if self.netns is None
            else ["ip", "netns", "exec", self.netns, *self.command]
        )
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def kill(self) -> None:
        """SIGKILL, the whole process group."""
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def ready(self) -> bool:
        port = self.plan.client_port or self.plan.tls_port
        assert port is not None
        return _open(self.plan.advertised_host, port) and _open(
            self.plan.advertised_host, self.plan.internal_port
        )


@dataclass
class Cluster:
    """Brokers of one's own, and the settings that reach them."""

    settings: Settings
    members: list[Member] = field(default_factory=list)

    def leader(self, topic: str, partition: int) -> Member:
        """The member that leads ``topic``'s ``partition`` now."""
        admin = kafka_admin.admin_client(self.settings)
        try:
            described = admin.describe_topics([topic])
        finally:
            admin.close()
        for part in described[0]["partitions"]:
            if part["partition_index"] == partition:
                leader = part["leader_id"]
                return next(m for m in self.members if m.plan.node_id == leader)
        raise LookupError(f"{topic}[{partition}] has no leader")

    def stop(self) -> None:
        for member in self.members:
            member.kill()


def plans(
    settings: Settings,
    count: int,
    state: Path,
    *,
    hosts: Sequence[str] | None = None,
    tls_only: bool = False,
    client_advertised: str | None = None,
    client_ports: Sequence[int] | None = None,
) -> list[BrokerPlan]:
    """``count`` brokers' plans: each on a host of ``hosts`` (default: all on
    127.0.0.1, free ports), replication ``min(count, 3)``, min ISR 2 from 3 brokers."""
    where = list(hosts or ["127.0.0.1"] * count)
    ports = [[_free_port() for _ in range(4)] for _ in where]
    for i, port in enumerate(client_ports or []):
        ports[i][0] = port
    voters = [Voter(i + 1, where[i], ports[i][3]) for i in range(count)]
    replication = min(count, 3)
    secrets = broker.secrets(settings)
    return [
        BrokerPlan(
            node_id=i + 1,
            listen_host=where[i],
            advertised_host=where[i],
            client_port=None if tls_only else ports[i][0],
            tls_port=ports[i][1],
            internal_port=ports[i][2],
            controller_port=ports[i][3],
            voters=voters,
            data_dir=str(state / f"broker-{i + 1}" / "data"),
            secrets_file=str(secrets / "broker.properties"),
            keystore=str(secrets / "local-cluster.pem"),
            truststore=str(secrets / "ca.pem") if tls_only else None,
            internal_tls=tls_only,
            replication=replication,
            min_insync_replicas=2 if replication >= 3 else 1,
            client_advertised=client_advertised,
        )
        for i in range(count)
    ]


@contextlib.contextmanager
def running(
    settings: Settings,
    count: int,
    state: Path,
    *,
    hosts: Sequence[str] | None = None,
    netns: Sequence[str] | None = None,
    tls_only: bool = False,
    client_advertised: str | None = None,
    client_ports: Sequence[int] | None = None,
    subjects: Sequence[str] = (),
) -> Iterator[Cluster]:
    """Start ``count`` brokers (in network namespaces ``netns``, where given), wait for
    their quorum, make the platform's principals on them and those of ``subjects``'
    live keys (for a topic prefix of the cluster's own); stop them all at the end."""
    from app.control import tenants

    libs = kafka_dist.ensure(settings)
    names = sorted({*(hosts or []), "127.0.0.1", "localhost"})
    broker.write_secrets(settings, names, "local-cluster")
    cluster_id = broker.cluster_id(uuid.uuid4().hex)
    members: list[Member] = []
    laid_out = plans(
        settings, count, state, hosts=hosts, tls_only=tls_only,
        client_advertised=client_advertised, client_ports=client_ports,
    )  # fmt: skip
    for i, plan in enumerate(laid_out):
        home = Path(plan.data_dir).parent
        home.mkdir(parents=True, exist_ok=True)
        props = home / "server.properties"
        broker.write_properties(props, plan)
        broker.format_storage(settings, plan.data_dir, props, cluster_id)
        members.append(
            Member(plan, props, home / "broker.log", broker.command(libs, props),
                   netns=netns[i] if netns else None)
        )  # fmt: skip
    first = members[0]
    cluster_settings = settings.model_copy(
        update={
            "kafka_bootstrap": ",".join(m.client for m in members),
            "kafka_security_protocol": "SASL_SSL" if tls_only else "SASL_PLAINTEXT",
            "kafka_replication_factor": first.plan.replication,
            "kafka_min_insync_replicas": first.plan.min_insync_replicas,
            "topic_prefix": f"c{uuid.uuid4().hex[:8]}",
        }
    )
    cluster = Cluster(cluster_settings, members)
    try:
        for member in members:
            member.start()
        deadline = time.monotonic() + 120
        while not all(m.ready() for m in members):
            dead = [m for m in members if not m.alive]
            if dead or time.monotonic() > deadline:
                tail = dead[0].log.read_text(errors="replace")[-3000:] if dead else ""
                raise ServiceUnavailable(f"the test cluster did not come up\n{tail}")
            time.sleep(0.3)
        ca = broker.secrets(settings) / "ca.pem" if tls_only else None
        _until(lambda: broker.ensure_principals(
            cluster_settings, first.plan.advertised_host, first.plan.internal_port, ca
        ))  # fmt: skip
        kafka_admin.ensure_topics(cluster_settings, subjects)
        rows = [
            r for r in tenants.listing(settings) if r.subject in subjects and r.revoked_at is None
        ]
        tenants.enable(cluster_settings, rows)
        yield cluster
    finally:
        cluster.stop()


def _until(step: Callable[[], None], timeout_s: float = 60.0) -> None:
    """Run ``step`` until it stops failing for want of the quorum (a fresh cluster
    elects its controller a moment after its ports open)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            step()
            return
        except ServiceUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)
