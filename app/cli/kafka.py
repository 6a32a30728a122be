"""``dsec kafka``: Apache Kafka brokers as the platform runs them, outside the
embedded stack: their properties (the one generator), their secrets, and a broker
in the foreground (a systemd unit's process)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from app.cli.render import console
from app.config import get_settings
from app.errors import ConfigError

kafka_cli = typer.Typer(
    no_args_is_help=True,
    help="Apache Kafka brokers: properties, secrets, a broker in the foreground.",
)


def _voters(text: str) -> list[tuple[int, str, int]]:
    out = []
    for part in text.split(","):
        node, _, hostport = part.strip().partition("@")
        host, _, port = hostport.rpartition(":")
        if not node.isdigit() or not host or not port.isdigit():
            raise ConfigError(f"a voter is ID@HOST:PORT, not {part!r}")
        out.append((int(node), host, int(port)))
    return out


@kafka_cli.command("properties")
def properties(
    node_id: Annotated[int, typer.Option(help="This broker's node id.")],
    voters: Annotated[str, typer.Option(help="The quorum: ID@HOST:PORT,... (controller ports).")],
    host: Annotated[str, typer.Option(help="The address clients and brokers reach it by.")],
    listen: Annotated[str, typer.Option(help="The address it listens on.")] = "0.0.0.0",
    tls_port: Annotated[int, typer.Option(help="SASL_SSL listener for clients.")] = 9092,
    internal_port: Annotated[int, typer.Option(help="Broker to broker.")] = 9094,
    controller_port: Annotated[int, typer.Option(help="The quorum's listener.")] = 9093,
    client_port: Annotated[
        int | None, typer.Option(help="A SASL_PLAINTEXT listener too (same-machine clients).")
    ] = None,
    data_dir: Annotated[str, typer.Option(help="Its log directory.")] = "/var/lib/kafka/data",
    secrets: Annotated[
        str, typer.Option(help="Directory of the brokers' secrets (`dsec kafka secrets`).")
    ] = "/var/lib/dsec/secrets/kafka",
    replication: Annotated[int, typer.Option(help="Replicas of every topic.")] = 3,
    min_isr: Annotated[int, typer.Option(help="min.insync.replicas.")] = 2,
) -> None:
    """Print a broker's server.properties: TLS between brokers and to clients, SASL
    (SCRAM for clients), ACLs enforced. docker/kafka/ and docs/deploy.md use these."""
    from app.stack.kafka_config import BrokerPlan, Voter, render, server_properties

    plan = BrokerPlan(
        node_id=node_id, listen_host=listen, advertised_host=host,
        client_port=client_port, tls_port=tls_port, internal_port=internal_port,
        controller_port=controller_port,
        voters=[Voter(*v) for v in _voters(voters)],
        data_dir=data_dir, secrets_file=f"{secrets}/broker.properties",
        keystore=f"{secrets}/broker.pem", truststore=f"{secrets}/ca.pem", internal_tls=True,
        replication=replication, min_insync_replicas=min_isr,
    )  # fmt: skip
    header = f"Apache Kafka broker {node_id}: `dsec kafka properties` (app/stack/kafka_config.py)."
    typer.echo(render(server_properties(plan), header), nl=False)


@kafka_cli.command("secrets")
def secrets(
    hosts: Annotated[str, typer.Option(help="Names the brokers are reached by, comma separated.")],
) -> None:
    """Make the brokers' password, the CA and a certificate naming ``hosts`` (root-only
    files under <secrets_dir>/kafka; those that exist are kept)."""
    from app.stack import broker

    settings = get_settings()
    names = [h.strip() for h in hosts.split(",") if h.strip()]
    path = broker.write_secrets(settings, names)
    console.print(f"[green]✓[/] brokers' secrets in {path.parent} (root only)")


@kafka_cli.command("run")
def run(
    properties_file: Annotated[Path, typer.Argument(help="The broker's server.properties.")],
) -> None:
    """Format the broker's log directory if it is new, then become the broker (the
    jars fetched and checked as `dsec up` does)."""
    from app import secret_files
    from app.stack import broker, kafka_dist

    settings = get_settings()
    libs = kafka_dist.ensure(settings)
    text = properties_file.read_text()
    data = next(
        (line.split("=", 1)[1] for line in text.splitlines() if line.startswith("log.dirs=")),
        None,
    )
    if data is None:
        raise ConfigError(f"{properties_file} names no log.dirs")
    seed = secret_files.ensure(settings.secrets_dir / "kafka" / "cluster.id", text=True).decode()
    broker.format_storage(settings, data, properties_file, broker.cluster_id(seed))
    argv = broker.command(libs, properties_file)
    os.execv(argv[0], argv)
