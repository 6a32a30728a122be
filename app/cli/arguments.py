"""The CLI's arguments that are more than a word: times (``--since 2h``) and UTC days
(``--from 7d``, ``yesterday``, ``2026-11-29``)."""

from __future__ import annotations

import re
from datetime import UTC, date, datetime, timedelta
from typing import Annotated

import typer

#: ``--json``: what every listing command takes to print JSON instead of a table.
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
#: ``--tenant``: the local credential a tenant's command acts with.
TenantOpt = Annotated[
    str, typer.Option(help="Act with this tenant's local credential (default: the client's).")
]

_AGO = re.compile(r"^\s*(\d+)\s*([smhdw])\s*$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


def parse_since(text: str, now: datetime | None = None) -> datetime:
    """``30m``, ``2h``, ``7d``, ``1w`` ago, or an ISO 8601 time (naive means UTC)."""
    now = now or datetime.now(UTC)
    if m := _AGO.match(text):
        return now - timedelta(**{_UNITS[m[2]]: int(m[1])})
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(f"not a time: {text!r} (use e.g. 2h, 7d or 2026-11-29T10:00)") from None
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def parse_day(text: str, today: date | None = None) -> date:
    """A UTC day: ``today``, ``yesterday``, ``7d`` (that many days ago) or ``2026-11-29``."""
    today = today or datetime.now(UTC).date()
    word = text.strip().lower()
    if word == "today":
        return today
    if word == "yesterday":
        return today - timedelta(days=1)
    if m := re.fullmatch(r"(\d+)d", word):
        return today - timedelta(days=int(m[1]))
    try:
        return date.fromisoformat(word)
    except ValueError:
        raise ValueError(f"not a day: {text!r} (use e.g. 2026-11-29, yesterday or 7d)") from None
