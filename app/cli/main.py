"""The ``dsec`` command line: run the stack, look at it, and drive sandboxes."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from app.cli import records
from app.cli import render as cli_render
from app.cli.archive import archive_cli
from app.cli.arguments import JsonOpt
from app.cli.control import control_cli
from app.cli.doctor import doctor
from app.cli.image import image_cli
from app.cli.kafka import kafka_cli
from app.cli.records import deadletters_cli, projections_cli
from app.cli.secret import secret_cli
from app.cli.tenant import node_cli, tenant_cli
from app.config import get_settings, redact

cli = typer.Typer(no_args_is_help=True, help="dsec: elastic sandboxes for agent training.")
run_cli = typer.Typer(no_args_is_help=True, help="Run one service in the foreground.")
cli.add_typer(run_cli, name="run")
cli.add_typer(image_cli, name="image")
cli.add_typer(projections_cli, name="projections")
cli.add_typer(deadletters_cli, name="deadletters")
cli.add_typer(tenant_cli, name="tenant")
cli.add_typer(node_cli, name="node")
cli.add_typer(control_cli, name="control")
cli.add_typer(archive_cli, name="log")
cli.add_typer(kafka_cli, name="kafka")
cli.add_typer(secret_cli, name="secret")
cli.command()(doctor)
for read_the_log in (records.events, records.describe, records.audit, records.bill):
    cli.command()(read_the_log)
console = cli_render.console


def _logging() -> None:
    from app import diagnostics

    diagnostics.configure(get_settings().log_format)


@cli.command()
def up(nodes: Annotated[int, typer.Option(help="Node workers to start.")] = 1) -> None:
    """Start the embedded stack (reusing whatever already runs)."""
    from app.stack import services as stack

    stack.up(get_settings(), nodes=nodes, log=lambda m: console.print(f"[green]✓[/] {m}"))
    status(as_json=False)


@cli.command()
def down(
    keep: Annotated[
        list[str] | None,
        typer.Option(
            help="A service to leave running (repeatable), e.g. --keep broker for a host"
            " that only ingests; 'podman' spares the nodes' Podman services."
        ),
    ] = None,
) -> None:
    """Stop the processes the stack started (Postgres and Redis are left alone)."""
    from app.stack import services as stack

    stack.down(get_settings(), log=lambda m: console.print(f"[yellow]■[/] {m}"), keep=keep or ())


@cli.command()
def migrate(
    revision: Annotated[str, typer.Option(help="Alembic revision to bring it to.")] = "head",
) -> None:
    """Create the database if missing and bring its schema to a revision, as the owner
    role (DSEC_ADMIN_DATABASE_URL); `dsec up` and `dsec control up` do it too."""
    from app.db.setup import ensure_database, migrations_dir
    from app.db.setup import migrate as apply

    settings = get_settings()
    ensure_database(settings)
    apply(settings, revision)
    console.print(f"schema at {revision} (migrations from {migrations_dir()})")


@cli.command()
def status(as_json: JsonOpt = False) -> None:
    """What runs, where, and how to reach it."""
    from app.stack import services as stack
    from app.stack.restarts import Restarts

    settings = get_settings()
    rows = []
    now = time.time()
    owned = stack.scheduler_partitions(settings) or {}
    for service in stack.services(settings, stack.known_node_ids(settings)):
        pid = service.pid(settings)
        alive = pid is not None or (service.ready is not None and service.ready())
        restarts = Restarts.load(settings, service.name)
        if alive:
            state = "stale: restarted by up" if service.stale(settings) else "running"
        elif restarts.gave_up:
            state = "failed (gave up)"
        else:
            state = "died" if service.pidfile(settings).exists() else "stopped"
        rows.append(
            {
                "service": service.name,
                "state": state,
                "pid": pid,
                "restarts": len(restarts.recent(now)),
                "endpoint": service.endpoint,
                "log": str(service.logfile(settings)),
                # A scheduler's partitions of the requests topic (Postgres's locks).
                "partitions": (
                    ",".join(map(str, owned.get(pid, []))) or "none"
                    if service.name.startswith("scheduler") and pid is not None
                    else None
                ),
            }
        )

    rows.append(
        {
            "service": "postgres",
            "state": "external",
            "pid": None,
            "restarts": 0,
            "endpoint": redact(settings.database_url),
            "log": "",
            "partitions": None,
        }
    )
    cli_render.rows("dsec stack", rows, as_json)


@run_cli.command("projector")
def run_projector(
    partitions: Annotated[str, typer.Option(help="Comma-separated partitions (default all).")] = "",
) -> None:
    """Events topic -> Postgres log and projections."""
    from app.control import projector

    _logging()
    parts = [int(p) for p in partitions.split(",") if p.strip()] or None
    projector.main(get_settings(), parts)


@run_cli.command("scheduler")
def run_scheduler() -> None:
    """Requests topic -> placement and node tasks."""
    from app.control import scheduler

    _logging()
    scheduler.main(get_settings())


@run_cli.command("hub-auth")
def run_hub_auth() -> None:
    """The image hub's token service (who may pull and push what)."""
    from app.control import hub_auth

    _logging()
    hub_auth.main(get_settings())


@run_cli.command("hub")
def run_hub() -> None:
    """The image hub in one container: the registry and its token service."""
    from app.stack import hub

    _logging()
    hub.run(get_settings())


@run_cli.command("supervisor")
def run_supervisor() -> None:
    """Restart the embedded stack's services that die (with backoff and a limit)."""
    from app.stack import supervisor

    _logging()
    supervisor.run(get_settings())


@run_cli.command("worker")
def run_worker(
    node: Annotated[str, typer.Option(help="Node id.")] = "",
    concurrency: Annotated[int, typer.Option(help="Task threads.")] = 16,
) -> None:
    """The node agent: a Celery worker driving rootless Podman."""
    from workers import main as worker_main

    _logging()
    worker_main.run(node or get_settings().node_id, concurrency)


@cli.command()
def ps(
    as_json: JsonOpt = False,
    all_: Annotated[bool, typer.Option("--all", help="Include ended sandboxes.")] = False,
    tenant: Annotated[str, typer.Option(help="Only this tenant.")] = "",
    job: Annotated[str, typer.Option(help="Only this job.")] = "",
    limit: Annotated[int, typer.Option(help="At most this many rows.")] = 50,
) -> None:
    """Sandboxes, newest first."""
    from app.db import queries
    from app.db.engine import transaction

    with transaction(get_settings().database_url) as conn:
        rows = queries.sandbox_list(
            conn, include_ended=all_, tenant=tenant, job_id=job, limit=limit
        )
    cli_render.rows("sandboxes", rows, as_json)


@cli.command()
def cp(
    src: Annotated[str, typer.Argument(help="LOCAL_PATH or SANDBOX:PATH.")],
    dest: Annotated[str, typer.Argument(help="SANDBOX:DIR or LOCAL_DIR.")],
    tenant: TenantOpt = "",
    job: JobOpt = "",
    as_json: JsonOpt = False,
) -> None:
    """Copy a file or directory tree into or out of a sandbox; print where it landed.

    dsec cp ./project SANDBOX:/workspace   |   dsec cp SANDBOX:/workspace/out ./results
    """
    from app.cli import sandbox as cli_sandbox

    code = cli_sandbox.run_cp(get_settings(), src, dest, tenant=tenant, job=job, as_json=as_json)
    raise typer.Exit(code)


@cli.command()
def schemas(
    out: Annotated[
        Path | None,
        typer.Option(help="Directory to write to (default: the checkout's docs/schemas)."),
    ] = None,
) -> None:
    """Write the JSON Schemas of every bus message (generated from the models)."""
    from app.cli import schemas as schemas_mod

    for path in schemas_mod.write(out or schemas_mod.default_dir()):
        console.print(f"wrote {path}")


@cli.command()
def demo(
    sandboxes: Annotated[int, typer.Option(help="Sandboxes to run.")] = 20,
    commands: Annotated[int, typer.Option(help="Commands per sandbox.")] = 5,
    concurrency: Annotated[int, typer.Option(help="Sandboxes in flight at once.")] = 10,
) -> None:
    """A trainer-like workload on the running stack, with a summary."""
    from app.cli import demo as demo_mod

    demo_mod.run(get_settings(), sandboxes, commands, concurrency, console)


# --- driving sandboxes, watching nodes, benchmarks (logic in app/cli_*.py) ---------

TenantOpt = Annotated[
    str,
    typer.Option(help="Act with this tenant's local credential (default: the operator's)."),
]
JobOpt = Annotated[str, typer.Option("--job", help="Job to act for (default: the sandbox's).")]


@cli.command("exec")
def exec_(
    sandbox_id: str,
    command: Annotated[
        list[str], typer.Argument(help="One shell string, or an argv list after `--`.")
    ],
    timeout: Annotated[float, typer.Option(help="Seconds before the command is killed.")] = 60.0,
    tenant: TenantOpt = "",
    job: JobOpt = "",
    as_json: Annotated[bool, typer.Option("--json", help="Print the result object.")] = False,
) -> None:
    """Run a command in a sandbox: print its output raw as it comes, exit with its exit code.

    dsec exec SANDBOX -- ls -l /workspace   |   dsec exec SANDBOX 'echo $HOME | wc -c'

    Exit 124: the command ran out of time; 128+N: signal N; 125: dsec could not run it.
    """
    from app.cli import sandbox as cli_sandbox

    code = cli_sandbox.run_exec(
        get_settings(), sandbox_id, command, timeout_s=timeout, tenant=tenant, job=job,
        as_json=as_json,
    )  # fmt: skip
    raise typer.Exit(code)


@cli.command()
def create(
    image: Annotated[str | None, typer.Option(help="Image (default: the platform's).")] = None,
    memory_mb: Annotated[int | None, typer.Option(help="Memory limit, MiB.")] = None,
    cpus: Annotated[float | None, typer.Option(help="CPU cores.")] = None,
    ttl: Annotated[int | None, typer.Option(help="Seconds until it is destroyed.")] = None,
    tenant: Annotated[str, typer.Option(help="Tenant billed for it.")] = "default",
    job: Annotated[str, typer.Option("--job", help="Job billed for it.")] = "cli",
    allow: Annotated[
        list[str] | None,
        typer.Option(
            help="Network to this destination only ('name[:ports]', '*.domain', 'cidr:port');"
            " repeat for more. Without it: no network."
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Create a sandbox and print its id once it runs."""
    from app.cli import sandbox as cli_sandbox

    code = cli_sandbox.run_create(
        get_settings(), tenant=tenant, job=job, as_json=as_json,
        image=image, memory_mb=memory_mb, cpus=cpus, ttl_s=ttl,
        network={"allow": allow} if allow else None,
    )  # fmt: skip
    raise typer.Exit(code)


@cli.command()
def expose(
    sandbox_id: str,
    port: int,
    ttl: Annotated[int, typer.Option(help="Seconds the URL works.")] = 3600,
    tenant: TenantOpt = "",
    job: JobOpt = "",
) -> None:
    """Open a port of a sandbox to HTTP and WebSocket clients; print its URL (signed,
    expiring, closed when the sandbox ends)."""
    from app.cli import sandbox as cli_sandbox

    code = cli_sandbox.run_expose(get_settings(), sandbox_id, port, ttl, tenant=tenant, job=job)
    raise typer.Exit(code)


@cli.command()
def destroy(sandbox_id: str, tenant: TenantOpt = "", job: JobOpt = "") -> None:
    """Destroy a sandbox (it ends with reason `destroyed`)."""
    from app.cli import sandbox as cli_sandbox

    raise typer.Exit(cli_sandbox.run_destroy(get_settings(), sandbox_id, tenant=tenant, job=job))


@cli.command()
def top(
    interval: Annotated[float, typer.Option(help="Seconds between frames.")] = 2.0,
    once: Annotated[bool, typer.Option("--once", help="Print one frame and exit.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one frame as JSON.")] = False,
) -> None:
    """Nodes, their capacity and load, and live sandboxes per node and tenant."""
    from app.cli import top as cli_top

    settings = get_settings()
    if as_json:
        print(json.dumps(cli_top.read(settings), indent=2))
    elif once:
        console.print(cli_top.render(cli_top.read(settings)))
    else:
        cli_top.watch(settings, console, interval)


@cli.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def bench(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Benchmark (bench/NAME.py); none: list.")] = "",
    as_json: Annotated[
        bool, typer.Option("--json", help="List as JSON (with NAME: passed to it).")
    ] = False,
) -> None:
    """Run a benchmark from bench/ with this venv's python (extra arguments go to it)."""
    from app.cli import bench as cli_bench

    if name:
        raise typer.Exit(cli_bench.run(name, [*ctx.args, *(["--json"] if as_json else [])]))
    rows = [{"name": k, "what": v} for k, v in cli_bench.available().items()]
    cli_render.rows("benchmarks (dsec bench NAME [ARGS...])", rows, as_json)


def _version(show: bool) -> None:
    if show:
        import app
        from app.domain.base import PROTOCOL_VERSIONS

        speaks = ", ".join(map(str, PROTOCOL_VERSIONS))
        print(f"dsec {app.__version__} (wire protocol {speaks})")
        raise typer.Exit()


@cli.callback()
def _options(
    show_version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    """dsec: elastic sandboxes for agent training."""


def main() -> None:
    """Entry point of the ``dsec`` console script.

    An expected failure (Postgres or the broker down, a refused request, bad settings)
    is one line on stderr and exit status 2, not a traceback; a bug still shows one.
    """
    from app.errors import DsecError, first_line

    try:
        cli()
    except DsecError as exc:
        print(f"dsec: {type(exc).__name__}: {first_line(exc)}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
