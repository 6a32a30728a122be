"""``dsec tenant ...`` and ``dsec node ...``: credentials (and tenants' quotas), as an
operator manages them.

Secrets never reach the terminal: a new credential is written to a file readable by
root only (its path is printed), for the operator to hand to the tenant or the node
host. Listings show key ids, owners and revocations.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from app.cli import render as cli_render
from app.cli.arguments import JsonOpt
from app.config import get_settings
from app.db.credentials import CredentialRow
from app.domain.proof import SUBJECT, Role
from app.domain.quotas import Resource
from app.errors import ConfigError, DsecError

if TYPE_CHECKING:
    from app.control.stored_quotas import Change

tenant_cli = typer.Typer(
    no_args_is_help=True, help="Tenants and operators: credentials that sign requests."
)
node_cli = typer.Typer(no_args_is_help=True, help="Nodes: credentials that prove their events.")
console = cli_render.console

OutOpt = Annotated[
    Path | None,
    typer.Option("--out", help="Write the credential here (default: the local secrets dir)."),
]


def _row(row: CredentialRow) -> dict[str, Any]:
    return {
        "key_id": row.key_id,
        "role": row.role.value,
        "name": row.subject,
        "label": row.label,
        "created_at": row.created_at.isoformat(timespec="seconds"),
        "created_by": row.created_by,
        "revoked_at": row.revoked_at.isoformat(timespec="seconds") if row.revoked_at else None,
    }


def _print(rows: list[CredentialRow], as_json: bool, title: str) -> None:
    cli_render.rows(title, [_row(r) for r in rows], as_json)


def _fail(exc: DsecError) -> None:
    console.print(f"[red]dsec:[/] {exc}")
    raise typer.Exit(2)


def _issue(role: Role, name: str, label: str, out: Path | None, as_json: bool) -> None:
    from app.control import tenants

    try:
        issued = tenants.issue(get_settings(), role, name, label, out)
    except DsecError as exc:
        _fail(exc)
        return
    if as_json:
        print(json.dumps({**_row(issued.row), "credential_file": str(issued.path)}, indent=2))
    else:
        console.print(
            f"{role.value} {name}: key {issued.row.key_id}, credential in {issued.path} "
            "(root only; hand it over, e.g. as DSEC_CREDENTIALS)"
        )


@tenant_cli.command("create")
def tenant_create(
    name: str,
    label: Annotated[str, typer.Option(help="A note kept with the key.")] = "",
    operator: Annotated[
        bool, typer.Option("--operator", help="An operator: may act on every sandbox.")
    ] = False,
    out: OutOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Make a tenant (or operator) credential; its replies topic is made with it."""
    _issue(Role.OPERATOR if operator else Role.TENANT, name, label, out, as_json)


@tenant_cli.command("ls")
def tenant_ls(
    revoked: Annotated[bool, typer.Option(help="Show revoked keys too.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Tenants' and operators' keys (never their secrets)."""
    from app.control import tenants

    rows = [
        r
        for r in tenants.listing(get_settings())
        if r.role in (Role.TENANT, Role.OPERATOR) and (revoked or r.revoked_at is None)
    ]
    _print(rows, as_json, "tenants")


@tenant_cli.command("rotate")
def tenant_rotate(
    name: str,
    keep_old: Annotated[
        bool, typer.Option(help="Leave the old keys valid (revoke them later by key id).")
    ] = False,
    out: OutOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Give a tenant a new key; its old keys stop working unless --keep-old."""
    from app.control import tenants

    try:
        issued = tenants.rotate(get_settings(), name, out, revoke_old=not keep_old)
    except DsecError as exc:
        _fail(exc)
        return
    _print([issued.row], as_json, f"new key of {name} (credential in {issued.path})")


@tenant_cli.command("revoke")
def tenant_revoke(
    target: Annotated[str, typer.Argument(help="A key id (k-...), or a name: all its keys.")],
    as_json: JsonOpt = False,
) -> None:
    """Revoke keys: requests signed with them are refused within seconds."""
    from app.control import tenants

    _print(tenants.revoke(get_settings(), target), as_json, "revoked")


@node_cli.command("add")
def node_add(name: str, out: OutOpt = None, as_json: JsonOpt = False) -> None:
    """Make a node credential: copy the file to the node host (DSEC_NODE_CREDENTIAL_FILE)."""
    _issue(Role.NODE, name, "", out, as_json)


@node_cli.command("ls")
def node_ls(as_json: JsonOpt = False) -> None:
    """Nodes' keys."""
    from app.control import tenants

    _print(tenants.listing(get_settings(), Role.NODE), as_json, "node credentials")


@node_cli.command("revoke")
def node_revoke(target: str, as_json: JsonOpt = False) -> None:
    """Revoke a node's keys: its events are refused (dead letters) and it gets no work."""
    from app.control import tenants

    _print(tenants.revoke(get_settings(), target), as_json, "revoked")


NodeOpt = Annotated[
    str | None, typer.Option("--node", help="The node's id (default: DSEC_NODE_ID).")
]


@node_cli.command("up")
def node_up(
    node: NodeOpt = None,
    agent: Annotated[
        Path | None,
        typer.Option(help="The release's agent binary (`dsec node agent`): no compiler here."),
    ] = None,
    foreground: Annotated[
        bool,
        typer.Option("--foreground", help="Become the worker (a container's or a unit's process)."),
    ] = False,
) -> None:
    """Set this host up as a node and start its worker, from settings alone: Kafka and
    Redis of the control plane, the node's credential (DSEC_NODE_CREDENTIAL_FILE)."""
    from app.stack import node_host

    settings = get_settings()
    try:
        node_host.up(settings, node or settings.node_id, agent, _log, foreground=foreground)
    except DsecError as exc:
        console.print(f"[red]dsec:[/] {exc}")
        raise typer.Exit(2) from exc


@node_cli.command("down")
def node_down(node: NodeOpt = None) -> None:
    """Stop this host's node worker (its sandboxes wait for the next one)."""
    from app.stack import node_host

    settings = get_settings()
    node_host.down(settings, node or settings.node_id, _log)


@node_cli.command("agent")
def node_agent(
    out: Annotated[Path, typer.Option(help="Where to write the agent binary.")],
) -> None:
    """Compile the in-sandbox agent once (static): a release's binary for node hosts
    without a compiler (`dsec node up --agent FILE`)."""
    from workers.agent.build import build_agent

    try:
        console.print(f"agent: {build_agent(out)}")
    except DsecError as exc:
        _fail(exc)


def _log(message: str) -> None:
    console.print(f"[green]✓[/] {message}")


LimitOpt = Annotated[
    str | None,
    typer.Option(
        help="A number, `none` (no limit) or `default` (the settings').", show_default=False
    ),
]


def _limit(resource: Resource, text: str) -> Change:
    """An option's value as a change of limit; ConfigError if it is none of them."""
    from app.control.stored_quotas import Back

    if text in ("none", "default"):
        return None if text == "none" else Back.DEFAULT
    if not (text.isascii() and text.isdigit()):
        option = resource.value.replace("_", "-")
        raise ConfigError(f"--{option} {text!r}: a number, none or default")
    return int(text)


@tenant_cli.command("quota")
def tenant_quota(
    name: str,
    show: Annotated[bool, typer.Option("--show", help="Only show its limits.")] = False,
    sandboxes: LimitOpt = None,
    leases: LimitOpt = None,
    groups: LimitOpt = None,
    pending_creates: LimitOpt = None,
    commands: LimitOpt = None,
    trajectories: LimitOpt = None,
    images: LimitOpt = None,
    image_mb: LimitOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Set a tenant's own limits on what it may hold at once (taking effect within 5 s),
    and show them with where each comes from (`--show`: only show)."""
    from app.control import stored_quotas

    given = {
        Resource.SANDBOXES: sandboxes, Resource.LEASES: leases, Resource.GROUPS: groups,
        Resource.PENDING_CREATES: pending_creates, Resource.COMMANDS: commands,
        Resource.TRAJECTORIES: trajectories, Resource.IMAGES: images,
        Resource.IMAGE_MB: image_mb,
    }  # fmt: skip
    try:
        if not SUBJECT.match(name):
            raise ConfigError(f"{name!r} is not a tenant name")
        changes = {r: _limit(r, text) for r, text in given.items() if text is not None}
        if changes and show:
            raise ConfigError("--show only shows: leave out the limits, or --show")
        settings = get_settings()
        if changes:
            held = stored_quotas.change(settings, name, changes)
        else:
            held = stored_quotas.limits(settings, name)
    except DsecError as exc:
        _fail(exc)
        return
    rows = [
        {"resource": h.resource.value,
         "limit": h.limit if as_json or h.limit is not None else "none", "from": h.source}
        for h in held
    ]  # fmt: skip
    cli_render.rows(f"quota of {name}", rows, as_json)
