"""``dsec secret``: a tenant's egress secrets (headers the platform adds to its
sandboxes' requests on the way out; app/sdk/secrets.py)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, TypeVar

import typer
from rich.console import Console
from rich.table import Table

from app.cli.arguments import JsonOpt, TenantOpt
from app.config import get_settings

if TYPE_CHECKING:
    from app.sdk.secrets import Secrets

T = TypeVar("T")

secret_cli = typer.Typer(
    no_args_is_help=True, help="A tenant's egress secrets: put, ls, rm (values never shown)."
)
console = Console(soft_wrap=True)


def _secrets(tenant: str) -> Secrets:
    from app import credentials
    from app.sdk.secrets import Secrets

    settings = get_settings()
    return Secrets(settings, credentials.for_client(settings, tenant or None))


def _run(action: Callable[[], T]) -> T:
    from app.errors import ConfigError
    from app.sdk.hub_service import PushError

    try:
        return action()
    except (ConfigError, PushError) as exc:
        console.print(f"[red]✗[/] {exc}")
        raise typer.Exit(1) from None


@secret_cli.command()
def put(
    destination: Annotated[str, typer.Argument(help="Host name its requests go to.")],
    header: Annotated[str, typer.Option(help="Header to add, e.g. Authorization.")],
    value_env: Annotated[
        str | None,
        typer.Option(help="Read the value from this environment variable (else stdin)."),
    ] = None,
    tenant: TenantOpt = "",
) -> None:
    """Set a secret: the value comes from an environment variable or standard input,
    never from the command line (where other users and the shell history see it)."""
    if value_env is not None:
        value = os.environ.get(value_env)
        if value is None:
            console.print(f"[red]✗[/] ${value_env} is not set")
            raise typer.Exit(1)
    else:
        value = sys.stdin.read().rstrip("\r\n")
    _run(lambda: _secrets(tenant).put(destination, header=header, value=value))
    console.print(f"[green]✓[/] {header} set for {destination}")


@secret_cli.command("ls")
def list_(tenant: TenantOpt = "", as_json: JsonOpt = False) -> None:
    """The tenant's secrets: destination, header, who set it and when."""
    found = _run(lambda: _secrets(tenant).list())
    if as_json:
        rows = [
            {"destination": s.destination, "header": s.header, "set_by": s.set_by,
             "set_at": s.set_at.isoformat()}
            for s in found
        ]  # fmt: skip
        print(json.dumps(rows, indent=2))
        return
    table = Table("destination", "header", "set by", "set at")
    for s in found:
        table.add_row(s.destination, s.header, s.set_by, s.set_at.isoformat(timespec="seconds"))
    console.print(table)


@secret_cli.command()
def rm(
    destination: str,
    header: Annotated[str | None, typer.Option(help="Only this header (default: all).")] = None,
    tenant: TenantOpt = "",
) -> None:
    """Delete a destination's secrets; sandboxes created after carry them no more."""
    removed = _run(lambda: _secrets(tenant).delete(destination, header))
    console.print(f"[green]✓[/] {removed} removed")
