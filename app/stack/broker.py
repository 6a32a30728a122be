"""The embedded stack's broker: one Apache Kafka in KRaft mode, its log on disk.

`dsec up` fetches the pinned jars (:mod:`app.stack.kafka_dist`), makes the broker's
secrets (its own password, the stack's CA and the broker's certificate: root-only
files under ``<secrets_dir>/kafka``), writes its properties with the one generator
(:mod:`app.stack.kafka_config`), formats its log directory once, and starts it as a
service of the stack. Then, as the brokers' own principal, it makes the stack's
administrator, and as the administrator the control plane's principals with their
ACLs. The listeners share the host of ``DSEC_KAFKA_BOOTSTRAP`` and take the three
ports after its own: TLS clients, broker to broker, the controller.
"""

from __future__ import annotations

import base64
import subprocess
import uuid
from pathlib import Path

from kafka import KafkaAdminClient
from kafka.errors import KafkaError

from app import kafka_admin, secret_files
from app.bus import ADMIN_PRINCIPAL, KafkaLogin
from app.config import Settings
from app.domain.kafka_access import PROJECTOR, SCHEDULER, service_grants
from app.domain.proof import kafka_password
from app.errors import ServiceUnavailable
from app.stack import kafka_config, kafka_dist, tls
from app.stack.kafka_config import BROKER_PASSWORD_KEY, BROKER_PRINCIPAL, BrokerPlan, Voter

#: The broker's JVM: a small heap is plenty for one machine's traffic. The serial
#: collector (no G1 background threads; a young collection of this heap takes
#: milliseconds) and no perf-data sampler (jcmd still works, jstat does not) cut an
#: idle broker's CPU by ~0.5 % of a core. Both JIT tiers stay: the first alone would
#: save another ~0.4 % in the first half hour after a start, but made the broker
#: spend 50 % more CPU per command under load (bench/throughput.py, docs/BENCHMARKS.md).
JVM_OPTIONS = (
    "-Xms256m",
    "-Xmx768m",
    "-XX:+UseSerialGC",
    "-XX:-UsePerfData",
    "-XX:+ExitOnOutOfMemoryError",
    "-Djava.awt.headless=true",
)


def home(settings: Settings) -> Path:
    """The broker's directory: properties and log (``data/``)."""
    return settings.state_dir / "kafka"


def secrets(settings: Settings) -> Path:
    """The root-only directory of what brokers read: their password, certificates."""
    return settings.kafka_secrets_dir


def ports(settings: Settings) -> tuple[str, int, int, int, int]:
    """Host, and the client, TLS, internal and controller ports of the embedded broker."""
    first = settings.kafka_bootstrap.split(",")[0].strip()
    host, _, port = first.rpartition(":")
    base = int(port)
    return host or "127.0.0.1", base, base + 1, base + 2, base + 3


def plan(settings: Settings) -> BrokerPlan:
    """The embedded broker's plan: loopback, one voter, replication 1."""
    host, client, tls_port, internal, controller = ports(settings)
    return BrokerPlan(
        node_id=1,
        listen_host=host,
        advertised_host=host,
        client_port=client,
        tls_port=tls_port,
        internal_port=internal,
        controller_port=controller,
        voters=[Voter(1, host, controller)],
        data_dir=str(home(settings) / "data"),
        secrets_file=str(secrets(settings) / "broker.properties"),
        keystore=str(secrets(settings) / "broker.pem"),
    )


def properties_file(settings: Settings) -> Path:
    """Where the embedded broker's properties are written."""
    return home(settings) / "server.properties"


def broker_password(settings: Settings) -> str:
    """The brokers' own password (PLAIN, broker to broker), made once."""
    return secret_files.ensure(secrets(settings) / "broker.password", text=True).decode()


def write_secrets(settings: Settings, hosts: list[str], name: str = "broker") -> Path:
    """The brokers' password file, the stack's CA, and a certificate ``<name>.pem``
    for ``hosts``; returns the certificate's path (a broker's keystore)."""
    password = broker_password(settings)
    line = f"{BROKER_PASSWORD_KEY}={password}\n".encode()
    secret_files.write(secrets(settings) / "broker.properties", line)
    return tls.ensure_leaf(settings.ca_dir, secrets(settings), name, hosts)


def format_storage(settings: Settings, data_dir: str, props: Path, cluster_id: str) -> None:
    """Format a broker's log directory, once (a formatted one is left as it is)."""
    if (Path(data_dir) / "meta.properties").exists():
        return
    libs = kafka_dist.ensure(settings)
    command = [
        kafka_dist.java(), *jvm_logging(), "-cp", kafka_dist.classpath(libs),
        kafka_dist.STORAGE_CLASS, "format", "--ignore-formatted",
        f"--cluster-id={cluster_id}", "--config", str(props),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-10:])
        raise ServiceUnavailable(f"formatting Kafka's log directory failed:\n{tail}")


def jvm_logging() -> list[str]:
    """The broker's logging configuration (packaged beside the pom)."""
    return [f"-Dlog4j2.configurationFile={kafka_dist.packaged('log4j2.properties')}"]


def write_properties(path: Path, broker: BrokerPlan) -> None:
    """The broker's properties, root only (they name where its secrets are)."""
    text = kafka_config.render(
        kafka_config.server_properties(broker),
        "Written by `dsec up` from app/stack/kafka_config.py; edits are overwritten.",
    )
    secret_files.write(path, text.encode())


def prepare(settings: Settings) -> list[str]:
    """Jars, secrets, properties and a formatted log directory; returns the broker's
    command line."""
    libs = kafka_dist.ensure(settings)
    broker = plan(settings)
    write_secrets(settings, [broker.advertised_host, "localhost"])
    props = properties_file(settings)
    props.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    write_properties(props, broker)
    cluster = secret_files.ensure(home(settings) / "cluster.id", text=True).decode()
    format_storage(settings, broker.data_dir, props, cluster_id(cluster))
    return command(libs, props)


def cluster_id(seed: str) -> str:
    """A KRaft cluster id (a UUID in Kafka's URL-safe base64) from a seed.

    Never one that starts with ``-``, as Kafka's own ids never do: one in 64 would,
    and kafka-storage's command line takes it for an option and refuses to format."""
    name = f"dsec-kafka:{seed}"
    while True:
        raw = uuid.uuid5(uuid.NAMESPACE_URL, name).bytes
        found = base64.urlsafe_b64encode(raw).decode().rstrip("=")
        if not found.startswith("-"):
            return found
        name += "+"


def command(libs: Path, props: Path) -> list[str]:
    """A broker's command line (the properties file last: the stack finds it by that)."""
    return [
        kafka_dist.java(), *JVM_OPTIONS, *jvm_logging(),
        "-cp", kafka_dist.classpath(libs), kafka_dist.BROKER_CLASS, str(props),
    ]  # fmt: skip


def internal_admin(
    settings: Settings, host: str, port: int, tls_ca: Path | None = None
) -> KafkaAdminClient:
    """An admin client as the brokers' own principal, on the internal listener."""
    options: dict[str, object] = {
        "bootstrap_servers": [f"{host}:{port}"],
        "security_protocol": "SASL_SSL" if tls_ca is not None else "SASL_PLAINTEXT",
        "sasl_mechanism": "PLAIN",
        "sasl_plain_username": BROKER_PRINCIPAL,
        "sasl_plain_password": broker_password(settings),
        "request_timeout_ms": 10_000,
    }
    if tls_ca is not None:
        import ssl

        options["ssl_context"] = ssl.create_default_context(cafile=str(tls_ca))
    try:
        return KafkaAdminClient(**options)
    except KafkaError as exc:
        raise ServiceUnavailable(f"Kafka's internal listener {host}:{port}: {exc}") from exc


def service_login(settings: Settings, name: str) -> KafkaLogin:
    """A control-plane principal's login (derived from the master key)."""
    master = secret_files.read(settings.master_key_path)
    return KafkaLogin(name, kafka_password(master, name))


def password_file(settings: Settings, name: str) -> Path:
    """Where a control-plane process reads its Kafka password."""
    return settings.kafka_logins_dir / f"{name}.password"


def ensure_principals(
    settings: Settings, host: str, internal_port: int, tls_ca: Path | None = None
) -> None:
    """The stack's administrator, made as the brokers' own principal on the internal
    listener (before it, nobody may make principals), then the control plane's."""
    admin = service_login(settings, ADMIN_PRINCIPAL)
    client = internal_admin(settings, host, internal_port, tls_ca)
    try:
        kafka_admin.set_principals(settings, [(admin.username, admin.password)], client=client)
    finally:
        client.close()
    secret_files.write(password_file(settings, admin.username), admin.password.encode())
    ensure_service_principals(settings)


def ensure_service_principals(settings: Settings) -> None:
    """The control plane's principals (as the administrator), their ACLs for the
    settings' topic prefix, and the password files its processes read."""
    logins = [service_login(settings, name) for name in (SCHEDULER, PROJECTOR)]
    kafka_admin.set_principals(settings, [(login.username, login.password) for login in logins])
    for login in logins:
        secret_files.write(password_file(settings, login.username), login.password.encode())
    kafka_admin.grant(settings, service_grants(settings.topic_prefix))
