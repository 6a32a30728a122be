"""The audit and billing views against figures computed by hand.

Events are appended straight into ``events`` as the service role and folded into the
projections by the projector's own code, inside a transaction that is rolled back at
the end of each test: the append-only log keeps nothing, and a fresh tenant per test
keeps other data out of the figures. Only Postgres is needed.

``billing_daily`` and ``sandbox_lives`` read the rollups; after every test the same
figures are read from the raw log's views (``*_from_log``) and must agree to the
millisecond, on every case here: midnight, skew, running sandboxes, reused and
refused ids.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from rich.console import Console
from sqlalchemy import Connection, text
from typer.testing import CliRunner

from app.config import Settings
from app.db import billing, projections, queries
from app.db.log import SourcedEvent, append
from app.domain.base import FailReason, RejectReason, StopReason
from app.domain.events import (
    CommandCompleted,
    CommandPayload,
    Event,
    FailedPayload,
    FilePayload,
    FileRead,
    FileWritten,
    RejectedPayload,
    RequestedPayload,
    SandboxFailed,
    SandboxRejected,
    SandboxRequested,
    SandboxScheduled,
    SandboxStarted,
    SandboxStopped,
    ScheduledPayload,
    StartedPayload,
    StoppedPayload,
)
from tests.conftest import rolled_back, scratch_database

pytestmark = pytest.mark.integration

DAY = date(2025, 3, 14)
NEXT_DAY = DAY + timedelta(days=1)


def at(day: date, hh: int, mm: int = 0) -> datetime:
    """An instant on a UTC day."""
    return datetime(day.year, day.month, day.day, hh, mm, tzinfo=UTC)


class Log:
    """Appends hand-made events for one tenant, from a private topic incarnation."""

    def __init__(self, conn: Connection, tenant: str | None = None) -> None:
        self.conn = conn
        self.tenant = tenant or f"t-{uuid.uuid4().hex[:10]}"
        self.topic_id = uuid.uuid4()
        self.offset = 0

    def add(self, event: Event) -> None:
        self.add_batch([event])

    def add_batch(self, batch: Sequence[Event]) -> None:
        """Append and project ``batch`` as the projector does one batch."""
        sourced = []
        for event in batch:
            sourced.append(SourcedEvent(event, "test.billing", self.topic_id, 0, self.offset))
            self.offset += 1
        appended = append(self.conn, sourced)
        projections.apply_batch(self.conn, [(item.event, pos) for item, pos in appended])

    def env(self, sandbox_id: str, job_id: str, when: datetime, node: str | None = None) -> Any:
        return {
            "sandbox_id": sandbox_id,
            "tenant": self.tenant,
            "job_id": job_id,
            "occurred_at": when,
            "node_id": node,
        }

    def requested(
        self, sb: str, job: str, when: datetime, cpus: float = 2, memory_mb: int = 1024
    ) -> None:
        payload = RequestedPayload(
            request_id=uuid.uuid4(),
            actor="alice",
            image="dsec/busybox:latest",
            cpus=cpus,
            memory_mb=memory_mb,
            disk_mb=512,
            ttl_s=86400,
            network=False,
        )
        self.add(SandboxRequested(**self.env(sb, job, when), payload=payload))

    def command(
        self,
        sb: str,
        job: str,
        when: datetime,
        command: str | list[str] = "true",
        exit_code: int = 0,
        actor: str = "alice",
        stderr: str = "",
        node: str = "node-t",
    ) -> None:
        payload = CommandPayload(
            request_id=uuid.uuid4(),
            actor=actor,
            command=command,
            exit_code=exit_code,
            duration_ms=5.0,
            stdout_bytes=0,
            stderr_bytes=len(stderr),
            stderr_head=stderr,
        )
        self.add(CommandCompleted(**self.env(sb, job, when, node), payload=payload))

    def life(
        self,
        job: str,
        start: datetime,
        end: datetime | None,
        *,
        cpus: float = 2,
        memory_mb: int = 1024,
        commands: Sequence[datetime] = (),
        reason: StopReason = StopReason.DESTROYED,
    ) -> str:
        """Requested, Scheduled, Started at ``start``, commands, Stopped at ``end``."""
        sb = f"sb-{uuid.uuid4().hex[:12]}"
        rid = uuid.uuid4()
        self.requested(sb, job, start - timedelta(seconds=2), cpus, memory_mb)
        self.add(
            SandboxScheduled(
                **self.env(sb, job, start - timedelta(seconds=1)),
                payload=ScheduledPayload(request_id=rid, node_id="node-t"),
            )
        )
        self.add(
            SandboxStarted(
                **self.env(sb, job, start, "node-t"),
                payload=StartedPayload(request_id=rid, container_id="c0ffee" * 10),
            )
        )
        for when in commands:
            self.command(sb, job, when)
        if end is not None:
            self.add(
                SandboxStopped(
                    **self.env(sb, job, end, "node-t"), payload=StoppedPayload(reason=reason)
                )
            )
        return sb


def figures(rows: list[dict[str, Any]]) -> dict[tuple[str, date], tuple[Any, ...]]:
    """(job, day) -> (sandboxes, sandbox-s, core-s, GB-s, commands)."""
    return {
        (r["job_id"], r["day"]): (
            r["sandboxes"],
            r["sandbox_seconds"],
            r["core_seconds"],
            r["gb_seconds"],
            r["commands"],
        )
        for r in rows
    }


def lives(conn: Connection, tenant: str) -> list[dict[str, Any]]:
    query = text("SELECT * FROM sandbox_lives WHERE tenant = :t ORDER BY started_at")
    return [dict(r._mapping) for r in conn.execute(query, {"t": tenant})]


@pytest.fixture(scope="module")
def billing_db(migrated: Settings) -> Iterator[Settings]:
    """A database of this module's own: the check after each test reads the raw log's
    views over every tenant, and the stack's log grows with every run (~4 s a test
    over 190,000 events)."""
    with scratch_database(migrated) as settings:
        yield settings


@pytest.fixture
def conn(billing_db: Settings) -> Iterator[Connection]:
    """As everywhere (a transaction always rolled back), on this module's database."""
    with rolled_back(billing_db) as c:
        yield c


@pytest.fixture(autouse=True)
def rollups_agree_with_the_log(conn: Connection) -> Iterator[None]:
    """After each test: the rollups and the raw log's views give the same figures."""
    yield
    today = datetime.now(UTC).date()
    assert billing.differences(conn, DAY - timedelta(days=3), today + timedelta(days=1)) == []
    # The lives of these tests' tenants (Log's "t-..."): the raw view over the whole
    # development log (benchmarks and chaos runs included) took ~20 s per test.
    mine = "WHERE tenant LIKE 't-%'"
    for fast, raw in (("sandbox_lives", "sandbox_lives_from_log"),):
        only = conn.execute(
            text(
                f"(SELECT * FROM {fast} {mine} EXCEPT ALL SELECT * FROM {raw} {mine}) UNION ALL "
                f"(SELECT * FROM {raw} {mine} EXCEPT ALL SELECT * FROM {fast} {mine})"
            )
        ).all()
        assert only == []


# --- billing ---------------------------------------------------------------------


def test_half_hour_sandbox_is_billed_exactly(conn: Connection) -> None:
    # Given a sandbox of 2 cpus and 1 GiB living 10:00-10:30 UTC
    log = Log(conn)
    sb = log.life("job-a", at(DAY, 10), at(DAY, 10, 30), cpus=2, memory_mb=1024)
    # Then it is billed 1800 s, 3600 core-s, 1800 GB-s on that day
    assert figures(queries.bill(conn, tenant=log.tenant)) == {
        ("job-a", DAY): (1, 1800, 3600, 1800, 0)
    }
    # And its life is one row, read from the log
    (life,) = lives(conn, log.tenant)
    assert life["sandbox_id"] == sb
    assert (life["cpus"], life["memory_mb"], life["node_id"]) == (2, 1024, "node-t")
    assert (life["started_at"], life["ended_at"]) == (at(DAY, 10), at(DAY, 10, 30))
    assert (life["end_reason"], life["commands"]) == ("destroyed", 0)


@pytest.mark.parametrize("session_zone", ["UTC", "Asia/Tokyo", "America/St_Johns"])
def test_life_across_midnight_is_split_at_utc_midnight(conn: Connection, session_zone: str) -> None:
    # Given a session whose TimeZone is not (necessarily) UTC
    conn.execute(text("SELECT set_config('TimeZone', :z, true)"), {"z": session_zone})
    # And a sandbox (2 cpus, 1 GiB) living 23:00 UTC to 01:30 UTC the next day
    log = Log(conn)
    log.life("job-a", at(DAY, 23), at(NEXT_DAY, 1, 30))
    # Then the first UTC day gets 3600 s and the next 5400 s, whatever the session zone
    assert figures(queries.bill(conn, tenant=log.tenant)) == {
        ("job-a", DAY): (1, 3600, 7200, 3600, 0),
        ("job-a", NEXT_DAY): (1, 5400, 10800, 5400, 0),
    }


def test_life_ending_at_midnight_does_not_reach_the_next_day(conn: Connection) -> None:
    log = Log(conn)
    log.life("job-a", at(DAY, 22), at(NEXT_DAY, 0), cpus=0.5, memory_mb=512)
    assert figures(queries.bill(conn, tenant=log.tenant)) == {
        ("job-a", DAY): (1, 7200, 3600, 3600, 0)
    }


def test_running_sandbox_is_billed_up_to_now(conn: Connection) -> None:
    # Given a sandbox started two hours ago and never stopped
    log = Log(conn)
    log.life("job-a", datetime.now(UTC) - timedelta(hours=2), None, cpus=4, memory_mb=2048)
    # Then it counts until now (its days sum up, in case midnight fell in between)
    rows = queries.bill(conn, tenant=log.tenant)
    seconds = sum(r["sandbox_seconds"] for r in rows)
    assert 7200 - 5 <= seconds <= 7200 + 5
    assert sum(r["core_seconds"] for r in rows) == pytest.approx(4 * seconds, abs=Decimal("0.01"))
    assert sum(r["gb_seconds"] for r in rows) == pytest.approx(2 * seconds, abs=Decimal("0.01"))
    assert all(r["sandboxes"] == 1 for r in rows)
    # And its life has no end yet
    (life,) = lives(conn, log.tenant)
    assert (life["ended_at"], life["end_reason"]) == (None, None)


def test_commands_are_counted_on_their_utc_day(conn: Connection) -> None:
    # Given a sandbox across midnight running two commands before and one after
    conn.execute(text("SELECT set_config('TimeZone', 'Asia/Tokyo', true)"))
    log = Log(conn)
    log.life(
        "job-a",
        at(DAY, 23),
        at(NEXT_DAY, 1, 30),
        commands=[at(DAY, 23, 10), at(DAY, 23, 59), at(NEXT_DAY, 0, 20)],
    )
    # And a second sandbox of the same job on the first day only, with one command
    log.life("job-a", at(DAY, 8), at(DAY, 9), commands=[at(DAY, 8, 30)])
    # Then each day counts its own commands and sandboxes
    got = figures(queries.bill(conn, tenant=log.tenant))
    assert got[("job-a", DAY)][0] == 2 and got[("job-a", DAY)][4] == 3
    assert got[("job-a", NEXT_DAY)][0] == 1 and got[("job-a", NEXT_DAY)][4] == 1
    # And each life counts all of its own
    assert [life["commands"] for life in lives(conn, log.tenant)] == [1, 3]


def test_requests_that_never_started_are_not_billed(conn: Connection) -> None:
    log = Log(conn)
    log.requested("sb-refused", "job-a", at(DAY, 9))
    log.add(
        SandboxRejected(
            **log.env("sb-refused", "job-a", at(DAY, 9)),
            payload=RejectedPayload(
                request_id=None,
                request_type="CreateSandbox",
                reason=RejectReason.CAPACITY,
                detail="full",
            ),
        )
    )
    assert queries.bill(conn, tenant=log.tenant) == []
    assert lives(conn, log.tenant) == []


def test_filters_by_tenant_job_and_days(conn: Connection) -> None:
    # Given two jobs of one tenant on two days, and another tenant the same days
    log = Log(conn)
    other = Log(conn)
    log.life("job-a", at(DAY, 10), at(DAY, 11))
    log.life("job-b", at(DAY, 12), at(DAY, 12, 10), cpus=1, memory_mb=2048)
    log.life("job-b", at(NEXT_DAY, 12), at(NEXT_DAY, 12, 1), cpus=1, memory_mb=256)
    other.life("job-a", at(DAY, 10), at(DAY, 11))
    # Then a tenant sees only its own rows, ordered by day then job
    rows = queries.bill(conn, tenant=log.tenant)
    assert [(r["tenant"], r["job_id"], r["day"]) for r in rows] == [
        (log.tenant, "job-a", DAY),
        (log.tenant, "job-b", DAY),
        (log.tenant, "job-b", NEXT_DAY),
    ]
    # And a job filter narrows to that job
    assert figures(queries.bill(conn, tenant=log.tenant, job_id="job-b")) == {
        ("job-b", DAY): (1, 600, 600, 1200, 0),
        ("job-b", NEXT_DAY): (1, 60, 60, 15, 0),
    }
    # And days are a closed range of UTC dates
    one_day = queries.bill(conn, tenant=log.tenant, day_from=NEXT_DAY, day_to=NEXT_DAY)
    assert [(r["job_id"], r["day"]) for r in one_day] == [("job-b", NEXT_DAY)]
    assert queries.bill(conn, tenant=log.tenant, day_to=DAY - timedelta(days=1)) == []


def test_clock_skewed_life_counts_zero_seconds(conn: Connection) -> None:
    # Given a sandbox whose stop was stamped (by another clock) before its start
    log = Log(conn)
    log.life("job-a", at(DAY, 10), at(DAY, 9, 59))
    # Then it is one sandbox of zero seconds on its start day
    assert figures(queries.bill(conn, tenant=log.tenant)) == {("job-a", DAY): (1, 0, 0, 0, 0)}


def test_a_life_of_three_days_is_cut_at_each_midnight(conn: Connection) -> None:
    log = Log(conn)
    log.life("job-a", at(DAY, 12), at(DAY + timedelta(days=2), 6), cpus=1, memory_mb=1024)
    assert figures(queries.bill(conn, tenant=log.tenant)) == {
        ("job-a", DAY): (1, 43200, 43200, 43200, 0),
        ("job-a", NEXT_DAY): (1, 86400, 86400, 86400, 0),
        ("job-a", DAY + timedelta(days=2)): (1, 21600, 21600, 21600, 0),
    }


def test_a_reused_sandbox_id_bills_its_first_life_only(conn: Connection) -> None:
    # Given a sandbox that lived 10:00-11:00
    log = Log(conn)
    sb = log.life("job-a", at(DAY, 10), at(DAY, 11), cpus=1)
    # When its id is requested, started and stopped again (a replay, a second party)
    log.requested(sb, "job-a", at(DAY, 12), cpus=8, memory_mb=8192)
    log.add(
        SandboxStarted(
            **log.env(sb, "job-a", at(DAY, 12), "node-x"),
            payload=StartedPayload(request_id=uuid.uuid4(), container_id="beef" * 16),
        )
    )
    log.add(
        SandboxStopped(
            **log.env(sb, "job-a", at(DAY, 18)), payload=StoppedPayload(reason=StopReason.DESTROYED)
        )
    )
    # Then the first request, start and stop are the life that is billed
    assert figures(queries.bill(conn, tenant=log.tenant)) == {
        ("job-a", DAY): (1, 3600, 3600, 3600, 0)
    }
    (life,) = lives(conn, log.tenant)
    assert (life["node_id"], life["cpus"], life["ended_at"]) == ("node-t", 1, at(DAY, 11))


def test_a_refused_reuse_of_a_running_id_changes_nothing(conn: Connection) -> None:
    # Given a running sandbox, and a second create with its id refused (id in use)
    log = Log(conn)
    now = datetime.now(UTC)
    sb = log.life("job-a", now - timedelta(hours=1), None, cpus=1, memory_mb=1024)
    log.add(
        SandboxRejected(
            **log.env(sb, "job-a", now - timedelta(minutes=30)),
            payload=RejectedPayload(
                request_id=uuid.uuid4(),
                request_type="CreateSandbox",
                reason=RejectReason.ID_IN_USE,
                detail="sandbox id in use",
            ),
        )
    )
    # Then it is still one running life (the autouse check compares with the log)
    (life,) = lives(conn, log.tenant)
    assert life["ended_at"] is None
    # And the sandbox still lives in its projection, so a restarted scheduler recovers
    # it (projections v7: the refusal used to end it there, and the scheduler then
    # destroyed it as an orphan)
    row = conn.execute(
        text("SELECT state, ended_at, tenant FROM sandboxes WHERE sandbox_id = :s"), {"s": sb}
    ).one()
    assert (row.state, row.ended_at, row.tenant) == ("running", None, log.tenant)


def test_a_start_logged_after_the_stop_is_a_life_of_zero_seconds(conn: Connection) -> None:
    # Given a sandbox declared lost before its node's Started reached the log
    log = Log(conn)
    log.requested("sb-late", "job-a", at(DAY, 9))
    log.add(
        SandboxStopped(
            **log.env("sb-late", "job-a", at(DAY, 9, 5)),
            payload=StoppedPayload(reason=StopReason.NODE_LOST),
        )
    )
    assert queries.bill(conn, tenant=log.tenant) == []
    log.add(
        SandboxStarted(
            **log.env("sb-late", "job-a", at(DAY, 9, 6), "node-t"),
            payload=StartedPayload(request_id=uuid.uuid4(), container_id="c0ffee" * 10),
        )
    )
    # Then, like the raw view, it is one sandbox of zero seconds
    assert figures(queries.bill(conn, tenant=log.tenant)) == {("job-a", DAY): (1, 0, 0, 0, 0)}


def test_running_lives_of_many_shapes_and_days_are_billed_as_the_log_says(
    conn: Connection,
) -> None:
    # Given lives running since minutes, hours and days, of several shapes, and one
    # whose start a skewed clock put in the future (the autouse check compares every
    # figure with the raw log's view, to the last digit)
    log = Log(conn)
    now = datetime.now(UTC)
    shapes = [(0.2, 1, 512), (1.5, 1, 512), (1.7, 1, 512), (30, 2, 1024), (55, 0.5, 333)]
    running = [
        log.life("job-a", now - timedelta(hours=h, microseconds=1234), None, cpus=c, memory_mb=m)
        for h, c, m in shapes
    ]
    running.append(log.life("job-b", now + timedelta(minutes=5), None, cpus=4, memory_mb=4096))
    rows = queries.bill(conn, tenant=log.tenant)
    billed = float(sum(r["sandbox_seconds"] for r in rows))
    assert billed == pytest.approx(sum(h for h, _, _ in shapes) * 3600, abs=60)
    # When they all end, nothing of them is left running
    for sb in running:
        log.add(
            SandboxStopped(
                **log.env(sb, "job-a" if sb != running[-1] else "job-b", now),
                payload=StoppedPayload(reason=StopReason.DESTROYED),
            )
        )
    left = conn.execute(
        text("SELECT count(*) FROM running_usage WHERE tenant = :t"), {"t": log.tenant}
    ).scalar()
    assert left == 0


def _life_events(log: Log, job: str, start: datetime, end: datetime, n: int) -> list[Event]:
    sb = f"sb-{uuid.uuid4().hex[:12]}"
    rid = uuid.uuid4()
    payload = RequestedPayload(
        request_id=rid, actor="alice", image="dsec/busybox:latest", cpus=0.25 * n,
        memory_mb=300 + n, disk_mb=512, ttl_s=86400, network=False,
    )  # fmt: skip
    started = StartedPayload(request_id=rid, container_id="c0ffee" * 10)
    return [
        SandboxRequested(**log.env(sb, job, start), payload=payload),
        SandboxStarted(**log.env(sb, job, start, "node-t"), payload=started),
        SandboxStopped(
            **log.env(sb, job, end), payload=StoppedPayload(reason=StopReason.DESTROYED)
        ),
    ]


def test_the_rollup_does_not_depend_on_batching_and_a_rebuild_gives_the_same(
    conn: Connection,
) -> None:
    # Given the same lives appended one event per batch by one tenant, and all in one
    # batch by another (lives across midnight, odd cpus and memory, microseconds)
    singly, batched = Log(conn), Log(conn)
    events: dict[str, list[Event]] = {singly.tenant: [], batched.tenant: []}
    for n in range(1, 8):
        start = at(DAY, 20 + n % 4, 7 * n) + timedelta(microseconds=123457 * n)
        end = start + timedelta(hours=n, microseconds=999999)
        for log in (singly, batched):
            events[log.tenant] += _life_events(log, f"job-{n % 2}", start, end, n)
    for event in events[singly.tenant]:
        singly.add(event)
    batched.add_batch(events[batched.tenant])

    # Then both tenants' rollup rows are the same, digit for digit
    def rollup(tenant: str) -> list[tuple[Any, ...]]:
        query = text(
            "SELECT job_id, day, sandboxes, sandbox_seconds, core_seconds, mb_seconds"
            " FROM usage_daily WHERE tenant = :t ORDER BY job_id, day"
        )
        return [tuple(r) for r in conn.execute(query, {"t": tenant})]

    assert rollup(singly.tenant) == rollup(batched.tenant) != []
    # And a rebuild from the log folds the same rows again (the live projector held
    # still first, as `dsec projections rebuild --check` does)
    projections.lock(conn)
    before = projections.snapshot(conn)
    projections.rebuild(conn)
    assert projections.snapshot(conn) == before


# --- audit -----------------------------------------------------------------------


def test_audit_rows_in_position_order_with_actor_and_action(conn: Connection) -> None:
    # Given the whole life of one sandbox, with commands and files from two actors
    log = Log(conn)
    sb, job = "sb-audited", "job-a"
    rid = uuid.uuid4()
    log.requested(sb, job, at(DAY, 10), cpus=1, memory_mb=256)
    log.add(
        SandboxScheduled(
            **log.env(sb, job, at(DAY, 10)),
            payload=ScheduledPayload(request_id=rid, node_id="node-7"),
        )
    )
    log.add(
        SandboxStarted(
            **log.env(sb, job, at(DAY, 10), "node-7"),
            payload=StartedPayload(request_id=rid, container_id="abcdef0123456789", warm=True),
        )
    )
    log.command(sb, job, at(DAY, 10, 1), ["python", "-c", "print(1)"], node="node-7")
    log.command(sb, job, at(DAY, 10, 2), "false", 1, actor="bob", stderr="boom", node="node-7")
    file = FilePayload(request_id=uuid.uuid4(), actor="bob", path="/work/a.txt", size=12)
    log.add(FileWritten(**log.env(sb, job, at(DAY, 10, 3), "node-7"), payload=file))
    log.add(FileRead(**log.env(sb, job, at(DAY, 10, 4), "node-7"), payload=file))
    log.add(
        SandboxFailed(
            **log.env(sb, job, at(DAY, 10, 5), "node-7"),
            payload=FailedPayload(
                request_id=uuid.uuid4(),
                request_type="Exec",
                reason=FailReason.AGENT_UNAVAILABLE,
                detail="agent did not answer",
            ),
        )
    )
    log.add(
        SandboxStopped(
            **log.env(sb, job, at(DAY, 10, 6), "node-7"),
            payload=StoppedPayload(reason=StopReason.OOM, detail="memory limit reached"),
        )
    )
    # When the operator asks for its audit trail
    rows = queries.audit(conn, sandbox_id=sb)
    # Then every event is there, in log order: who, what, outcome, from where
    assert [r["position"] for r in rows] == sorted(r["position"] for r in rows)
    assert [(r["type"], r["actor"], r["action"], r["outcome"], r["node_id"]) for r in rows] == [
        (
            "SandboxRequested",
            "alice",
            "create dsec/busybox:latest cpus=1.0 memory_mb=256 disk_mb=512 ttl_s=86400"
            " network=false",
            "accepted",
            None,
        ),
        ("SandboxScheduled", None, "place on node-7", "placed", "node-7"),
        ("SandboxStarted", None, "start container abcdef012345", "running (warm)", "node-7"),
        ("CommandCompleted", "alice", "exec python -c print(1)", "exit 0", "node-7"),
        ("CommandCompleted", "bob", "exec false", "exit 1", "node-7"),
        ("FileWritten", "bob", "write /work/a.txt", "12 bytes", "node-7"),
        ("FileRead", "bob", "read /work/a.txt", "12 bytes", "node-7"),
        ("SandboxFailed", None, "fail Exec", "agent_unavailable", "node-7"),
        ("SandboxStopped", None, "stop", "oom", "node-7"),
    ]
    assert [r["detail"] for r in rows][-5:] == [
        "boom",
        None,
        None,
        "agent did not answer",
        "memory limit reached",
    ]
    assert {(r["tenant"], r["job_id"], r["sandbox_id"]) for r in rows} == {(log.tenant, job, sb)}
    assert rows[0]["occurred_at"] == at(DAY, 10)


def test_audit_limit_keeps_the_latest_rows_and_since_filters(conn: Connection) -> None:
    # Given one sandbox with ten commands, a minute apart
    log = Log(conn)
    log.life("job-a", at(DAY, 10), at(DAY, 11), commands=[at(DAY, 10, m) for m in range(1, 11)])
    # Then a limit keeps the latest events, still oldest first
    tail = queries.audit(conn, tenant=log.tenant, limit=3)
    assert [(r["type"], r["occurred_at"]) for r in tail] == [
        ("CommandCompleted", at(DAY, 10, 9)),
        ("CommandCompleted", at(DAY, 10, 10)),
        ("SandboxStopped", at(DAY, 11)),
    ]
    # And since/job filters narrow the trail
    since = queries.audit(conn, tenant=log.tenant, job_id="job-a", since=at(DAY, 10, 8))
    assert len(since) == 4
    assert queries.audit(conn, tenant=log.tenant, job_id="job-other") == []


# --- CLI -------------------------------------------------------------------------


def test_cli_prints_bill_and_audit(conn: Connection, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given the CLI reading through this test's (rolled back) transaction
    from app.cli import records as cli_mod
    from app.cli.main import cli
    from app.db import engine

    @contextmanager
    def same_transaction(_url: str) -> Iterator[Connection]:
        yield conn

    monkeypatch.setattr(engine, "transaction", same_transaction)
    monkeypatch.setattr(cli_mod, "console", Console(width=200))
    log = Log(conn)
    sb = log.life("job-a", at(DAY, 10), at(DAY, 10, 30), commands=[at(DAY, 10, 5)])
    runner = CliRunner()
    # When the operator asks for the bill as JSON
    result = runner.invoke(
        cli,
        [
            "bill",
            "--tenant",
            log.tenant,
            "--from",
            DAY.isoformat(),
            "--to",
            DAY.isoformat(),
            "--format",
            "json",
        ],
    )
    # Then the figures come out as numbers
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == [
        {
            "tenant": log.tenant,
            "job_id": "job-a",
            "day": DAY.isoformat(),
            "sandboxes": 1,
            "sandbox_seconds": 1800,
            "core_seconds": 3600,
            "gb_seconds": 1800,
            "commands": 1,
        }
    ]
    # When the operator asks for the sandbox's audit trail as CSV
    result = runner.invoke(cli, ["audit", "--sandbox", sb, "--format", "csv"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0] == ",".join(queries.AUDIT_COLUMNS)
    assert [line.split(",")[6] for line in lines[1:]] == [
        "SandboxRequested",
        "SandboxScheduled",
        "SandboxStarted",
        "CommandCompleted",
        "SandboxStopped",
    ]
    # And as a table, and a bad value is refused naming the option's problem
    result = runner.invoke(cli, ["audit", "--sandbox", sb])
    assert result.exit_code == 0 and "place on node-t" in result.output
    result = runner.invoke(cli, ["bill", "--from", "someday"])
    assert result.exit_code != 0 and "not a day" in result.output
