"""Partition ownership among scheduler processes: Postgres session advisory locks.

Each scheduler holds one dedicated Postgres session (:class:`OwnerSession`). On it, it
takes a member lock (key: its backend pid) and one lock per partition of the requests
topic it owns. A session-level advisory lock lives exactly as long as the session: a
scheduler that is SIGKILLed loses its socket, Postgres ends the backend and every one
of its locks is free for the others at once (a host that vanishes without closing the
socket is noticed by the TCP keepalives set here, in about 10 s).

The fence: a scheduler commits its offsets and handled request ids only on this same
session, in a transaction that first checks the session still holds the lock of every
partition it saves (:meth:`OwnerSession.save`). A session that died cannot commit,
and a connection SQLAlchemy quietly replaced after a failure holds no lock, so the
check refuses it: offsets of a partition are only ever moved by its owner.
"""

from __future__ import annotations

import logging
import os
import socket
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from sqlalchemy import Connection, create_engine, text
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.pool import NullPool

from app.errors import ServiceUnavailable

log = logging.getLogger(__name__)


class OwnershipLost(ServiceUnavailable):
    """The owner session died or no longer holds a partition it acts for."""


def lock_class(consumer: str, topic: str, what: str = "partitions") -> int:
    """The first half of an advisory lock key (31 bits: pg_locks shows it as an oid)."""
    return zlib.crc32(f"{consumer}\0{topic}\0{what}".encode()) & 0x7FFF_FFFF


@dataclass(frozen=True)
class Holders:
    """Who holds what, as Postgres sees it now."""

    #: Backend pid of the session holding each held partition.
    partitions: dict[int, int]
    #: Backend pids of live members (sessions holding a member lock).
    members: frozenset[int]
    #: Each member's session's application_name (which names its host and process).
    names: dict[int, str]


_HOLDERS = text(
    """
    SELECT l.classid::bigint AS cls, l.objid::bigint AS obj, l.pid,
           coalesce(a.application_name, '') AS name
    FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid
    WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
      AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
      AND l.classid::bigint IN (:parts, :members)
    """
)
_HELD_HERE = text(
    """
    SELECT l.objid::bigint FROM pg_locks l
    WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
      AND l.pid = pg_backend_pid() AND l.classid::bigint = :parts
    """
)

# Two int4 halves (class, object): the keys stay readable in pg_locks.
_LOCK = "SELECT pg_advisory_lock(CAST(:c AS int), CAST(:p AS int))"
_TRY_LOCK = "SELECT pg_try_advisory_lock(CAST(:c AS int), CAST(:p AS int))"
_UNLOCK = "SELECT pg_advisory_unlock(CAST(:c AS int), CAST(:p AS int))"


def read_holders(conn: Connection, consumer: str, topic: str) -> Holders:
    """Partition and member locks of ``consumer`` on ``topic`` (any session may ask)."""
    parts, members = lock_class(consumer, topic), lock_class(consumer, topic, "members")
    rows = conn.execute(_HOLDERS, {"parts": parts, "members": members}).all()
    held = {int(r.obj): int(r.pid) for r in rows if r.cls == parts}
    live = frozenset(int(r.pid) for r in rows if r.cls == members)
    names = {int(r.pid): str(r.name) for r in rows if r.cls == members}
    return Holders(held, live, names)


def process_name(kind: str) -> str:
    """The application_name an owner session carries: ``dsec-<kind> <host>:<pid>``."""
    return f"dsec-{kind} {socket.gethostname()}:{os.getpid()}"[:63]


class OwnerSession:
    """One scheduler's dedicated session: its member lock, its partition locks, and
    the only connection its offsets are committed on."""

    def __init__(self, url: str, consumer: str, topic: str, kind: str = "scheduler") -> None:
        self.consumer, self.topic = consumer, topic
        self._parts = lock_class(consumer, topic)
        self._members = lock_class(consumer, topic, "members")
        # Its own engine without a pool: the session is never handed to anyone else,
        # and keepalives end it within ~10 s of its host vanishing.
        self._engine = create_engine(
            url,
            poolclass=NullPool,
            connect_args={
                "application_name": process_name(kind),
                "keepalives": 1,
                "keepalives_idle": 5,
                "keepalives_interval": 2,
                "keepalives_count": 3,
            },
        )
        self._conn: Connection | None = None
        self.backend_pid = 0
        #: Partitions whose lock this session holds.
        self.owned: set[int] = set()

    # --- the session ------------------------------------------------------------

    def open(self) -> None:
        """Connect and join as a member (a fresh session owns nothing)."""
        self.close()
        with self._guard():
            self._conn = self._engine.connect()
            self.backend_pid = int(str(self._scalar("SELECT pg_backend_pid()")))
            self._scalar(_LOCK, c=self._members, p=self.backend_pid)
        self.owned = set()

    def close(self) -> None:
        """End the session: Postgres frees every lock it held."""
        conn, self._conn = self._conn, None
        self.owned = set()
        if conn is not None:
            try:
                conn.close()
            except Exception:  # already broken: nothing to give back
                log.debug("owner session: close failed", exc_info=True)

    @property
    def is_open(self) -> bool:
        return self._conn is not None

    def _scalar(self, sql: str, **params: object) -> object:
        assert self._conn is not None, "the owner session is not open"
        value = self._conn.execute(text(sql), params).one()[0]
        # Session locks outlive transactions: commit so the session never idles in one.
        self._conn.commit()
        return value

    @contextmanager
    def _guard(self) -> Iterator[None]:
        """Any failure of the session loses everything it held."""
        try:
            yield
        except SQLAlchemyError as exc:
            self.close()
            raise OwnershipLost(
                f"Postgres (owner session): {getattr(exc, 'orig', None) or exc}"
            ) from exc

    # --- ownership ----------------------------------------------------------------

    def holders(self) -> Holders:
        with self._guard():
            assert self._conn is not None, "the owner session is not open"
            found = read_holders(self._conn, self.consumer, self.topic)
            self._conn.commit()
            return found

    def try_claim(self, partition: int) -> bool:
        """Take a partition's lock if nobody holds it."""
        with self._guard():
            got = bool(self._scalar(_TRY_LOCK, c=self._parts, p=partition))
        if got:
            self.owned.add(partition)
        return got

    def release(self, partition: int) -> None:
        """Give a partition back (its offsets saved first: the caller's duty)."""
        with self._guard():
            self._scalar(_UNLOCK, c=self._parts, p=partition)
        self.owned.discard(partition)

    def save(self, write: Callable[[Connection], None], partitions: set[int]) -> None:
        """Run ``write`` in one transaction on this session, after checking that the
        session still holds the lock of every partition in ``partitions``.

        The check and the writes commit together or not at all; a partition lost in
        between cannot be, since only the end of this very session frees its lock."""
        if self._conn is None:
            raise OwnershipLost("the owner session is closed: it holds no partition")
        with self._guard(), self._conn.begin():
            held = {int(p) for p in self._conn.execute(_HELD_HERE, {"parts": self._parts})
                    .scalars()}  # fmt: skip
            missing = partitions - held
            if missing:
                raise OwnershipLost(
                    f"the owner session no longer holds partitions {sorted(missing)}"
                )
            write(self._conn)
