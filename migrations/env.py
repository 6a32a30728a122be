"""Alembic environment: runs migrations as the owner role from the settings."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from app.config import get_settings
from app.db.tables import metadata

config = context.config
url = config.attributes.get("url") or get_settings().admin_database_url


def run_migrations_offline() -> None:
    context.configure(url=url, target_metadata=metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = create_engine(url)
    with engine.connect() as connection:
        context.configure(connection=connection, target_metadata=metadata)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
