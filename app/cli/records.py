"""Reading the log: one sandbox's events and description, the audit trail, bills,
dead letters, and the projections rebuilt from it (``dsec events``, ``describe``,
``audit``, ``bill``, ``deadletters``, ``projections``)."""

from __future__ import annotations

import json
from datetime import UTC, date, datetime
from typing import Annotated, Any

import typer
from rich.console import Console

from app.cli import render as cli_render
from app.cli.arguments import JsonOpt
from app.config import get_settings

projections_cli = typer.Typer(no_args_is_help=True, help="Read models derived from the log.")
deadletters_cli = typer.Typer(
    no_args_is_help=True, help="Messages no consumer could use: list them, send them again."
)
console = cli_render.console


def events(sandbox_id: str, as_json: JsonOpt = False) -> None:
    """The log of one sandbox, in order."""
    from app.db import queries
    from app.db.engine import transaction

    with transaction(get_settings().database_url) as conn:
        rows = queries.sandbox_events(conn, sandbox_id)
    if not as_json:
        for row in rows:
            row["payload"] = _summary(row["payload"])
    cli_render.rows(f"events of {sandbox_id}", rows, as_json)


def describe(sandbox_id: str, as_json: JsonOpt = False) -> None:
    """One sandbox: its row, the ports it opened, how it ended (its egress refusals too)."""
    from app.db import queries
    from app.db.engine import transaction

    with transaction(get_settings().database_url) as conn:
        found = queries.sandbox_detail(conn, sandbox_id)
    if found is None:
        console.print(f"[red]no sandbox {sandbox_id}[/red]")
        raise typer.Exit(1)
    cli_render.record(f"sandbox {sandbox_id}", found, as_json)


def _summary(payload: dict[str, Any], width: int = 240) -> str:
    """A payload as ``key=value`` pairs, nested ones flattened and empty ones left out
    (a Stopped's last_state then fits in a table cell)."""
    pairs: list[str] = []
    for key, value in payload.items():
        if isinstance(value, dict):
            pairs += [f"{key}.{k}={v}" for k, v in value.items() if v not in (None, "", [], {})]
        elif value not in (None, "", [], {}):
            pairs.append(f"{key}={value}")
    text = " ".join(pairs)
    return text if len(text) <= width else text[: width - 1] + "…"


ReasonOpt = Annotated[str | None, typer.Option(help="Only letters with this reason.")]
ConsumerOpt = Annotated[str | None, typer.Option(help="Only letters this consumer refused.")]
SinceOpt = Annotated[
    datetime | None, typer.Option(help="Only letters refused at or after this time (UTC).")
]


def _letters(reason: str | None, consumer: str | None, since: datetime | None) -> Any:
    from app.control import dead_letters

    if since is not None and since.tzinfo is None:
        since = since.replace(tzinfo=UTC)
    wanted = dead_letters.LetterFilter(reason=reason, consumer=consumer, since=since)
    return dead_letters.read(get_settings(), wanted)


@deadletters_cli.command("ls")
def deadletters_ls(
    reason: ReasonOpt = None,
    consumer: ConsumerOpt = None,
    since: SinceOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """The letters in the dead-letter topic, oldest first per partition."""
    rows = [
        {
            "letter": f"{s.partition}:{s.offset}",
            "refused_at": s.letter.refused_at.isoformat(timespec="seconds"),
            "consumer": s.letter.consumer,
            "source": f"{s.letter.topic}[{s.letter.partition}]@{s.letter.offset}",
            "reason": s.letter.reason,
            "detail": s.letter.detail if as_json else s.letter.detail[:80],
            "bytes": s.letter.original_size,
            "replayable": not s.letter.original_truncated,
        }
        for s in _letters(reason, consumer, since)
    ]
    cli_render.rows("dead letters", rows, as_json)


@deadletters_cli.command("replay")
def deadletters_replay(
    reason: ReasonOpt = None,
    consumer: ConsumerOpt = None,
    since: SinceOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Send the chosen letters' original bytes to their source topics again.

    For events this is safe to repeat (the log keeps one copy of an event id); a
    message whose cause remains is refused again, as a new letter.
    """
    from app.control import dead_letters

    outcome = dead_letters.replay(get_settings(), _letters(reason, consumer, since))
    if as_json:
        print(json.dumps({"sent": outcome.sent, "truncated": outcome.truncated}))
        return
    skipped = outcome.truncated
    console.print(
        f"sent {outcome.sent} letters to their topics again"
        + (f"; {skipped} kept only part of their message and were not" if skipped else "")
    )


@projections_cli.command("rebuild")
def projections_rebuild(
    check: Annotated[
        bool, typer.Option("--check", help="Compare with the live rows, change nothing.")
    ] = False,
) -> None:
    """Rebuild every projection from the event log (one transaction)."""
    from app.db import doctor, projections
    from app.db.engine import engine_for

    url = get_settings().database_url
    if not check:
        with engine_for(url).connect() as conn, conn.begin():
            projections.lock(conn)
            folded = projections.rebuild(conn)
        console.print(f"rebuilt projections from {folded} events")
        return
    found = doctor.check_rebuild(url)
    differ = found.differing
    console.print(
        f"folded {found.folded} events; {len(differ)} rows differ from the live projections"
    )
    if differ:
        for row in sorted(differ, key=str)[:20]:
            console.print(f"  {row}")
        raise typer.Exit(1)


def audit(
    sandbox: Annotated[str, typer.Option(help="Only this sandbox.")] = "",
    tenant: Annotated[str, typer.Option(help="Only this tenant.")] = "",
    job: Annotated[str, typer.Option(help="Only this job.")] = "",
    since: Annotated[
        str, typer.Option(help="Only events since: 30m, 2h, 7d ago or an ISO time (UTC).")
    ] = "",
    limit: Annotated[int, typer.Option(help="The latest this many events.")] = 100,
    denied: Annotated[
        bool,
        typer.Option(
            "--denied", help="Only refused senders: no proof, another's sandbox, a replay."
        ),
    ] = False,
    fmt: Annotated[str, typer.Option("--format", help="table, csv or json.")] = "table",
    as_json: Annotated[bool, typer.Option("--json", help="Same as --format json.")] = False,
) -> None:
    """Who did what to which sandbox, when, from which node (oldest first)."""
    from app.cli import arguments
    from app.db import billing, queries
    from app.db.engine import transaction

    try:
        output = cli_render.Format("json" if as_json else fmt)
        since_at = arguments.parse_since(since) if since else None
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    with transaction(get_settings().database_url) as conn:
        rows = queries.audit(
            conn,
            sandbox_id=sandbox or None,
            tenant=tenant or None,
            job_id=job or None,
            since=since_at,
            limit=limit,
            denied=denied,
        )
        archived = None if rows else billing.last_archived_day(conn)
    title = "refused senders" if denied else "audit trail"
    cli_render.render(rows, output, title, console, queries.AUDIT_COLUMNS)
    if archived is not None:
        Console(stderr=True).print(
            f"note: the log's days up to {archived} are archived; `dsec log ls` lists them"
            " and `dsec log restore FILE` brings a day's audit trail back"
        )


def bill(
    tenant: Annotated[str, typer.Option(help="Only this tenant.")] = "",
    job: Annotated[str, typer.Option(help="Only this job.")] = "",
    day_from: Annotated[
        str, typer.Option("--from", help="First UTC day: 2026-11-29, yesterday or 7d (ago).")
    ] = "",
    day_to: Annotated[str, typer.Option("--to", help="Last UTC day, included.")] = "",
    fmt: Annotated[str, typer.Option("--format", help="table, csv or json.")] = "table",
    as_json: Annotated[bool, typer.Option("--json", help="Same as --format json.")] = False,
    verify: Annotated[
        bool,
        typer.Option(
            "--verify",
            help="Compare the rollups with the raw log's views for the days (default: 7d"
            " to today); print the rows that differ, exit 1 if any.",
        ),
    ] = False,
) -> None:
    """Usage per tenant, job and UTC day: sandboxes, sandbox/core/GB-seconds, commands."""
    from app.cli import arguments
    from app.db import queries
    from app.db.engine import transaction

    try:
        output = cli_render.Format("json" if as_json else fmt)
        first = arguments.parse_day(day_from) if day_from else None
        last = arguments.parse_day(day_to) if day_to else None
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    if verify:
        _verify_bill(
            first or arguments.parse_day("7d"),
            last or arguments.parse_day("today"),
            tenant or None,
            job or None,
            output,
        )
        return
    with transaction(get_settings().database_url) as conn:
        rows = queries.bill(
            conn, tenant=tenant or None, job_id=job or None, day_from=first, day_to=last
        )
    cli_render.render(rows, output, "bill (UTC days)", console, queries.BILL_COLUMNS)


def _verify_bill(first: date, last: date, tenant: str | None, job: str | None, output: Any) -> None:
    from app.db import billing
    from app.db.engine import transaction

    with transaction(get_settings().database_url) as conn:
        rows = billing.differences(conn, first, last, tenant, job)
        archived = billing.archived_between(conn, first, last)
    if archived:
        console.print(
            f"note: {len(archived)} day(s) of the period are archived ({archived[0]} ..."
            f" {archived[-1]}): the raw log no longer holds them, the rollups do"
        )
    if rows:
        cli_render.render(rows, output, "rollup vs raw log: rows that differ", console)
        raise typer.Exit(1)
    console.print(f"bill {first} .. {last}: the rollups and the raw log agree")
