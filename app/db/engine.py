"""Engines for the service role and the owner role, with driver errors translated."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache

from sqlalchemy import Connection, Engine, create_engine
from sqlalchemy.engine import make_url

from app.db.errors import translated


@lru_cache(maxsize=8)
def engine_for(url: str) -> Engine:
    """One pooled engine per URL per process."""
    return create_engine(url, pool_pre_ping=True, pool_size=5, max_overflow=5)


def libpq_url(url: str) -> str:
    """A SQLAlchemy URL as libpq (psycopg.connect, psql) takes it."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


@contextmanager
def transaction(url: str) -> Iterator[Connection]:
    """A connection in one transaction; database errors become the platform's
    (:mod:`app.db.errors`)."""
    with translated(), engine_for(url).begin() as conn:
        yield conn
