"""Create the database and bring its schema to the newest migration."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Connection, create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

from app.config import Settings
from app.errors import ServiceUnavailable

#: The checkout these modules run from, if they do (an installed wheel has none).
REPO_ROOT = Path(__file__).resolve().parents[2]


def migrations_dir() -> Path:
    """Alembic's scripts: beside this module in an installed wheel, which carries them
    as app/db/migrations, else at the top of the checkout."""
    installed = Path(__file__).with_name("migrations")
    return installed if installed.is_dir() else REPO_ROOT / "migrations"


@contextmanager
def _server(settings: Settings) -> Iterator[tuple[Connection, str]]:
    """An autocommit connection to the server's ``postgres`` database, as the owner
    role, and the name of the database the admin URL names."""
    url = make_url(settings.admin_database_url)
    server = create_engine(url.set(database="postgres"), isolation_level="AUTOCOMMIT")
    try:
        with server.connect() as conn:
            yield conn, str(url.database)
    except OperationalError as exc:
        raise ServiceUnavailable(f"Postgres at {url.host}:{url.port}: {exc.orig}") from exc
    finally:
        server.dispose()


def ensure_database(settings: Settings) -> None:
    """Create the database named in the admin URL if it does not exist."""
    with _server(settings) as (conn, name):
        exists = conn.execute(
            text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name}
        ).scalar()
        if not exists:
            conn.execute(text(f'CREATE DATABASE "{name}"'))


def drop_database(settings: Settings, tries: int = 10) -> None:
    """Drop the database named in the admin URL, sessions and all (the scratch of
    benchmarks and test sessions). A service stopped a moment ago may still hold a
    session Postgres has not ended yet, and the owner may not end another role's: it
    is tried again, once a second, ``tries`` times in all."""
    for attempt in range(tries):
        try:
            with _server(settings) as (conn, name):
                conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
            return
        except Exception:
            if attempt == tries - 1:
                raise
            time.sleep(1.0)


def migrate(settings: Settings, revision: str = "head") -> None:
    """Apply Alembic migrations up to ``revision`` as the owner role."""
    # No alembic.ini: its only setting that counts here is where the scripts are (the
    # checkout's alembic.ini serves Alembic's own command line).
    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    config.set_main_option("path_separator", "os")
    config.attributes["url"] = settings.admin_database_url
    command.upgrade(config, revision)
