"""The local stack is not open to every local user: passwords on Postgres and Redis,
Flower behind authentication, secrets in root-only files, none of them printed; and
the service role can neither change nor switch off the log's guards."""

from __future__ import annotations

import json
import os
import stat
import urllib.error
import urllib.request
from base64 import b64encode
from pathlib import Path

import pytest
import redis
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, OperationalError
from typer.testing import CliRunner

from app.cli.main import cli
from app.config import Settings
from app.stack import services as stack_mod

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    "statement",
    [
        "ALTER TABLE events DISABLE TRIGGER ALL",
        "ALTER TABLE events DISABLE TRIGGER events_no_update_delete",
        "DROP TRIGGER events_no_truncate ON events",
        "CREATE OR REPLACE FUNCTION dsec_refuse_change() RETURNS trigger"
        " LANGUAGE plpgsql AS $$ BEGIN RETURN NEW; END $$",
        "ALTER TABLE events RENAME TO events_gone",
        "SET session_replication_role = replica",
        "ALTER ROLE dsec_app SUPERUSER",
    ],
)
def test_the_service_role_cannot_switch_the_guards_off(stack: Settings, statement: str) -> None:
    engine = create_engine(stack.database_url)
    try:
        with (
            pytest.raises(DBAPIError, match=r"must be|permission denied|owner"),
            engine.begin() as c,
        ):
            c.execute(text(statement))
    finally:
        engine.dispose()


@pytest.mark.parametrize("which", ["database_url", "admin_database_url"])
def test_the_dsec_roles_need_their_passwords(stack: Settings, which: str) -> None:
    url = make_url(getattr(stack, which))
    assert url.password, "the stack's roles have passwords"
    for wrong in (None, "not-the-password"):
        # (URL.set(password=None) keeps the password: replace the field itself)
        engine = create_engine(url._replace(password=wrong))
        try:
            with pytest.raises(OperationalError, match="password"), engine.connect():
                pass
        finally:
            engine.dispose()


def test_redis_wants_its_password(stack: Settings) -> None:
    url = make_url(stack.celery_broker_url.replace("redis://", "postgresql://", 1))
    anonymous = redis.Redis(host=url.host, port=url.port)
    with pytest.raises(redis.AuthenticationError):
        anonymous.ping()
    assert redis.Redis.from_url(stack.celery_broker_url).ping()


def test_flower_wants_its_password(stack: Settings) -> None:
    url = f"http://127.0.0.1:{stack.flower_port}/api/workers"
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(url, timeout=10)
    assert refused.value.code == 401
    token = b64encode(f"{stack_mod.FLOWER_USER}:{stack_mod.flower_password(stack)}".encode())
    request = urllib.request.Request(url, headers={"Authorization": f"Basic {token.decode()}"})
    with urllib.request.urlopen(request, timeout=10) as answered:
        assert answered.status == 200


def test_secrets_are_root_only(stack: Settings) -> None:
    found = [p for p in stack.secrets_dir.rglob("*")]
    assert any(p.name == "master.key" for p in found)
    assert len([p for p in found if p.suffix == ".password"]) >= 4
    for path in [stack.secrets_dir, *found, stack.state_dir / "redis" / "redis.conf"]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert path.stat().st_uid == 0, path
        assert mode & 0o077 == 0, f"{path} is {oct(mode)}"


def test_no_secret_is_printed_or_on_a_command_line(stack: Settings) -> None:
    secrets = [
        p.read_text().strip()
        for p in stack.secrets_dir.rglob("*")
        if p.is_file() and p.suffix in (".password", ".key")
    ]
    status = CliRunner().invoke(cli, ["status", "--json"])
    assert status.exit_code == 0
    assert not [s for s in secrets if s in status.stdout]
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        assert not [s for s in secrets if s in cmdline], f"a secret on the command line of {pid}"
    assert json.loads(status.stdout)


def test_a_postgres_that_trusts_its_superuser_is_refused(stack: Settings) -> None:
    from app.db.roles import ensure_roles
    from app.errors import ConfigError
    from tests.pg_cluster import own_cluster

    # Given a Postgres that lets its superuser in over TCP without a password (as the
    # machines this project ran on once shipped one)
    with own_cluster(trust="127.0.0.1/32") as pg:
        settings = stack.model_copy(
            update={
                "postgres_superuser_url": pg.url("postgres", "postgres"),
                "admin_database_url": pg.url("dsec_owner", "dsec"),
                "database_url": pg.url("dsec_app", "dsec"),
            }
        )
        # When the stack is set up on it, Then it refuses, and says why
        with pytest.raises(ConfigError, match="without a password"):
            ensure_roles(settings)
