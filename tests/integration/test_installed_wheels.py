"""Both distributions, tested as installed: built from this checkout (sdist, then the
wheel from the sdist, as `make dist` does), each installed into a fresh venv outside
the checkout, run with no source tree on the path.

- The SDK's venv holds no server package and drives a sandbox through the stack.
- The server's venv answers ``dsec --version`` and brings a scratch database to the
  schema's head from the migrations its wheel carries.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic.script import ScriptDirectory
from sqlalchemy import text
from sqlalchemy.engine import make_url

import app
from app import credentials
from app.config import Settings
from app.db.engine import engine_for, transaction
from app.db.setup import drop_database
from tests.conftest import ensure_tenant, forget_tenant

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
#: What a trainer's venv must not hold: the server's rooms and its drivers.
SERVER_ONLY = (
    "app.control", "app.db", "app.stack", "app.cli", "app.taskqueue", "workers",
    "celery", "sqlalchemy", "alembic", "psycopg", "redis", "podman", "prometheus_client",
)  # fmt: skip


def _clean_env(**extra: str) -> dict[str, str]:
    """This environment (its DSEC_* settings) without any path into the checkout."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, **extra}


def _run(argv: list[str], cwd: Path, **extra: str) -> str:
    done = subprocess.run(
        argv, cwd=cwd, env=_clean_env(**extra), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"{argv}: {done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return done.stdout


def _clean_copy(where: Path) -> Path:
    """The checkout's tracked files (as they are now) copied to ``where``: what a clean
    clone builds from. setuptools also lists what an earlier build's egg-info named, so
    a build from the working tree can pass on a file its own manifest leaves out."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True)
    for name in filter(None, listed.stdout.decode().split("\0")):
        source, target = REPO / name, where / name
        if not source.is_symlink() and not source.exists():
            continue  # deleted in the working tree, not yet committed
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            target.symlink_to(os.readlink(source))
        else:
            shutil.copy2(source, target)
    return where


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The two wheels, each built from its sdist, from a clean copy of the checkout."""
    out = tmp_path_factory.mktemp("dist")
    tree = _clean_copy(tmp_path_factory.mktemp("checkout"))
    for source in (tree / "sdk", tree):
        _run([sys.executable, "-m", "build", "--outdir", str(out), str(source)], cwd=out)
    found = {p.name.split("-")[0]: p for p in out.glob("*.whl")}
    assert set(found) == {"dsec", "dsec_sdk"}, sorted(out.iterdir())
    # Both install into one ``app`` package: neither wheel may hold a file of the other
    held = {name: set(zipfile.ZipFile(path).namelist()) for name, path in found.items()}
    both = {f for f in held["dsec"] & held["dsec_sdk"] if not f.startswith("dsec")}
    assert both == set()
    assert {p.name for p in out.glob("*.tar.gz")} == {
        f"dsec-{app.__version__}.tar.gz",
        f"dsec_sdk-{app.__version__}.tar.gz",
    }
    return found


def _venv(where: Path, *wheel_files: Path) -> Path:
    """A fresh venv at ``where`` with ``wheel_files`` installed (and what they depend
    on, from the package index); its bin directory. This venv's pip installs there: a
    venv of its own would first install pip, for nothing."""
    _run([sys.executable, "-m", "venv", "--without-pip", str(where)], cwd=where.parent)
    pip = [sys.executable, "-m", "pip", "--python", str(where / "bin" / "python")]
    constraints = ["--constraint", str(REPO / "constraints.txt")]
    _run([*pip, "install", "-q", "--no-compile", *constraints, *map(str, wheel_files)],
         cwd=where.parent)  # fmt: skip
    return where / "bin"


@pytest.fixture
def outside(tmp_path: Path) -> Iterator[Path]:
    """A working directory outside the checkout."""
    assert REPO not in tmp_path.parents
    yield tmp_path


def test_the_sdk_installs_alone_and_drives_a_sandbox(
    stack: Settings, wheels: dict[str, Path], outside: Path
) -> None:
    # Given a venv with nothing but the SDK's wheel (and what it depends on)
    bin_dir = _venv(outside / "sdk-venv", wheels["dsec_sdk"])
    tenant = f"wheel-{uuid.uuid4().hex[:6]}"
    ensure_tenant(stack, tenant)
    script = textwrap.dedent(
        f"""
        import importlib.util, json

        import app.sdk
        from app.sdk import Client

        server = [m for m in {SERVER_ONLY!r} if importlib.util.find_spec(m) is not None]
        with Client(job_id="installed-wheel") as client:
            with client.create(ttl_s=120) as sandbox:
                result = sandbox.exec("echo from an installed sdk")
        print(json.dumps({{
            "server": server, "sdk": app.sdk.__file__, "speaks": list(app.sdk.PROTOCOL_VERSIONS),
            "exit": result.exit_code, "text": result.text,
        }}))
        """
    )
    # When a trainer's script runs there, signing with a credential file
    try:
        out = _run(
            [str(bin_dir / "python"), "-c", script],
            cwd=outside,
            DSEC_CREDENTIALS=str(credentials.tenant_file(stack, tenant)),
        )
    finally:
        forget_tenant(stack, tenant)
    seen = json.loads(out.strip().splitlines()[-1])
    # Then no server package is importable, the SDK is the venv's, and the command ran
    assert seen["server"] == []
    assert seen["sdk"].startswith(str(outside / "sdk-venv"))
    assert seen["speaks"] == [1]
    assert (seen["exit"], seen["text"]) == (0, "from an installed sdk\n")


def test_the_server_wheel_runs_its_cli_and_migrations(
    stack: Settings, wheels: dict[str, Path], outside: Path
) -> None:
    # Given a venv with both wheels (the server depends on that very SDK)
    bin_dir = _venv(outside / "server-venv", wheels["dsec_sdk"], wheels["dsec"])
    version = _run([str(bin_dir / "dsec"), "--version"], cwd=outside)
    assert version.strip() == f"dsec {app.__version__} (wire protocol 1)"
    url = make_url(stack.admin_database_url)
    scratch = stack.model_copy(update={"admin_database_url": url.set(
        database=f"{url.database}_wheel{uuid.uuid4().hex[:6]}"
    ).render_as_string(hide_password=False)})  # fmt: skip
    try:
        # When its CLI makes and migrates a database, from the migrations its wheel carries
        said = _run(
            [str(bin_dir / "dsec"), "migrate"],
            cwd=outside,
            DSEC_ADMIN_DATABASE_URL=scratch.admin_database_url,
        )
        # Then they came from the installed package, not this checkout, up to the head
        assert str(outside / "server-venv") in said and "app/db/migrations" in said, said
        with transaction(scratch.admin_database_url) as conn:
            head = conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
            log = conn.execute(text("SELECT to_regclass('events')")).scalar()
        assert head == ScriptDirectory(str(REPO / "migrations")).get_current_head()
        assert log is not None
    finally:
        engine_for(scratch.admin_database_url).dispose()
        drop_database(scratch)
