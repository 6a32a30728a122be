"""``dsec log ...``: move old days of the log out of Postgres and back (owner role)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from app.config import get_settings
from app.errors import DsecError

archive_cli = typer.Typer(
    no_args_is_help=True, help="The event log's days: archive old ones, restore, list."
)
console = Console()


@archive_cli.command("archive")
def log_archive(
    older_than: Annotated[
        int, typer.Option("--older-than", help="Archive whole UTC days older than this (days).")
    ],
    to: Annotated[Path, typer.Option("--to", help="Directory the day files are written to.")],
) -> None:
    """Detach, write to <dir>/events_p<day>.csv.gz (checked), record and drop old days.

    Bills, lives and usage of those days stay answerable (their projections keep
    them); the audit trail of a day answers again after `dsec log restore`.
    """
    from app.db import archive

    try:
        done = archive.archive(
            get_settings().admin_database_url, older_than, to, datetime.now(UTC).date()
        )
    except DsecError as exc:
        console.print(f"[red]dsec:[/] {exc}")
        raise typer.Exit(2) from None
    for day in done:
        console.print(f"{day.day}: {day.events} events -> {day.file} (sha256 {day.sha256[:16]}…)")
    console.print(f"archived {len(done)} day(s)")


@archive_cli.command("restore")
def log_restore(path: Path) -> None:
    """Put an archived day back into the log (the file must match its record)."""
    from app.db import archive

    try:
        day = archive.restore(get_settings().admin_database_url, path)
    except (DsecError, OSError) as exc:
        console.print(f"[red]dsec:[/] {exc}")
        raise typer.Exit(2) from None
    console.print(f"{day.day}: {day.events} events back in the log as {day.partition}")


@archive_cli.command("ls")
def log_ls() -> None:
    """The archived days: events, file, checksum, when and by whom, restored or not."""
    from app.cli import render
    from app.db import archive

    names = ("day", "events", "first_position", "last_position", "file", "sha256",
             "archived_at", "archived_by", "restored_at")  # fmt: skip
    rows = [dict(zip(names, row, strict=True)) for row in archive.archived_days(
        get_settings().admin_database_url)]  # fmt: skip
    render.render(rows, render.Format.TABLE, "archived days of the log", console, names)
