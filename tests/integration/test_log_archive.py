"""Archiving old days of the log: the bill survives, the audit comes back on restore.

Runs in a scratch database of its own (migrated at the start, dropped at the end):
archiving detaches and drops partitions, which the shared log must not see.
"""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from app.config import Settings
from app.db import archive, billing, projections, queries
from app.db.engine import engine_for
from tests.conftest import scratch_database
from tests.integration.test_billing import Log, at

pytestmark = pytest.mark.integration

TODAY = datetime.now(UTC).date()
OLD = TODAY - timedelta(days=40)


@pytest.fixture(scope="module")
def scratch(migrated: Settings) -> Iterator[Settings]:
    with scratch_database(migrated) as settings:
        yield settings


def test_archived_days_keep_their_bill_and_restore_their_audit(
    scratch: Settings, tmp_path: Path
) -> None:
    engine = engine_for(scratch.database_url)
    # Given two old days of the log with their own partitions, and lives on them:
    # one inside the first day, one across its midnight into the second
    with engine.begin() as conn:
        for day in (OLD, OLD + timedelta(days=1)):
            conn.execute(text("SELECT dsec_ensure_event_partition(:d)"), {"d": day})
        log = Log(conn, tenant="acme")
        inside = log.life("job-a", at(OLD, 10), at(OLD, 11), commands=[at(OLD, 10, 30)])
        log.life("job-a", at(OLD, 23), at(OLD + timedelta(days=1), 1), cpus=1)
    with engine.connect() as conn:
        bill_before = queries.bill(conn, tenant="acme")
        lives_before = conn.execute(text("SELECT * FROM sandbox_lives ORDER BY 3")).all()
        assert len(queries.audit(conn, sandbox_id=inside)) == 5
    assert [r["day"] for r in bill_before] == [OLD, OLD + timedelta(days=1)]

    # When an operator archives the days older than 30 days
    done = archive.archive(scratch.admin_database_url, 30, tmp_path, TODAY)

    # Then both days left Postgres for checked files, and are recorded
    assert [(d.day, d.events) for d in done] == [(OLD, 8), (OLD + timedelta(days=1), 1)]
    for day in done:
        assert day.file.exists()
        with gzip.open(day.file, "rt") as f:
            assert len(f.read().splitlines()) == day.events + 1  # the header
    with engine.connect() as conn:
        assert (
            conn.execute(text("SELECT to_regclass(:p)"), {"p": done[0].partition}).scalar() is None
        )
        # And the bill and the lives of the archived days are the same as before
        assert queries.bill(conn, tenant="acme") == bill_before
        assert conn.execute(text("SELECT * FROM sandbox_lives ORDER BY 3")).all() == lives_before
        # While the audit trail of those days is gone with them
        assert queries.audit(conn, sandbox_id=inside) == []
        assert billing.archived_between(conn, OLD, TODAY) == [d.day for d in done]
        # (an audit that finds nothing says which days left: `dsec audit` prints it)
        assert billing.last_archived_day(conn) == OLD + timedelta(days=1)

    # And a rebuild of the projections keeps the bills the log no longer holds
    with engine.begin() as conn:
        projections.rebuild(conn)
    with engine.connect() as conn:
        assert queries.bill(conn, tenant="acme") == bill_before

    # When a changed file is offered for restore, it is refused and nothing attaches
    forged = tmp_path / "forged" / done[0].file.name
    forged.parent.mkdir()
    with gzip.open(done[0].file, "rb") as src, gzip.open(forged, "wb") as dst:
        dst.write(src.read().replace(b"job-a", b"job-b"))
    with pytest.raises(archive.ArchiveError, match="changed file"):
        archive.restore(scratch.admin_database_url, forged)

    # When the days are restored from their files
    for day in done:
        archive.restore(scratch.admin_database_url, day.file)

    # Then the audit trail answers again, the raw log's bill agrees with the rollups,
    # and the restored days are append-only like the rest of the log
    with engine.connect() as conn:
        assert len(queries.audit(conn, sandbox_id=inside)) == 5
        assert billing.differences(conn, OLD, OLD + timedelta(days=1)) == []
        assert billing.archived_between(conn, OLD, TODAY) == []
        assert billing.last_archived_day(conn) is None
    owner = engine_for(scratch.admin_database_url)
    for statement in ("DELETE FROM {}", "TRUNCATE {}"):
        with owner.begin() as conn, pytest.raises(DBAPIError, match="append-only"):
            conn.execute(text(statement.format(done[0].partition)))
    owner.dispose()

    # And archiving again is the same round trip
    again = archive.archive(scratch.admin_database_url, 30, tmp_path, TODAY)
    assert [(d.day, d.events, d.sha256) for d in again] == [
        (d.day, d.events, d.sha256) for d in done
    ]


def test_archiving_today_is_refused(scratch: Settings, tmp_path: Path) -> None:
    with pytest.raises(archive.ArchiveError, match="at least 1 day"):
        archive.archive(scratch.admin_database_url, 0, tmp_path, TODAY)
