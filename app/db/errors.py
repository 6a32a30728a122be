"""Database errors as the platform's errors, classified by SQLSTATE in one place.

Callers above ``app/db`` never catch a driver exception: they hear
:class:`ServiceUnavailable` (Postgres is not there now; waiting helps),
:class:`LogTamperRefused` (the append-only log or a role's grants refused the
statement) or :class:`StorageRefused` (this statement can never be stored: bad data,
a broken constraint; waiting does not help).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError, OperationalError, SQLAlchemyError

from app.errors import DsecError, LogTamperRefused, ServiceUnavailable, StorageRefused

#: SQLSTATE classes that mean "not now, try again": connection exceptions, a
#: transaction rolled back (serialization failure, deadlock), insufficient resources,
#: a lock not available, operator intervention (shutdown, recovery), a system error.
#: Every other class (bad data, constraints, program limits...) refuses the statement
#: for good.
_UNAVAILABLE_CLASSES = ("08", "40", "53", "55", "57", "58")
#: A role's missing grant, and the log's append-only trigger (which raises it).
_REFUSED_CODES = ("42501",)

#: What "Postgres is not there now" looks like before translation (the service loops
#: that wait for it also see errors raised outside :func:`translated`).
UNAVAILABLE: tuple[type[BaseException], ...] = (ServiceUnavailable, OperationalError)


def sqlstate(exc: SQLAlchemyError) -> str | None:
    """The SQLSTATE of a driver error, if the server gave one."""
    return getattr(getattr(exc, "orig", None), "sqlstate", None)


def classify(exc: SQLAlchemyError) -> DsecError:
    """The platform's error for a database error."""
    detail = str(getattr(exc, "orig", None) or exc)
    code = sqlstate(exc)
    if code is None:
        # No answer from the server at all (refused, reset, timed out): an outage.
        if isinstance(exc, OperationalError) or not isinstance(exc, DBAPIError):
            return ServiceUnavailable(f"Postgres: {detail}")
        return StorageRefused(detail)
    if code in _REFUSED_CODES:
        return LogTamperRefused(detail)
    if code[:2] in _UNAVAILABLE_CLASSES:
        return ServiceUnavailable(f"Postgres: {detail}")
    return StorageRefused(detail)


@contextmanager
def translated() -> Iterator[None]:
    """Raise database errors from the block as the platform's (see :func:`classify`)."""
    try:
        yield
    except SQLAlchemyError as exc:
        raise classify(exc) from exc


@contextmanager
def savepoint(conn: Connection) -> Iterator[None]:
    """Run the block in a savepoint of ``conn``'s transaction: on a database error it
    is rolled back, the transaction goes on, and the caller hears the platform's error
    (a :class:`StorageRefused` row can be set aside and the rest committed)."""
    nested = conn.begin_nested()
    try:
        yield
    except SQLAlchemyError as exc:
        nested.rollback()
        raise classify(exc) from exc
    nested.commit()
