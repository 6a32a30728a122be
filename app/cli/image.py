"""``dsec image``: the shared image-layer store, managed by operators (run as root), and
``publish``, ``held`` and ``delete``, a tenant's way to bring its own images to the hub,
see what they hold and take them away.

Every node's sandboxes start from this store's read-only layers: images are imported
or built into it, pushed from it to the hub (the unit's registry), and pulled from
the hub by a node that lacks one. See docs/images.md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from app.cli.arguments import JsonOpt, TenantOpt
from app.config import get_settings

image_cli = typer.Typer(
    no_args_is_help=True,
    help="The image-layer store and the hub: import, build, push, prefetch, ls, rm; "
    "a tenant's publish, held, delete.",
)
console = Console(soft_wrap=True)  # messages carry paths and names: never break them


def _fail(message: str) -> typer.Exit:
    console.print(f"[red]✗[/] {message}")
    return typer.Exit(1)


@image_cli.command("import")
def import_(
    name: Annotated[str, typer.Argument(help="Image name, e.g. team/tools:1.")],
    tarball: Annotated[
        str, typer.Argument(help="Root filesystem tarball or `podman save` archive; - for stdin.")
    ],
    change: Annotated[
        list[str] | None,
        typer.Option(help="Containerfile instruction for a rootfs, e.g. 'CMD [\"/bin/sh\"]'."),
    ] = None,
) -> None:
    """Import a root filesystem tarball (podman import) or an image archive (podman load)."""
    from app.images.build import import_image, spooled
    from workers.errors import NodeError

    settings = get_settings()
    try:
        if tarball == "-":
            with spooled(sys.stdin.buffer, settings) as path:
                kind = import_image(name, path, settings, changes=change or ())
        else:
            kind = import_image(name, Path(tarball), settings, changes=change or ())
    except NodeError as exc:
        raise _fail(str(exc)) from exc
    if kind is None:
        raise _fail(f"{name} is already in the store (dsec image rm {name} first)")
    console.print(f"[green]✓[/] imported {name} ({kind})")


@image_cli.command()
def build(
    name: Annotated[str, typer.Argument(help="Name of the new image.")],
    file: Annotated[
        Path | None,
        typer.Option("--file", "-f", help="Containerfile (FROM an image in the store)."),
    ] = None,
    context: Annotated[
        Path | None, typer.Argument(help="Build context (default: the Containerfile's directory).")
    ] = None,
    network: Annotated[
        str, typer.Option(help="Network of RUN steps: none (default), host, ...")
    ] = "none",
    build_arg: Annotated[
        list[str] | None, typer.Option(help="KEY=VALUE for an ARG, repeatable.")
    ] = None,
    debian: Annotated[
        bool, typer.Option("--debian", help="Build the Debian image (as `build-debian`).")
    ] = False,
) -> None:
    """Build a Containerfile into the store with root's Podman (--pull=never)."""
    from app.images.build import build_image
    from workers.errors import NodeError

    if debian:
        build_debian(image=name)
        return
    if file is None:
        raise typer.BadParameter("give the Containerfile with -f (or --debian)")
    args: dict[str, str] = {}
    for item in build_arg or ():
        key, sep, value = item.partition("=")
        if not sep:
            raise typer.BadParameter(f"--build-arg {item!r} is not KEY=VALUE")
        args[key] = value
    try:
        output = build_image(name, file, context, get_settings(), network=network, build_args=args)
    except NodeError as exc:
        raise _fail(str(exc)) from exc
    if output is None:
        raise _fail(f"{name} is already in the store (dsec image rm {name} first)")
    console.print(output.rstrip(), markup=False, highlight=False)
    console.print(f"[green]✓[/] built {name}")


@image_cli.command("build-debian")
def build_debian(
    image: Annotated[str, typer.Option(help="Name of the image.")] = "dsec/debian-python:12",
    mirror: Annotated[
        str, typer.Option(help="Debian mirror (default: the one apt is configured with).")
    ] = "",
    fresh: Annotated[
        bool, typer.Option("--fresh", help="Run debootstrap again, ignoring the cached rootfs.")
    ] = False,
) -> None:
    """Debian 12 with python3 and git from Debian packages (debootstrap, cached)."""
    from app.images.debian import build_debian_image
    from workers.errors import NodeError

    try:
        done = build_debian_image(
            get_settings(),
            image=image,
            mirror=mirror or None,
            fresh=fresh,
            log=lambda m: console.print(f"[green]·[/] {m}", markup=True, highlight=False),
        )
    except NodeError as exc:
        raise _fail(str(exc)) from exc
    console.print(f"[green]✓[/] {done.image} {'was there' if done.skipped else 'is ready'}")


@image_cli.command("build-platform")
def build_platform(
    tag: Annotated[str, typer.Option(help="Tag of both images (default: the version).")] = "",
    fresh: Annotated[
        bool, typer.Option("--fresh", help="Remove the images first and build them again.")
    ] = False,
) -> None:
    """The platform's own images from this checkout: dsec/control and dsec/node."""
    from app.images.platform import build_platform_images
    from workers.errors import NodeError

    try:
        build_platform_images(
            get_settings(),
            tag=tag or None,
            fresh=fresh,
            log=lambda m: console.print(f"[green]·[/] {m}", markup=True, highlight=False),
        )
    except NodeError as exc:
        raise _fail(str(exc)) from exc


@image_cli.command("ls")
def ls(as_json: JsonOpt = False) -> None:
    """Images in the store: name, id, size, created."""
    from app.cli import render as cli_render
    from workers.host.layer_store import list_images

    rows: list[dict[str, Any]] = []
    for image in list_images(get_settings()):
        for name in image.names or ("<none>",):
            short = name.removeprefix("localhost/")
            if as_json:
                rows.append(
                    {"name": short, "id": image.id, "size": image.size, "created": image.created}
                )
            else:
                size = f"{image.size / 1e6:.1f} MB"
                rows.append(
                    {"name": short, "id": image.id[:12], "size": size, "created": image.created}
                )
    rows.sort(key=lambda r: str(r["name"]))
    cli_render.rows(f"layer store {get_settings().layer_store}", rows, as_json)


@image_cli.command("rm")
def rm(
    names: Annotated[list[str], typer.Argument(help="Images to remove.")],
    force: Annotated[
        bool, typer.Option("--force", help="Remove even while sandboxes of this stack run it.")
    ] = False,
) -> None:
    """Remove images from the store (refused while a sandbox runs one, unless --force)."""
    from app.images.store import image_users, remove_image
    from workers.errors import NodeError
    from workers.host.layer_store import image_exists

    settings = get_settings()
    failed = False
    for name in names:
        try:
            if not image_exists(name, settings):
                console.print(f"[red]✗[/] {name} is not in the store")
                failed = True
                continue
            users = [] if force else image_users(name, settings)
            if users:
                shown = ", ".join(users[:5]) + (" ..." if len(users) > 5 else "")
                console.print(f"[red]✗[/] {name} runs in {len(users)} sandbox(es): {shown}")
                failed = True
                continue
            remove_image(name, settings)
        except NodeError as exc:
            console.print(f"[red]✗[/] {exc}")
            failed = True
            continue
        console.print(f"[green]✓[/] removed {name}")
    if failed:
        raise typer.Exit(1)


OperatorOpt = Annotated[
    str, typer.Option("--as", help="The operator credential's name (local stack's files).")
]


@image_cli.command()
def push(
    names: Annotated[list[str], typer.Argument(help="Images in the store to copy to the hub.")],
    operator: OperatorOpt = "operator",
) -> None:
    """Copy images from this host's store to the hub, where every node pulls them."""
    from app import credentials
    from app.errors import DsecError
    from workers.errors import NodeError
    from workers.host.hub_client import HubClient

    settings = get_settings()
    try:
        client = HubClient(settings, credentials.for_client(settings, operator))
        for name in names:
            ref = client.push(name)
            console.print(f"[green]✓[/] pushed {name} to {settings.hub}/{ref}")
    except (NodeError, DsecError) as exc:
        raise _fail(str(exc)) from exc


@image_cli.command()
def prefetch(
    names: Annotated[list[str], typer.Argument(help="Images to bring from the hub.")],
    node: Annotated[str, typer.Option(help="The node whose credential pulls.")] = "",
) -> None:
    """Pull images from the hub into this host's store before a create asks for them."""
    from app import credentials
    from app.errors import DsecError
    from workers.errors import NodeError
    from workers.host.hub_client import HubClient

    settings = get_settings()
    node_id = node or settings.node_id
    try:
        path = settings.node_credential_file or credentials.node_file(settings, node_id)
        client = HubClient(settings, credentials.load(path))
        for name in names:
            took = client.pull(name)
            said = f"pulled in {took:.1f} s" if took else "was there"
            console.print(f"[green]✓[/] {name} {said}")
    except (NodeError, DsecError) as exc:
        raise _fail(str(exc)) from exc


@image_cli.command()
def share(
    repository: Annotated[str, typer.Argument(help="A tenant's image repository.")],
    with_: Annotated[
        list[str] | None, typer.Option("--with", help="A tenant to share it with, repeatable.")
    ] = None,
    public: Annotated[bool, typer.Option("--public", help="Every tenant may use it.")] = False,
    remove: Annotated[bool, typer.Option("--remove", help="Take the share back.")] = False,
) -> None:
    """Let tenants start sandboxes from a tenant's image (an operator's; owners share
    their own with `client.images.share`). Takes effect within seconds."""
    from app.db import hub_events
    from app.db.engine import transaction
    from app.domain.hub_access import PUBLIC, share_refusal
    from app.domain.proof import Role

    readers = [*(with_ or []), *([PUBLIC] if public else [])]
    refused = share_refusal(Role.OPERATOR, "operator", repository, readers)
    if refused is not None:
        raise _fail(refused)
    settings = get_settings()
    with transaction(settings.database_url) as conn:
        hub_events.set_readers(conn, repository, readers, "operator (cli)", remove)
    said = "no longer shared with" if remove else "shared with"
    console.print(f"[green]✓[/] {repository} {said} {', '.join(readers)}")


@image_cli.command()
def publish(
    name: Annotated[str, typer.Argument(help="The tenant's image name (no tenants/ prefix).")],
    source: Annotated[
        Path,
        typer.Argument(help="A root filesystem tarball or image archive, or a build context."),
    ],
    tag: Annotated[str, typer.Option(help="Its tag (one that exists is refused).")] = "latest",
    file: Annotated[
        str, typer.Option("--file", "-f", help="Containerfile (in a context: its own).")
    ] = "Containerfile",
    build_arg: Annotated[list[str] | None, typer.Option(help="K=V for the build (repeat).")] = None,
    network: Annotated[bool, typer.Option(help="Give the build's RUN steps network.")] = False,
    tenant: TenantOpt = "",
) -> None:
    """A tenant's own image in the hub: a tarball or archive pushed as it is, or a
    directory built with Podman here (every FROM an image of the hub the tenant may
    use); prints the name a create starts sandboxes of it by."""
    from app import credentials
    from app.errors import ConfigError
    from app.sdk.hub_service import PushError
    from app.sdk.images import Images

    settings = get_settings()
    try:
        images = Images(settings, credentials.for_client(settings, tenant or None))
        if source.is_dir():
            containerfile = Path(file) if Path(file).is_absolute() else source / file
            args = dict(a.partition("=")[::2] for a in build_arg or [])
            image = images.build(name, containerfile, source, tag=tag, build_args=args,
                                 network=network)  # fmt: skip
        else:
            image = images.push(name, source, tag=tag)
    except (ConfigError, PushError) as exc:
        raise _fail(str(exc)) from None
    print(image)


def _tenant_images(tenant: str) -> Any:
    """The SDK's images of the tenant this host's credential (or ``tenant``'s) is."""
    from app import credentials
    from app.sdk.images import Images

    settings = get_settings()
    return Images(settings, credentials.for_client(settings, tenant or None))


@image_cli.command()
def held(as_json: JsonOpt = False, tenant: TenantOpt = "") -> None:
    """A tenant's images in the hub: name, digest, size, pushed; and what they hold
    together against its quota."""
    from app.cli import render as cli_render
    from app.errors import ConfigError
    from app.sdk.hub_service import PushError

    try:
        found = _tenant_images(tenant).list()
    except (ConfigError, PushError) as exc:
        raise _fail(str(exc)) from None
    if as_json:
        print(json.dumps(found, indent=2))
        return
    rows = [
        {
            "name": i["name"],
            "digest": i["digest"][:19],
            "size": f"{i['size'] / 1e6:.1f} MB",
            "pushed": i["pushed_at"],
        }
        for i in found["images"]
    ]
    quota = found.get("quota_mb")
    cli_render.rows(
        f"in the hub: {found['held_bytes'] / 1e6:.1f} MB held"
        + (f" of {quota} MB" if quota is not None else ""),
        rows,
        False,
    )


@image_cli.command()
def delete(
    name: Annotated[
        str,
        typer.Argument(help="The tenant's image, NAME[:TAG] (an operator: the whole name)."),
    ],
    tenant: TenantOpt = "",
) -> None:
    """Delete a tenant's image from the hub: creates of it are refused from then on,
    running sandboxes keep running, and what only it held leaves the quota and the bill.
    With an operator's credential (`--tenant operator`), any image by its whole name
    (`tenants/acme/tools:1`)."""
    from app.domain.hub_access import split_tag
    from app.errors import ConfigError
    from app.sdk.hub_service import PushError

    image, tag = split_tag(name)
    try:
        digests = _tenant_images(tenant).delete(image, tag=tag)
    except (ConfigError, PushError) as exc:
        raise _fail(str(exc)) from None
    console.print(f"[green]✓[/] deleted {image}:{tag} ({', '.join(digests)})")


@image_cli.command()
def gc(
    dry_run: Annotated[bool, typer.Option(help="Say what would go; remove nothing.")] = False,
) -> None:
    """Free the hub's disk of layers no image references any more (what deleted images
    held). Run as root on the hub's host: the hub stops for its length (seconds for
    thousands of blobs) and serves again after; pushes and pulls meanwhile fail."""
    from app.errors import ConfigError
    from app.stack import hub

    try:
        before, after, summary = hub.collect_garbage(get_settings(), dry_run)
    except ConfigError as exc:
        raise _fail(str(exc)) from None
    freed = "would free" if dry_run else "freed"
    console.print(f"[green]✓[/] {summary}; {freed} {(before - after) / 1e6:.1f} MB of "
                  f"{before / 1e6:.1f} MB")  # fmt: skip
