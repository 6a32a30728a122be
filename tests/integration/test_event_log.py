"""The log is append-only, and a message delivered twice lands once."""

from __future__ import annotations

import subprocess
import time
import uuid
from typing import Any

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError

from app.config import Settings
from app.domain.events import NodeLost, NodeLostPayload
from app.errors import LogTamperRefused
from tests.conftest import PlatformPublisher, live_and_rebuilt, scalar, wait_for

pytestmark = pytest.mark.integration


def _one_event(settings: Settings) -> uuid.UUID:
    publisher = PlatformPublisher(settings)
    event = NodeLost(node_id=f"test-{uuid.uuid4().hex[:6]}", payload=NodeLostPayload(detail="test"))
    publisher.publish(settings.topic_events, event.key, event, wait=True)
    publisher.close()
    return event.event_id


@pytest.mark.parametrize(
    "statement",
    [
        "UPDATE events SET tenant = 'x' WHERE position = (SELECT max(position) FROM events)",
        "DELETE FROM events WHERE position = (SELECT max(position) FROM events)",
        "TRUNCATE events",
    ],
)
def test_service_role_cannot_change_the_log(stack: Settings, db: Any, statement: str) -> None:
    _one_event(stack)
    with pytest.raises(LogTamperRefused), db() as conn:
        conn.execute(text(statement))


@pytest.mark.parametrize(
    "statement",
    [
        "UPDATE events SET tenant = 'x'",
        "DELETE FROM events",
        "TRUNCATE events",
    ],
)
def test_owner_cannot_change_the_log(stack: Settings, statement: str) -> None:
    engine = create_engine(stack.admin_database_url)
    try:
        with pytest.raises(DBAPIError, match="append-only"), engine.begin() as conn:
            conn.execute(text(statement))
    finally:
        engine.dispose()


@pytest.mark.parametrize("statement", ["UPDATE events SET tenant = 'x'", "TRUNCATE events"])
def test_superuser_cannot_change_the_log_even_as_replica(stack: Settings, statement: str) -> None:
    # replica mode skips ordinary triggers; the guards are ENABLE ALWAYS. The superuser
    # is the postgres system user on the local socket (TCP wants a password).
    script = f"SET session_replication_role = replica;\n{statement};\n"
    database = str(make_url(stack.admin_database_url).database)
    done = subprocess.run(
        ["runuser", "-u", "postgres", "--", "psql", "-X", "-q", "-v", "ON_ERROR_STOP=1",
         "-d", database, "-f", "-"],
        input=script, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode != 0 and "append-only" in done.stderr, done.stderr


def test_same_message_twice_lands_once(stack: Settings, db: Any) -> None:
    # Given one event published twice, byte for byte (a producer retry)
    publisher = PlatformPublisher(stack)
    event = NodeLost(node_id=f"dup-{uuid.uuid4().hex[:6]}", payload=NodeLostPayload(detail="dup"))
    publisher.publish(stack.topic_events, event.key, event)
    publisher.publish(stack.topic_events, event.key, event)
    publisher.flush()
    publisher.close()
    # Then the log holds it once, and the projector recorded both offsets as read
    with db() as conn:
        wait_for(
            lambda: scalar(
                conn, "SELECT count(*) FROM events WHERE event_id = :e", e=event.event_id
            ),
            what="the event in the log",
        )
    marker = _one_event(stack)  # a later event on the same topic proves the second copy was read
    with db() as conn:
        wait_for(
            lambda: scalar(conn, "SELECT count(*) FROM events WHERE event_id = :e", e=marker),
            what="the marker event",
        )
        assert (
            scalar(conn, "SELECT count(*) FROM events WHERE event_id = :e", e=event.event_id) == 1
        )


@pytest.mark.parametrize(
    "statement",
    [
        "UPDATE {part} SET tenant = 'x'",
        "DELETE FROM {part}",
        "TRUNCATE {part}",
    ],
)
def test_partitions_refuse_changes_even_for_the_owner(stack: Settings, statement: str) -> None:
    # Given the partition that holds the latest events, named directly
    _one_event(stack)
    time.sleep(0.5)
    engine = create_engine(stack.admin_database_url)
    try:
        with engine.begin() as conn:
            part = conn.execute(
                text(
                    "SELECT tableoid::regclass::text FROM events ORDER BY recorded_at DESC LIMIT 1"
                )
            ).scalar()
        assert part is not None
        with pytest.raises(DBAPIError, match="append-only"), engine.begin() as conn:
            conn.execute(text(statement.format(part=part)))
    finally:
        engine.dispose()


def test_partitions_exist_ahead(stack: Settings, db: Any) -> None:
    with db() as conn:
        ahead = scalar(
            conn,
            "SELECT count(*) FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"
            " WHERE i.inhparent = 'events'::regclass"
            " AND c.relname >= 'events_p' || to_char(now() AT TIME ZONE 'UTC', 'YYYYMMDD')",
        )
    assert ahead >= 7


@pytest.mark.parametrize(
    "statement",
    [
        "CREATE TABLE dsec_intruder (x int)",
        "DROP TABLE events_default",
        "ALTER TABLE events DISABLE TRIGGER ALL",
        "UPDATE event_ids SET recorded_at = now()",
        "DELETE FROM event_ids",
    ],
)
def test_service_role_has_least_privilege(stack: Settings, statement: str) -> None:
    engine = create_engine(stack.database_url)
    try:
        with pytest.raises(DBAPIError), engine.begin() as conn:
            conn.execute(text(statement))
    finally:
        engine.dispose()


def test_rebuild_equals_live_projections_after_mixed_workload(stack: Settings, client: Any) -> None:
    from app.errors import SandboxFailedError

    # Given a mixed workload: commands, files, a failure, a destroy
    boxes = client.create_many(3)
    for box in boxes:
        box.exec("echo hi; exit 2")
        box.write_file("/workspace/f", b"x")
    with pytest.raises(SandboxFailedError):
        client.create(image="dsec/nope:latest")
    for box in boxes:
        box.close()
    time.sleep(1.0)  # let the projector catch up
    # When the projections are rebuilt from the log (inside a rolled-back transaction)
    live, rebuilt = live_and_rebuilt(stack)
    # Then they equal the live ones row for row
    assert live ^ rebuilt == set()
    assert any(row[0] == "commands" for row in live)


def test_positions_can_commit_out_of_order_across_writers(stack: Settings) -> None:
    """The race docs/guarantees.md describes: with two writers (partition-parallel
    projectors), a reader following `position` can see a later position before an
    earlier one commits. Readers that need a gapless feed follow Kafka offsets."""
    from app.db.engine import engine_for
    from app.db.log import SourcedEvent, append

    engine = engine_for(stack.database_url)
    topic_id = uuid.uuid4()

    def event(n: int) -> SourcedEvent:
        lost = NodeLost(node_id=f"race-{uuid.uuid4().hex[:6]}", payload=NodeLostPayload(detail="r"))
        return SourcedEvent(lost, "race", topic_id, n, 0)

    with engine.connect() as writer_a, engine.connect() as writer_b, engine.connect() as reader:
        # Given writer A appends first but has not committed
        tx_a = writer_a.begin()
        (_, first), *_ = append(writer_a, [event(0)])
        # When writer B appends after it and commits
        with writer_b.begin():
            (_, second), *_ = append(writer_b, [event(1)])
        # Then a reader sees B's later position while A's earlier one is missing
        visible = set(
            reader.execute(
                text("SELECT position FROM events WHERE position IN (:a, :b)"),
                {"a": first, "b": second},
            ).scalars()
        )
        reader.rollback()
        assert first < second and visible == {second}
        tx_a.commit()
