"""The local stack's Postgres roles: an owner that migrates, a service role that does
not own the log, both with passwords, and pg_hba rules that ask for them.

``dsec up`` runs this as the database superuser, either through
``postgres_superuser_url`` or, where that is refused (a fresh Debian trusts nobody on
TCP), through ``runuser -u postgres psql`` on the local socket. A production
deployment makes its roles itself (docs/deploy.md); nothing here runs there.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

from app import secret_files
from app.config import Settings
from app.errors import ConfigError, ServiceUnavailable

OWNER = "dsec_owner"
SERVICE = "dsec_app"
#: The block ``dsec up`` puts first in pg_hba.conf (first match wins).
HBA_MARK = "# dsec: its roles authenticate with passwords (added by `dsec up`)"
HBA_LINES = (
    f"host all {OWNER},{SERVICE} 127.0.0.1/32 scram-sha-256",
    f"host all {OWNER},{SERVICE} ::1/128 scram-sha-256",
    f"local all {OWNER},{SERVICE} scram-sha-256",
)


def password_file(settings: Settings, role: str) -> Path:
    """Where the local stack keeps a role's password."""
    return settings.secrets_dir / f"postgres-{role}.password"


def _roles_sql(owner_pw: str, service_pw: str, database: str) -> list[str]:
    # Passwords are URL-safe tokens (no quotes), made by secret_files.ensure.
    return [
        f"""DO $$ BEGIN
            IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{OWNER}') THEN
                CREATE ROLE {OWNER} LOGIN;
            END IF;
            IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{SERVICE}') THEN
                CREATE ROLE {SERVICE} LOGIN;
            END IF;
        END $$""",
        # The owner may make scratch databases (benchmarks), nothing more.
        f"ALTER ROLE {OWNER} WITH LOGIN NOSUPERUSER CREATEDB NOCREATEROLE NOBYPASSRLS "
        f"PASSWORD '{owner_pw}'",
        f"ALTER ROLE {SERVICE} WITH LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOBYPASSRLS "
        f"PASSWORD '{service_pw}'",
        f"""SELECT 'CREATE DATABASE "{database}" OWNER {OWNER}'
            WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = '{database}')""",
    ]


def _database_sql(database: str) -> list[str]:
    """Run in the dsec database: it and everything in it belongs to the owner."""
    return [
        f'ALTER DATABASE "{database}" OWNER TO {OWNER}',
        f'REVOKE ALL ON DATABASE "{database}" FROM PUBLIC',
        f'GRANT CONNECT, TEMPORARY ON DATABASE "{database}" TO {OWNER}, {SERVICE}',
        f"ALTER SCHEMA public OWNER TO {OWNER}",
        "REVOKE CREATE ON SCHEMA public FROM PUBLIC",
        # Objects an earlier setup made as the superuser change hands.
        f"""DO $$ DECLARE r record; BEGIN
            -- Tables first: a sequence that belongs to a column follows its table.
            FOR r IN SELECT c.relname, c.relkind FROM pg_class c
                     JOIN pg_namespace n ON n.oid = c.relnamespace
                     WHERE n.nspname = 'public' AND c.relkind IN ('r','p','f','v','m')
                       AND pg_get_userbyid(c.relowner) <> '{OWNER}'
                     ORDER BY c.relkind IN ('v','m'), c.relispartition DESC LOOP
                EXECUTE format(
                    'ALTER %s %I OWNER TO {OWNER}',
                    CASE r.relkind WHEN 'v' THEN 'VIEW' WHEN 'm' THEN 'MATERIALIZED VIEW'
                                   ELSE 'TABLE' END,
                    r.relname);
            END LOOP;
            FOR r IN SELECT c.relname FROM pg_class c
                     JOIN pg_namespace n ON n.oid = c.relnamespace
                     WHERE n.nspname = 'public' AND c.relkind = 'S'
                       AND pg_get_userbyid(c.relowner) <> '{OWNER}'
                       AND NOT EXISTS (SELECT FROM pg_depend d WHERE d.objid = c.oid
                                       AND d.deptype IN ('a', 'i')) LOOP
                EXECUTE format('ALTER SEQUENCE %I OWNER TO {OWNER}', r.relname);
            END LOOP;
            FOR r IN SELECT p.oid::regprocedure AS fn FROM pg_proc p
                     JOIN pg_namespace n ON n.oid = p.pronamespace
                     WHERE n.nspname = 'public' AND pg_get_userbyid(p.proowner) <> '{OWNER}' LOOP
                EXECUTE format('ALTER FUNCTION %s OWNER TO {OWNER}', r.fn);
            END LOOP;
        END $$""",
    ]  # fmt: skip


def ensure_roles(settings: Settings) -> None:
    """Make (or bring back in line) the roles, their passwords, the database's owner
    and the pg_hba rules. Idempotent; the superuser is needed every time it changes
    something, and only then."""
    owner_pw = secret_files.ensure(password_file(settings, OWNER), text=True).decode()
    service_pw = secret_files.ensure(password_file(settings, SERVICE), text=True).decode()
    database = str(make_url(settings.admin_database_url).database)
    run = _superuser(settings)
    statements = _roles_sql(owner_pw, service_pw, database)
    # The CREATE DATABASE is produced by a SELECT (it cannot run in a DO block).
    create = run("postgres", statements, produce=True)
    for line in create:
        run("postgres", [line])
    run(database, _database_sql(database))
    hba = run("postgres", ["SHOW hba_file"], produce=True)
    if hba and _ensure_hba(Path(hba[0])):
        run("postgres", ["SELECT pg_reload_conf()"])
    settings.fill_local_passwords()


def _ensure_hba(path: Path) -> bool:
    """Put the password rules first in pg_hba.conf; True if the file changed."""
    try:
        current = path.read_text()
    except OSError as exc:
        raise ServiceUnavailable(f"cannot read {path}: {exc.strerror}") from exc
    block = "\n".join((HBA_MARK, *HBA_LINES)) + "\n"
    if current.startswith(block):
        return False
    kept = current.replace(block, "")
    path.write_text(block + kept)
    return True


class _Run:
    """Runs statements as the superuser in a database; returns what they printed."""

    def __call__(self, database: str, statements: list[str], produce: bool = False) -> list[str]:
        raise NotImplementedError


def _superuser(settings: Settings) -> _Run:
    url = make_url(settings.postgres_superuser_url)
    engine = create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect():
            pass
    except OperationalError:
        if shutil.which("runuser") is None or shutil.which("psql") is None:
            raise ServiceUnavailable(
                f"cannot reach Postgres as its superuser ({url.username}@{url.host}) to make "
                "the dsec roles, and no local psql to try as the postgres user"
            ) from None
        return _Psql()
    finally:
        engine.dispose()
    if url.password is None:
        # Anyone on this host could then do what a superuser does: switch the log's
        # guards off, rewrite credentials, read every tenant's data.
        raise ConfigError(
            f"Postgres at {url.host}:{url.port or 5432} lets {url.username} in without a"
            " password (a trust rule in pg_hba.conf): any local user could then change the"
            " event log and the credentials. Make pg_hba.conf ask for a password"
            " (scram-sha-256) on TCP, or point DSEC_POSTGRES_SUPERUSER_URL at one with a"
            " password; `dsec up` will not set the stack up on it."
        )
    return _Sql(settings.postgres_superuser_url)


class _Sql(_Run):
    def __init__(self, url: str) -> None:
        self.url = url

    def __call__(self, database: str, statements: list[str], produce: bool = False) -> list[str]:
        engine = create_engine(
            make_url(self.url).set(database=database), isolation_level="AUTOCOMMIT"
        )
        out: list[str] = []
        try:
            with engine.connect() as conn:
                for sql in statements:
                    result = conn.execute(text(sql))
                    if produce and result.returns_rows:
                        out.extend(str(row[0]) for row in result)
        finally:
            engine.dispose()
        return out


class _Psql(_Run):
    def __call__(self, database: str, statements: list[str], produce: bool = False) -> list[str]:
        script = "".join(f"{sql};\n" for sql in statements)
        done = subprocess.run(
            ["runuser", "-u", "postgres", "--", "psql", "-X", "-q", "-At", "-v", "ON_ERROR_STOP=1",
             "-d", database, "-f", "-"],
            input=script, capture_output=True, text=True, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise ServiceUnavailable(f"psql as postgres failed: {done.stderr.strip()[:500]}")
        return [line for line in done.stdout.splitlines() if line.strip()] if produce else []
