"""Create the database and bring its schema to the newest migration."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

from app.config import Settings
from app.errors import ServiceUnavailable

REPO_ROOT = Path(__file__).resolve().parents[2]


def ensure_database(settings: Settings) -> None:
    """Create the database named in the admin URL if it does not exist."""
    url = make_url(settings.admin_database_url)
    name = url.database
    server = create_engine(url.set(database="postgres"), isolation_level="AUTOCOMMIT")
    try:
        with server.connect() as conn:
            exists = conn.execute(
                text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name}
            ).scalar()
            if not exists:
                conn.execute(text(f'CREATE DATABASE "{name}"'))
    except OperationalError as exc:
        raise ServiceUnavailable(f"Postgres at {url.host}:{url.port}: {exc.orig}") from exc
    finally:
        server.dispose()


def migrate(settings: Settings, revision: str = "head") -> None:
    """Apply Alembic migrations up to ``revision`` as the owner role."""
    config = Config(str(REPO_ROOT / "alembic.ini"))
    config.set_main_option("script_location", str(REPO_ROOT / "migrations"))
    config.attributes["url"] = settings.admin_database_url
    command.upgrade(config, revision)
