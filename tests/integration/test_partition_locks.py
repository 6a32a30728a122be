"""Partition locks on owner sessions (Postgres only): one owner per partition, the
others see who holds what, and a session that lost its lock cannot commit."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import Connection, text

from app.config import Settings
from app.db.engine import transaction
from app.db.partition_locks import OwnerSession, OwnershipLost, read_holders
from tests.conftest import wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def topic() -> str:
    """A topic name of the test's own: its locks are nobody else's."""
    return f"locks-{uuid.uuid4().hex[:8]}.requests"


@pytest.fixture
def sessions(migrated: Settings, topic: str) -> Iterator[tuple[OwnerSession, OwnerSession]]:
    a = OwnerSession(migrated.database_url, "scheduler", topic)
    b = OwnerSession(migrated.database_url, "scheduler", topic)
    a.open()
    b.open()
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def test_a_partition_has_one_owner_and_everyone_sees_it(
    migrated: Settings, topic: str, sessions: tuple[OwnerSession, OwnerSession]
) -> None:
    a, b = sessions
    assert a.try_claim(0) and a.try_claim(1)
    assert not b.try_claim(0)
    assert b.try_claim(2)
    with transaction(migrated.database_url) as conn:
        seen = read_holders(conn, "scheduler", topic)
    assert seen.partitions == {0: a.backend_pid, 1: a.backend_pid, 2: b.backend_pid}
    assert seen.members == {a.backend_pid, b.backend_pid}
    # A partition given back is free for the other
    a.release(1)
    assert b.try_claim(1) and b.owned == {1, 2}


def test_a_dead_session_frees_its_partitions_and_cannot_commit(
    migrated: Settings, sessions: tuple[OwnerSession, OwnerSession]
) -> None:
    a, b = sessions
    assert a.try_claim(3)
    written: list[int] = []

    def write(_conn: Connection) -> None:
        written.append(1)

    a.save(write, {3})
    assert written == [1]
    # When A's session ends under it (as a SIGKILLed process's socket closes)
    with transaction(migrated.database_url) as conn:
        conn.execute(text("SELECT pg_terminate_backend(:p)"), {"p": a.backend_pid})
    # Then the partition is B's to take, and A's next commit is refused
    wait_for(lambda: b.try_claim(3), timeout_s=10, what="partition 3 free")
    with pytest.raises(OwnershipLost):
        a.save(write, {3})
    assert written == [1] and not a.is_open


def test_a_commit_for_a_partition_not_held_is_refused(
    sessions: tuple[OwnerSession, OwnerSession],
) -> None:
    # A session that never held the partition (or one SQLAlchemy would have replaced
    # after a failure) writes nothing for it
    a, _ = sessions
    assert a.try_claim(4)

    def write(conn: Connection) -> None:
        raise AssertionError("must not run")

    with pytest.raises(OwnershipLost, match=r"\[5\]"):
        a.save(write, {4, 5})
