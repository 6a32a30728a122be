"""What breaks the invariants every life rests on, found in the log and the projections
(``dsec doctor``).

Billing and capacity both rest on one invariant: every sandbox that was requested ends
exactly once in the log, and soon after the platform stops being able to serve it.
Four checks, each a kind of :class:`Finding`:

- ``overdue``: a life open past its deadline (:mod:`app.domain.lives`) by more than a
  grace (the time its owner may take: a heartbeat round, a sweep);
- ``ended_twice``: a life the log ends more than once (among ends since a time);
- ``lost_node_open``: a node declared lost (more than the grace ago) that still holds
  open lives;
- ``rebuild_differs``: a projection whose rows differ from a rebuild from the log.

Reads only; the rebuild runs in a transaction rolled back after (the projector waits
for it: on a big log, skip it and run ``dsec projections rebuild --check`` when quiet).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from sqlalchemy import text

from app.config import Settings
from app.db import projections, queries
from app.db.engine import engine_for, transaction
from app.domain.base import utcnow
from app.domain.lives import OpenLife, Terms, overdue


class Check(StrEnum):
    """What a finding breaks."""

    OVERDUE = "overdue"
    ENDED_TWICE = "ended_twice"
    LOST_NODE_OPEN = "lost_node_open"
    REBUILD_DIFFERS = "rebuild_differs"


#: Column names of a finding's row, in order.
COLUMNS = ("check", "subject", "tenant", "since", "detail")


@dataclass(frozen=True)
class Finding:
    """One thing that breaks an invariant."""

    check: Check
    #: A sandbox, a node, or a projection table.
    subject: str
    detail: str
    tenant: str | None = None
    #: Since when it is so: the deadline passed, the first end, the node's loss.
    since: datetime | None = None

    @property
    def key(self) -> tuple[str, str]:
        """What it is about (the same finding found twice has one key)."""
        return self.check.value, self.subject

    def row(self) -> dict[str, Any]:
        """As a row to print, its columns in :data:`COLUMNS` order."""
        fields = {**asdict(self), "check": self.check.value}
        return {name: fields[name] for name in COLUMNS}


@dataclass(frozen=True)
class RebuildCheck:
    """The projections as they stand and as a rebuild from the log makes them."""

    folded: int
    live: frozenset[tuple[object, ...]]
    rebuilt: frozenset[tuple[object, ...]]

    @property
    def differing(self) -> frozenset[tuple[object, ...]]:
        """The rows only one side holds (each row starts with its table's name)."""
        return self.live ^ self.rebuilt


def check_rebuild(url: str) -> RebuildCheck:
    """Rebuild every projection from the log in a transaction rolled back after, and
    compare with the live rows: nothing changes. The projector waits meanwhile (the
    projections are locked), so this costs what a rebuild costs: mind it on a big log."""
    with engine_for(url).connect() as conn, conn.begin() as tx:
        projections.lock(conn)
        live = frozenset(projections.snapshot(conn))
        folded = projections.rebuild(conn)
        rebuilt = frozenset(projections.snapshot(conn))
        tx.rollback()
    return RebuildCheck(folded, live, rebuilt)


def _open_lives(rows: Iterable[Any], frozen: dict[str, datetime]) -> list[OpenLife]:
    return [
        OpenLife(
            r.sandbox_id, r.tenant, r.job_id, r.node_id, r.requested_at,
            scheduled=r.state != "requested", started_at=r.started_at, ttl_s=r.ttl_s,
            frozen_at=frozen.get(r.sandbox_id), leased=bool(r.leased),
            node_lost_at=r.node_lost_at,
        )
        for r in rows
    ]  # fmt: skip


def lives(
    settings: Settings, since: datetime, grace: timedelta, now: datetime | None = None
) -> list[Finding]:
    """The findings about lives (every check but the rebuild), read in one snapshot."""
    now = now or utcnow()
    with transaction(settings.database_url) as conn:
        conn.execute(text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ"))
        open_rows = queries.open_lives(conn)
        frozen = queries.frozen_lives(conn)
        twice = queries.ended_twice(conn, since)
        lost = queries.lost_nodes_with_open_lives(conn, now - grace)
    found = [
        Finding(
            Check.OVERDUE, life.sandbox_id,
            f"{deadline.state.value} past its deadline ({deadline.reason.value}, kept by"
            f" {deadline.owner.value}){f' on {life.node_id}' if life.node_id else ''}",
            life.tenant, deadline.at,
        )
        for life, deadline in overdue(_open_lives(open_rows, frozen), now, Terms.of(settings),
                                      grace)
    ]  # fmt: skip
    found += [
        Finding(Check.ENDED_TWICE, r.sandbox_id, f"{r.ends} ends: {r.reasons}", r.tenant,
                r.first_at)
        for r in twice
    ]  # fmt: skip
    found += [
        Finding(Check.LOST_NODE_OPEN, r.node_id, f"declared lost with {r.lives} open lives",
                None, r.lost_at)
        for r in lost
    ]  # fmt: skip
    return found


def rebuild(settings: Settings) -> list[Finding]:
    """One finding per projection whose rows differ from a rebuild from the log."""
    check = check_rebuild(settings.database_url)
    tables = Counter(str(row[0]) for row in check.differing)
    return [
        Finding(
            Check.REBUILD_DIFFERS, table,
            f"{n} rows differ from a rebuild of {check.folded} events"
            " (`dsec projections rebuild --check` lists them)",
        )
        for table, n in sorted(tables.items())
    ]  # fmt: skip


def examine(
    settings: Settings,
    since: datetime,
    grace: timedelta,
    *,
    with_rebuild: bool = True,
    now: datetime | None = None,
) -> list[Finding]:
    """Every finding: lives, and (unless told not to) the projections against a rebuild."""
    found = lives(settings, since, grace, now)
    if with_rebuild:
        found += rebuild(settings)
    return found
