"""Reports for people: rows as a table, CSV or JSON, and the CLI's date arguments.

The arithmetic lives in the views of migration 0002 (``audit_trail``, ``sandbox_lives``,
``billing_daily``), so an operator in ``psql`` and ``dsec audit``/``dsec bill`` get the
same figures; ``app.db.queries`` reads them, this module only formats.
"""

from __future__ import annotations

import csv
import io
import json
import re
from collections.abc import Mapping, Sequence
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from enum import StrEnum
from typing import Any

from rich.console import Console
from rich.table import Table

Row = dict[str, Any]


class Format(StrEnum):
    """How ``render`` prints rows."""

    TABLE = "table"
    CSV = "csv"
    JSON = "json"


# --- parsing of CLI arguments ----------------------------------------------------

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


# --- rendering -------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """A JSON-ready value: numbers stay numbers, times become ISO 8601 text."""
    if isinstance(value, Decimal):
        return int(value) if value == value.to_integral_value() else float(value)
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, Mapping | list | str | int | float | bool) or value is None:
        return value
    return str(value)


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, datetime):
        return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")
    return str(value)


def to_json(rows: Sequence[Mapping[str, Any]]) -> str:
    """Rows as a JSON array of objects."""
    return json.dumps([{k: _plain(v) for k, v in r.items()} for r in rows], indent=2)


def _names(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None) -> list[str]:
    if columns is not None:
        return list(columns)
    return list(rows[0]) if rows else []


def to_csv(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None) -> str:
    """Rows as CSV with a header line (``columns`` default: the first row's keys)."""
    names = _names(rows, columns)
    if not names:
        return ""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=names, lineterminator="\n", extrasaction="ignore")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: "" if v is None else _plain(v) for k, v in row.items()})
    return buffer.getvalue()


def to_table(
    rows: Sequence[Mapping[str, Any]], title: str = "", columns: Sequence[str] | None = None
) -> Table:
    """Rows as a rich table for a terminal.

    Columns empty in every row are left out, long values wrap rather than being cut,
    numbers are right-aligned.
    """
    out = Table(title=title or None)
    if not rows:
        out.add_column("(no rows)")
        return out
    names = [n for n in _names(rows, columns) if any(r.get(n) is not None for r in rows)]
    for name in names:
        value = next(r[name] for r in rows if r.get(name) is not None)
        numeric = isinstance(value, int | float | Decimal) and not isinstance(value, bool)
        out.add_column(name, justify="right" if numeric else "left", overflow="fold")
    for row in rows:
        out.add_row(*(_cell(row.get(n)) for n in names))
    return out


def render(
    rows: Sequence[Mapping[str, Any]],
    fmt: Format,
    title: str = "",
    console: Console | None = None,
    columns: Sequence[str] | None = None,
) -> None:
    """Print rows as a table (rich), CSV or JSON; CSV and JSON go out unstyled."""
    console = console or Console()
    if fmt is Format.TABLE:
        console.print(to_table(rows, title, columns))
        return
    text = to_csv(rows, columns) if fmt is Format.CSV else to_json(rows) + "\n"
    console.file.write(text)
    console.file.flush()
