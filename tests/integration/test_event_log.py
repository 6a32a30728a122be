"""The log is append-only, and a message delivered twice lands once."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.exc import DBAPIError

from app.bus import Publisher
from app.config import Settings
from app.domain.events import NodeLost, NodeLostPayload
from app.errors import LogTamperRefused
from tests.conftest import scalar, wait_for

pytestmark = pytest.mark.integration


def _one_event(settings: Settings) -> uuid.UUID:
    publisher = Publisher(settings)
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
def test_owner_cannot_change_the_log_even_as_replica(stack: Settings, statement: str) -> None:
    engine = create_engine(stack.admin_database_url)
    try:
        with pytest.raises(DBAPIError, match="append-only"), engine.begin() as conn:
            conn.execute(text("SET session_replication_role = replica"))
            conn.execute(text(statement))
    finally:
        engine.dispose()


def test_same_message_twice_lands_once(stack: Settings, db: Any) -> None:
    # Given one event published twice, byte for byte (a producer retry)
    publisher = Publisher(stack)
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
