"""``dsec control``: a control host's services (projector, schedulers, Flower and
their supervisor) against an operator's Kafka, Postgres and Redis."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from app.cli.render import console
from app.config import get_settings

control_cli = typer.Typer(
    no_args_is_help=True,
    help="A control host: the projector, the schedulers and Flower, from settings alone.",
)


@control_cli.command("up")
def control_up(
    schedulers: Annotated[
        int | None, typer.Option(help="Scheduler processes (default: DSEC_SCHEDULERS).")
    ] = None,
) -> None:
    """Migrate the schema, make or check the topics, and start this host's services
    (reusing those that run). Kafka, Postgres and Redis are the operator's."""
    from app.stack import control_host

    settings = get_settings()
    control_host.up(
        settings, schedulers or settings.schedulers, lambda m: console.print(f"[green]✓[/] {m}")
    )


@control_cli.command("prepare")
def control_prepare(
    node: Annotated[
        list[str] | None, typer.Option(help="Make (or keep) this node's credential; repeatable.")
    ] = None,
    node_credentials: Annotated[
        Path | None, typer.Option(help="Copy each node's credential here, as <id>.json.")
    ] = None,
    kafka_internal: Annotated[
        str | None,
        typer.Option(help="A broker's internal listener (HOST:PORT): make the admin there first."),
    ] = None,
) -> None:
    """Migrate the schema, make the keys and the topics, and start nothing: the first
    step of a deployment whose services a container runtime or systemd runs."""
    from app.stack import control_host

    control_host.prepare(
        get_settings(),
        lambda m: console.print(f"[green]✓[/] {m}"),
        node or (),
        node_credentials,
        kafka_internal,
    )


@control_cli.command("down")
def control_down() -> None:
    """Stop this host's control services (the log and the topics stay)."""
    from app.stack import control_host

    control_host.down(get_settings(), lambda m: console.print(f"[yellow]■[/] {m}"))
