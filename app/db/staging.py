"""Session-local staging tables: a batch reaches Postgres by binary COPY, not as parameters.

The projector's hot statements read their rows from a temporary table that the batch
was COPYed into: psycopg formats binary COPY rows in C, and Postgres reads them
without parsing text (uuids, timestamps and numbers arrive as bytes). One json
parameter unpacked by ``jsonb_populate_recordset`` cost more on both sides. A
statement consumes its stage with ``DELETE ... RETURNING``, so a transaction may use
a stage many times (the event-by-event fallback, a rebuild); ON COMMIT DELETE ROWS
keeps dead rows from piling up, since temporary tables are never vacuumed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import psycopg
from sqlalchemy import Connection, Engine, event
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import ConnectionPoolEntry


@dataclass(frozen=True)
class Stage:
    """One staging table: its name and its (column, Postgres type) pairs, in COPY order."""

    name: str
    columns: tuple[tuple[str, str], ...]

    @property
    def ddl(self) -> str:
        """CREATE TEMP TABLE statement (idempotent)."""
        cols = ", ".join(f'"{c}" {t}' for c, t in self.columns)
        return f"CREATE TEMP TABLE IF NOT EXISTS {self.name} ({cols}) ON COMMIT DELETE ROWS"

    @property
    def copy_sql(self) -> str:
        """The COPY that fills it."""
        cols = ", ".join(f'"{c}"' for c, _ in self.columns)
        return f"COPY {self.name} ({cols}) FROM STDIN (FORMAT BINARY)"

    @property
    def _flag(self) -> str:
        return f"dsec_stage_{self.name}"


_STAGES: list[Stage] = []


def stage(name: str, columns: Sequence[tuple[str, str]]) -> Stage:
    """Declare a staging table; :func:`stage_on_connect` creates every declared one."""
    made = Stage(name, tuple(columns))
    _STAGES.append(made)
    return made


def stage_on_connect(engine: Engine) -> None:
    """Create the declared staging tables on each new connection of ``engine``.

    Created and committed on their own when the connection opens, they are there for
    every batch without a statement of their own; connections opened before this was
    called (or of other engines) get them inside their first :func:`copy_rows`.
    """
    if not event.contains(engine, "connect", _create_stages):
        event.listen(engine, "connect", _create_stages)


def _create_stages(dbapi_connection: Any, record: ConnectionPoolEntry) -> None:
    with dbapi_connection.cursor() as cur:
        for s in _STAGES:
            cur.execute(s.ddl)
    dbapi_connection.commit()
    for s in _STAGES:
        record.info[s._flag] = True


def driver(conn: Connection) -> psycopg.Connection[Any]:
    """The psycopg connection under ``conn`` (COPY and plain tuples need it)."""
    return cast("psycopg.Connection[Any]", conn.connection.driver_connection)


@contextmanager
def driver_errors(statement: str) -> Iterator[None]:
    """Raise psycopg's errors as SQLAlchemy would have wrapped them.

    Work done straight on the driver bypasses SQLAlchemy; wrapped, its errors reach
    callers as usual, which tell a refused row (DataError) from an outage by them.
    """
    try:
        yield
    except psycopg.Error as exc:
        raise DBAPIError.instance(statement, None, exc, psycopg.Error) from exc


def ensure(conn: Connection, target: Stage) -> None:
    """Make the staging table exist on ``conn`` (an engine without
    :func:`stage_on_connect` has none), for a statement that reads it."""
    if not conn.info.get(target._flag):
        # Not remembered: created inside this transaction, it is gone if it rolls back.
        conn.exec_driver_sql(target.ddl)


def copy_rows(conn: Connection, target: Stage, rows: Iterable[Sequence[Any]]) -> None:
    """COPY ``rows`` (in ``target``'s column order) into the staging table, in the
    caller's transaction."""
    ensure(conn, target)
    with (
        driver_errors(target.copy_sql),
        driver(conn).cursor() as cur,
        cur.copy(target.copy_sql) as copy,
    ):
        copy.set_types([t for _, t in target.columns])
        for row in rows:
            copy.write_row(row)
