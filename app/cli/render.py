"""How every `dsec` command prints rows: a rich table for a person, CSV or JSON for a
program. Tables leave out columns empty in every row, wrap long values rather than
cut them, and right-align numbers; JSON keeps numbers numbers and times ISO 8601."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Mapping, Sequence
from datetime import UTC, date, datetime
from decimal import Decimal
from enum import StrEnum
from typing import Any

from rich.console import Console
from rich.table import Table

console = Console()


class Format(StrEnum):
    """How ``render`` prints rows."""

    TABLE = "table"
    CSV = "csv"
    JSON = "json"


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


def rows(title: str, found: Sequence[Mapping[str, Any]], as_json: bool) -> None:
    """Print ``found`` as a table titled ``title``, or as a JSON list."""
    render(found, Format.JSON if as_json else Format.TABLE, title, console)


def record(title: str, found: Mapping[str, Any], as_json: bool) -> None:
    """Print one record as a field/value table (empty fields left out), or as a JSON
    object."""
    if as_json:
        console.file.write(json.dumps({k: _plain(v) for k, v in found.items()}, indent=2) + "\n")
        console.file.flush()
        return
    shown = [
        {"field": k, "value": v if not isinstance(v, list | dict) else json.dumps(v)}
        for k, v in found.items()
        if v not in (None, "", [], {})
    ]
    console.print(to_table(shown, title, ["field", "value"]))
