"""Shared fixtures: the embedded stack, started once per session and reused.

A service that cannot be brought up fails the session with a message naming it;
nothing is skipped silently.
"""

from __future__ import annotations

import contextlib
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Connection, text

from app.config import Settings, get_settings
from app.db.engine import transaction
from workers.containers.limits import CgroupLimiter


@pytest.fixture(scope="session")
def settings() -> Settings:
    return get_settings()


@pytest.fixture(scope="session")
def stack(settings: Settings) -> Iterator[Settings]:
    """The embedded stack, up (idempotent: reuses what `make test` started).

    The suite leaves the stack's log and projections as it found them: when the
    session ends, `dsec doctor`'s checks run again, and what they find that they did
    not find at the start (a life the suite left open past its deadline or ended
    twice, a lost node it left with open lives) fails the session, as does any
    projection that differs from a rebuild from the log. That one is checked at the
    end only: a rebuild folds the whole log in this process (~25 s on a development
    stack that ran the suite for days), and projections that differ from it are broken
    whoever broke them (`dsec projections rebuild` mends them)."""
    from app.stack import services as stack_mod

    try:
        stack_mod.up(settings, log=lambda _m: None)
    except Exception as exc:  # name the service in the failure, never skip
        pytest.fail(f"the embedded stack is not available: {exc}", pytrace=False)
    ensure_tenant(settings, "tests")  # the tenant the suite's own clients sign as
    began = datetime.now(UTC)
    before = {f.key for f in _broken_lives(settings, began, with_rebuild=False)}
    yield settings
    left = [f for f in _broken_lives(settings, began) if f.key not in before]
    if left:
        listed = "\n".join(f"  {f.check.value} {f.subject}: {f.detail}" for f in left[:20])
        pytest.fail(f"the suite left {len(left)} broken lives (`dsec doctor`):\n{listed}",
                    pytrace=False)  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def side_nodes_stopped(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each integration module, the processes of node users whose worker the
    stack does not run are killed: a side node's Podman service and containers, left
    running, cost every later test CPU (four of them took ~2 % of a core doing
    nothing). Unit modules leave them alone: a unit run beside an integration run
    killed the side node that one of its tests was using."""
    yield
    if request.node.get_closest_marker("integration") is None:
        return
    import pwd
    import subprocess

    from app.stack.services import known_node_ids
    from workers.host.user import USER_PREFIX, user_name

    kept = {user_name(node) for node in known_node_ids(get_settings())}
    for entry in pwd.getpwall():
        if entry.pw_name.startswith(USER_PREFIX) and entry.pw_name not in kept:
            subprocess.run(["pkill", "-KILL", "-u", entry.pw_name], capture_output=True)


def _broken_lives(settings: Settings, since: datetime, *, with_rebuild: bool = True) -> list[Any]:
    """What `dsec doctor` finds on the stack (lives ended twice: since ``since``)."""
    from app.db import doctor

    return doctor.examine(
        settings, since - timedelta(minutes=1), timedelta(seconds=60), with_rebuild=with_rebuild
    )


@pytest.fixture(scope="session")
def limiter(stack: Settings) -> CgroupLimiter:
    """The node's cgroup limiter, as its worker uses it."""
    found = CgroupLimiter.detect(stack.node_id)
    if found is None:
        pytest.fail("no usable cgroup hierarchy on this host", pytrace=False)
    return found


def ensure_tenant(settings: Settings, name: str, role: str = "tenant") -> Any:
    """A tenant (or operator) with a local credential; returns the credential."""
    from app.control import tenants
    from app.domain.proof import Role

    return tenants.local(settings, name, Role(role))


def forget_tenant(settings: Settings, name: str) -> None:
    """Revoke a test's throwaway tenant and delete its replies topic: a stack that ran
    the suite again and again does not carry 16 partitions per run for nobody."""
    from app import kafka_admin
    from app.control import tenants

    tenants.revoke(settings, name)
    kafka_admin.drop_topics(settings, [settings.replies_topic(name)])


@contextlib.contextmanager
def tenant_client(settings: Settings, name: str, job_id: str) -> Iterator[Any]:
    """An SDK client signing as tenant ``name`` (made if missing), closed after."""
    from app.sdk import Client

    ensure_tenant(settings, name)
    with Client(settings, tenant=name, job_id=job_id) as c:
        yield c


@pytest.fixture(scope="session")
def client(stack: Settings) -> Iterator[Any]:
    from app.sdk import Client

    ensure_tenant(stack, "tests")
    job = f"tests-{uuid.uuid4().hex[:6]}"
    with Client(stack, tenant="tests", job_id=job) as c:
        yield c
        # A test that failed half-way left its sandboxes running: the next run's
        # placement and every idle figure would carry them for good.
        with transaction(stack.database_url) as conn:
            left = conn.scalars(
                text(
                    "SELECT sandbox_id FROM sandboxes WHERE job_id = :j"
                    " AND state NOT IN ('stopped', 'failed', 'rejected')"
                ),
                {"j": job},
            ).all()
        for sandbox_id in left:
            with contextlib.suppress(Exception):
                c.sandbox(sandbox_id).close(timeout_s=30)


class PlatformPublisher:
    """A publisher that proves what it sends as the platform would: an event by its
    node's key (node-only events) or the scheduler's; anything else goes unsigned."""

    def __init__(self, settings: Settings) -> None:
        from app import bus
        from app.control.keyring import Keyring

        self.settings = settings
        self._publisher = bus.Publisher(settings)
        self._scheduler = Keyring.from_settings(settings).scheduler

    def publish(
        self, topic: str, key: str, message: Any, *, wait: bool = False,
        partition: int | None = None,
    ) -> None:  # fmt: skip
        from app import credentials
        from app.domain.codec import encode
        from app.domain.proof import Purpose, headers
        from app.domain.trust import NODE_ONLY_EVENTS

        value = message if isinstance(message, bytes) else encode(message)
        proof = None
        if topic == self.settings.topic_events:
            kind = getattr(message, "type", None)
            if kind in NODE_ONLY_EVENTS:
                cred = credentials.load(credentials.node_file(self.settings, message.node_id))
                key_id, secret = cred.key_id, cred.secret
            else:
                key_id, secret = self._scheduler.principal.key_id, self._scheduler.secret
            proof = headers(Purpose.EVENT, key_id, secret, value)
        self._publisher.publish(topic, key, value, wait=wait, partition=partition, headers=proof)

    def flush(self) -> None:
        self._publisher.flush()

    def close(self) -> None:
        self._publisher.close()


@pytest.fixture
def db(stack: Settings) -> Callable[[], Any]:
    """Open a transaction as the service role: ``with db() as conn``."""
    return lambda: transaction(stack.database_url)


@pytest.fixture(scope="session")
def migrated() -> Settings:
    """Postgres with the schema at head; nothing else of the stack."""
    from app.db.setup import ensure_database, migrate

    settings = get_settings()
    try:
        ensure_database(settings)
        migrate(settings)
    except Exception as exc:  # name the service, never skip
        pytest.fail(
            f"Postgres at {settings.admin_database_url} is not usable: {exc}", pytrace=False
        )
    return settings


def _renamed(url: str, suffix: str) -> str:
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    return parsed.set(database=f"{parsed.database}{suffix}").render_as_string(hide_password=False)


@contextlib.contextmanager
def scratch_database(base: Settings, *, credentials: bool = False) -> Iterator[Settings]:
    """``base``'s settings on a database of their own at the schema's head (holding
    ``base``'s credentials, if asked: the same keys then prove the same senders),
    dropped after: what a test writes there never reaches the stack's log."""
    from sqlalchemy import insert, select

    from app.db import tables
    from app.db.engine import engine_for
    from app.db.setup import ensure_database, migrate

    suffix = f"_scratch{uuid.uuid4().hex[:6]}"
    settings = base.model_copy(
        update={
            "database_url": _renamed(base.database_url, suffix),
            "admin_database_url": _renamed(base.admin_database_url, suffix),
        }
    )
    ensure_database(settings)
    try:
        migrate(settings)
        if credentials:
            with transaction(base.admin_database_url) as conn:
                rows = [dict(r._mapping) for r in conn.execute(select(tables.credentials))]
            if rows:
                with transaction(settings.admin_database_url) as conn:
                    conn.execute(insert(tables.credentials), rows)
        yield settings
    finally:
        engine_for(settings.database_url).dispose()
        engine_for(settings.admin_database_url).dispose()
        _drop(settings)


def _drop(settings: Settings) -> None:
    from app.db.setup import drop_database

    drop_database(settings)


@contextlib.contextmanager
def rolled_back(settings: Settings) -> Iterator[Connection]:
    """A service-role connection in a transaction that is always rolled back."""
    from app.db.engine import engine_for

    with engine_for(settings.database_url).connect() as c:
        tx = c.begin()
        try:
            yield c
        finally:
            tx.rollback()


@pytest.fixture
def conn(migrated: Settings) -> Iterator[Connection]:
    """A service-role connection in a transaction that is always rolled back: what a
    test appends to the log or folds into the projections is gone after it."""
    with rolled_back(migrated) as c:
        yield c


def wait_for(check: Callable[[], Any], timeout_s: float = 20.0, what: str = "condition") -> Any:
    """Poll until ``check`` returns something truthy; fail naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    pytest.fail(f"timed out after {timeout_s}s waiting for {what}")


def scalar(conn: Connection, sql: str, **params: Any) -> Any:
    """One value from SQL."""
    return conn.execute(text(sql), params).scalar()


def logged(db: Callable[[], Any], sandbox_id: str, field: str, *types: str) -> list[Any]:
    """``payload->>field`` of each of the sandbox's events of ``types``, in log order."""
    with db() as conn:
        query = text(
            "SELECT payload->>:f FROM events WHERE sandbox_id = :s AND type = ANY(:t)"
            " ORDER BY position"
        )
        return list(conn.execute(query, {"f": field, "s": sandbox_id, "t": list(types)}).scalars())


def live_and_rebuilt(settings: Settings) -> tuple[set[Any], set[Any]]:
    """Every projection row as it stands, and as a rebuild from the log makes it (in a
    transaction rolled back after, so nothing changes)."""
    from app.db import doctor

    found = doctor.check_rebuild(settings.database_url)
    return set(found.live), set(found.rebuilt)


def free_port() -> int:
    """A TCP port nothing listens on now (for a service a test starts itself)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_node(db: Callable[[], Any], node_id: str, state: str, timeout_s: float) -> None:
    """Wait until the ``nodes`` projection shows ``node_id`` in ``state``."""
    with db() as conn:
        wait_for(
            lambda: scalar(
                conn,
                "SELECT state FROM nodes WHERE node_id = :n AND state = :s",
                n=node_id,
                s=state,
            ),
            timeout_s=timeout_s,
            what=f"{node_id} {state} in the log",
        )


def flower_workers(base_url: str, password: str) -> dict[str, Any]:
    """The workers Flower at ``base_url`` knows ({} while it does not answer)."""
    import json
    import urllib.request
    from base64 import b64encode

    from app.stack.services import FLOWER_USER

    token = b64encode(f"{FLOWER_USER}:{password}".encode()).decode()
    request = urllib.request.Request(
        f"{base_url}/api/workers?refresh=1", headers={"Authorization": f"Basic {token}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return dict(json.load(response))
    except OSError:
        return {}


def declare_lost(settings: Settings, node_ids: list[str]) -> None:
    """Append NodeLost for nodes the tests stopped, so that later tests (and the next
    `make test`) place sandboxes on the configured node only."""
    from app.domain.events import NodeLost, NodeLostPayload

    publisher = PlatformPublisher(settings)
    for node in node_ids:
        lost = NodeLost(node_id=node, payload=NodeLostPayload(detail="stopped by the tests"))
        publisher.publish(settings.topic_events, lost.key, lost)
    publisher.flush()
    publisher.close()
    time.sleep(1.0)
