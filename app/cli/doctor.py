"""``dsec doctor``: list what breaks the invariants of lives (app/db/doctor.py); exit 1
when it finds anything, 0 when the log and the projections are sound."""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated

import typer

from app.cli import render as cli_render
from app.cli.arguments import JsonOpt
from app.config import get_settings


def doctor(
    since: Annotated[
        str,
        typer.Option(help="Look for lives ended twice among ends since: 2h, 7d or an ISO time."),
    ] = "7d",
    grace: Annotated[
        float,
        typer.Option(help="Seconds a deadline may be late before its life counts as overdue."),
    ] = 60.0,
    skip_rebuild: Annotated[
        bool,
        typer.Option(
            "--skip-rebuild",
            help="Do not compare the projections with a rebuild (it locks them meanwhile).",
        ),
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Lives open past their deadlines, lives ended twice, lost nodes with open lives,
    projections that differ from a rebuild. Exit 1 if any."""
    from app.cli import arguments
    from app.db import doctor as checks

    try:
        since_at = arguments.parse_since(since)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    found = checks.examine(
        get_settings(), since_at, timedelta(seconds=grace), with_rebuild=not skip_rebuild
    )
    output = cli_render.Format.JSON if as_json else cli_render.Format.TABLE
    cli_render.render(
        [f.row() for f in found], output, "dsec doctor", cli_render.console, checks.COLUMNS
    )
    if not as_json:
        skipped = {checks.Check.REBUILD_DIFFERS} if skip_rebuild else set()
        what = ", ".join(c.value for c in checks.Check if c not in skipped)
        said = f"{len(found)} finding(s)" if found else "nothing found"
        cli_render.console.print(f"{said} (checked: {what})")
    if found:
        raise typer.Exit(1)
