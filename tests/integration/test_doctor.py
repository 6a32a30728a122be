"""`dsec doctor` finds what breaks the invariants of lives, and nothing on a sound log
(issue 28). Each case writes a log of its own into a scratch database: the stack's log
and projections are left as they were."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, text

from app.config import Settings
from app.db import doctor, projections
from app.db.engine import engine_for
from app.db.log import SourcedEvent, append_and_project
from app.domain.base import StopReason, utcnow
from app.domain.events import (
    CommandCompleted,
    CommandPayload,
    EventBase,
    NodeLost,
    NodeLostPayload,
    NodePayload,
    NodeRegistered,
    RequestedPayload,
    SandboxRequested,
    SandboxScheduled,
    SandboxStarted,
    SandboxStopped,
    ScheduledPayload,
    StartedPayload,
    StoppedPayload,
)
from tests.conftest import scratch_database, wait_for

pytestmark = pytest.mark.integration

GRACE = timedelta(seconds=60)


@pytest.fixture
def scratch(migrated: Settings) -> Iterator[Settings]:
    with scratch_database(migrated) as settings:
        yield settings


class Log:
    """Appends events as the projector does (no admission rules: what an older platform,
    or a broken one, could have left)."""

    def __init__(self, conn: Connection) -> None:
        self.conn, self.topic_id, self.offset = conn, uuid.uuid4(), 0

    def add(self, *events: EventBase) -> None:
        items = []
        for event in events:
            items.append(SourcedEvent(event, "test.doctor", self.topic_id, 0, self.offset))  # type: ignore[arg-type]
            self.offset += 1
        append_and_project(self.conn, items)

    def placed(self, sandbox_id: str, node: str, at: datetime) -> None:
        rid = uuid.uuid4()
        self.add(
            SandboxRequested(
                sandbox_id=sandbox_id, tenant="acme", occurred_at=at,
                payload=RequestedPayload(request_id=rid, actor="acme/k", image="img", cpus=1,
                                         memory_mb=64, disk_mb=64, ttl_s=3600, network=False),
            ),
            SandboxScheduled(
                sandbox_id=sandbox_id, node_id=node, tenant="acme", occurred_at=at,
                payload=ScheduledPayload(request_id=rid, node_id=node),
            ),
        )  # fmt: skip

    def started(self, sandbox_id: str, node: str, at: datetime) -> None:
        self.add(
            SandboxStarted(
                sandbox_id=sandbox_id, node_id=node, tenant="acme", occurred_at=at,
                payload=StartedPayload(request_id=uuid.uuid4(), container_id="c"),
            )
        )  # fmt: skip

    def stopped(self, sandbox_id: str, reason: StopReason, at: datetime) -> None:
        self.add(
            SandboxStopped(
                sandbox_id=sandbox_id, tenant="acme", occurred_at=at,
                payload=StoppedPayload(reason=reason),
            )
        )  # fmt: skip


def _keys(found: list[doctor.Finding]) -> set[tuple[str, str]]:
    return {f.key for f in found}


def test_a_sound_log_has_nothing_to_report(scratch: Settings) -> None:
    now = utcnow()
    with engine_for(scratch.database_url).begin() as conn:
        log = Log(conn)
        log.placed("sb-fine", "n0", now - timedelta(minutes=10))
        log.started("sb-fine", "n0", now - timedelta(minutes=10))
        log.placed("sb-done", "n0", now - timedelta(hours=2))
        log.started("sb-done", "n0", now - timedelta(hours=2))
        log.stopped("sb-done", StopReason.DESTROYED, now - timedelta(hours=1))
    assert doctor.examine(scratch, now - timedelta(days=1), GRACE) == []


def test_each_broken_invariant_is_found(scratch: Settings) -> None:
    now = utcnow()
    payload = NodePayload(capacity_sandboxes=4, capacity_cpus=4, capacity_memory_mb=4096,
                          queue="node.n-gone")  # fmt: skip
    with engine_for(scratch.database_url).begin() as conn:
        log = Log(conn)
        # Given a placement whose create was lost an hour ago
        log.placed("sb-create-lost", "n0", now - timedelta(hours=1))
        # And a life ended twice (the reconciler's race with a destroy)
        log.placed("sb-twice", "n0", now - timedelta(hours=1))
        log.started("sb-twice", "n0", now - timedelta(hours=1))
        log.stopped("sb-twice", StopReason.FAILED, now - timedelta(minutes=50))
        log.stopped("sb-twice", StopReason.DESTROYED, now - timedelta(minutes=50))
        # And a node declared lost ten minutes ago with a life still open on it
        log.add(NodeRegistered(node_id="n-gone", occurred_at=now - timedelta(hours=1),
                               payload=payload))  # fmt: skip
        log.placed("sb-left", "n-gone", now - timedelta(minutes=30))
        log.started("sb-left", "n-gone", now - timedelta(minutes=30))
        log.add(NodeLost(node_id="n-gone", occurred_at=now - timedelta(minutes=10),
                         payload=NodeLostPayload(detail="silent")))  # fmt: skip
        # And a running life past its TTL (an hour) by far
        log.placed("sb-old", "n0", now - timedelta(hours=3))
        log.started("sb-old", "n0", now - timedelta(hours=3))
    # When the doctor looks
    found = doctor.examine(scratch, now - timedelta(days=1), GRACE)
    # Then it names each, and only those
    assert _keys(found) == {
        ("overdue", "sb-create-lost"),
        ("ended_twice", "sb-twice"),
        ("overdue", "sb-left"),
        ("lost_node_open", "n-gone"),
        ("overdue", "sb-old"),
    }
    reasons = {f.subject: f.detail for f in found if f.check == doctor.Check.OVERDUE}
    assert "create_lost" in reasons["sb-create-lost"]
    assert "node_lost" in reasons["sb-left"] and "ttl" in reasons["sb-old"]
    # And the command says so, exit 1, as a table or as JSON
    run = _dsec(scratch, "doctor", "--json", "--skip-rebuild")
    assert run.returncode == 1, run.stderr
    assert {(r["check"], r["subject"]) for r in _json(run.stdout)} == _keys(found)


def test_projections_that_differ_from_a_rebuild_are_found(scratch: Settings) -> None:
    now = utcnow()
    with engine_for(scratch.database_url).begin() as conn:
        log = Log(conn)
        log.placed("sb-1", "n0", now - timedelta(minutes=5))
        log.started("sb-1", "n0", now - timedelta(minutes=5))
    # When a projection row is changed behind the log's back (as the owner could)
    with engine_for(scratch.admin_database_url).begin() as conn:
        conn.exec_driver_sql("UPDATE sandboxes SET commands = 42 WHERE sandbox_id = 'sb-1'")
    found = doctor.examine(scratch, now - timedelta(days=1), GRACE)
    assert [(f.check, f.subject) for f in found] == [(doctor.Check.REBUILD_DIFFERS, "sandboxes")]
    assert _dsec(scratch, "doctor").returncode == 1


def _dsec(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "DSEC_DATABASE_URL": settings.database_url,
        "DSEC_ADMIN_DATABASE_URL": settings.admin_database_url,
    }
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args], env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip


def _json(text: str) -> list[dict[str, Any]]:
    import json

    return list(json.loads(text))


def test_a_doctor_run_beside_a_folding_projector_waits_and_neither_deadlocks(
    scratch: Settings,
) -> None:
    now = utcnow()
    payload = NodePayload(capacity_sandboxes=4, capacity_cpus=4, capacity_memory_mb=4096,
                          queue="node.n-busy")  # fmt: skip
    engine = engine_for(scratch.database_url)
    with ThreadPoolExecutor(1) as pool, engine.connect() as conn, conn.begin():
        log = Log(conn)
        # Given a projector mid-batch that has written a late table of the lock order
        # (a node's row) but not yet an early one (a sandbox's)
        log.add(NodeRegistered(node_id="n-busy", occurred_at=now, payload=payload))
        # When the doctor's rebuild check starts meanwhile and waits for its locks
        checked = pool.submit(doctor.check_rebuild, scratch.database_url)
        wait_for(lambda: _waiting_for_a_lock(engine), 10, "the doctor waiting for its locks")
        # Then the projector finishes its batch (a deadlock would abort one of them)
        log.placed("sb-busy", "n-busy", now)
    # And the doctor, which waited, finds the projections equal to a rebuild
    assert checked.result(timeout=30).differing == frozenset()


def test_a_projector_appending_a_command_beside_a_doctor_locking_waits_and_neither_deadlocks(
    scratch: Settings,
) -> None:
    """The append writes the commands projection in its own statement: taken before the
    projector's ordered locks, that table deadlocked with a doctor holding the early ones."""
    now = utcnow()
    engine = engine_for(scratch.database_url)
    done = CommandCompleted(
        sandbox_id="sb-cmd", node_id="n0", tenant="acme", occurred_at=now,
        payload=CommandPayload(request_id=uuid.uuid4(), actor="acme/k", command="true",
                               exit_code=0, duration_ms=1.0, stdout_bytes=0, stderr_bytes=0),
    )  # fmt: skip

    def project() -> None:
        with engine.begin() as conn:
            Log(conn).add(done)

    with ThreadPoolExecutor(1) as pool, engine.connect() as doctor_conn, doctor_conn.begin():
        # Given a doctor that holds the first table of the lock order
        doctor_conn.exec_driver_sql("LOCK TABLE sandboxes IN SHARE ROW EXCLUSIVE MODE")
        # When a projector appends a command meanwhile and waits
        projected = pool.submit(project)
        wait_for(lambda: _waiting_for_a_lock(engine), 10, "the projector waiting for its locks")
        # Then the doctor takes the rest of its locks (a deadlock would abort one of them)
        projections.lock(doctor_conn)
    # And the projector, which waited, projects the command
    projected.result(timeout=30)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM commands")).scalar() == 1


def _waiting_for_a_lock(engine: Engine) -> bool:
    with engine.connect() as conn:
        return bool(
            conn.execute(
                text(
                    "SELECT count(*) FROM pg_locks WHERE NOT granted AND database ="
                    " (SELECT oid FROM pg_database WHERE datname = current_database())"
                )
            ).scalar()
        )
