"""Reports for people: the audit trail and the daily bill, read from the SQL views.

The arithmetic lives in the views of migration 0002 (``audit_trail``, ``sandbox_lives``,
``billing_daily``), so an operator in ``psql`` and ``dsec audit``/``dsec bill`` get the
same figures. This module only filters, orders and formats them.
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
from sqlalchemy import (
    BigInteger,
    Boolean,
    Connection,
    Date,
    DateTime,
    Numeric,
    Select,
    Text,
    column,
    select,
    table,
)

Row = dict[str, Any]

#: The ``audit_trail`` view: one row per event about a sandbox (columns we report).
audit_trail = table(
    "audit_trail",
    column("position", BigInteger),
    column("occurred_at", DateTime(timezone=True)),
    column("tenant", Text),
    column("job_id", Text),
    column("sandbox_id", Text),
    column("node_id", Text),
    column("type", Text),
    column("actor", Text),
    column("action", Text),
    column("outcome", Text),
    column("detail", Text),
    column("denied", Boolean),
)

#: The ``billing_daily`` view: usage per tenant, job and UTC day.
billing_daily = table(
    "billing_daily",
    column("tenant", Text),
    column("job_id", Text),
    column("day", Date),
    column("sandboxes", BigInteger),
    column("sandbox_seconds", Numeric),
    column("core_seconds", Numeric),
    column("gb_seconds", Numeric),
    column("commands", BigInteger),
)


#: Column names of ``audit`` and ``bill`` rows, in order (CSV headers even with no rows).
AUDIT_COLUMNS = tuple(c.name for c in audit_trail.c)
BILL_COLUMNS = tuple(c.name for c in billing_daily.c)


class Format(StrEnum):
    """How ``render`` prints rows."""

    TABLE = "table"
    CSV = "csv"
    JSON = "json"


def _rows(conn: Connection, query: Select[Any]) -> list[Row]:
    return [dict(r._mapping) for r in conn.execute(query)]


def audit(
    conn: Connection,
    sandbox_id: str | None = None,
    tenant: str | None = None,
    job_id: str | None = None,
    since: datetime | None = None,
    limit: int = 100,
    denied: bool = False,
) -> list[Row]:
    """The latest ``limit`` audit rows matching the filters, oldest first (like ``tail``);
    with ``denied``, only refusals of the sender (unauthenticated, forbidden, replays)."""
    t = audit_trail
    query = select(t).order_by(t.c.position.desc()).limit(limit)
    if denied:
        query = query.where(t.c.denied)
    if sandbox_id is not None:
        query = query.where(t.c.sandbox_id == sandbox_id)
    if tenant is not None:
        query = query.where(t.c.tenant == tenant)
    if job_id is not None:
        query = query.where(t.c.job_id == job_id)
    if since is not None:
        query = query.where(t.c.occurred_at >= since)
    return _rows(conn, query)[::-1]


def bill(
    conn: Connection,
    tenant: str | None = None,
    job_id: str | None = None,
    day_from: date | None = None,
    day_to: date | None = None,
) -> list[Row]:
    """Daily usage rows (UTC days, ``day_to`` included), by day, tenant and job."""
    t = billing_daily
    query = select(t).order_by(t.c.day, t.c.tenant, t.c.job_id)
    if tenant is not None:
        query = query.where(t.c.tenant == tenant)
    if job_id is not None:
        query = query.where(t.c.job_id == job_id)
    if day_from is not None:
        query = query.where(t.c.day >= day_from)
    if day_to is not None:
        query = query.where(t.c.day <= day_to)
    return _rows(conn, query)


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
