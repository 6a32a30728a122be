"""Engines for the service role and the owner role, with driver errors translated."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache

from sqlalchemy import Connection, Engine, create_engine
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, OperationalError

from app.errors import LogTamperRefused, ServiceUnavailable, StorageRefused


@lru_cache(maxsize=8)
def engine_for(url: str) -> Engine:
    """One pooled engine per URL per process."""
    return create_engine(url, pool_pre_ping=True, pool_size=5, max_overflow=5)


def libpq_url(url: str) -> str:
    """A SQLAlchemy URL as libpq (psycopg.connect, psql) takes it."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


@contextmanager
def transaction(url: str) -> Iterator[Connection]:
    """A connection in one transaction; psycopg errors become dsec errors."""
    try:
        with engine_for(url).begin() as conn:
            yield conn
    except OperationalError as exc:
        raise ServiceUnavailable(f"Postgres: {exc.orig}") from exc
    except DBAPIError as exc:
        if "append-only" in str(exc.orig) or "permission denied" in str(exc.orig):
            raise LogTamperRefused(str(exc.orig)) from exc
        raise StorageRefused(str(exc.orig)) from exc
