"""Every read the operators' commands and the control plane make of the projections,
the log and its views, in one place.

Writers live beside their tables (``log``, ``projections``, ``billing``); this module
only selects. Each function takes an open connection, so a caller chooses the
transaction (and its isolation) and can read several of these in one snapshot.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection
from datetime import date, datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    ColumnElement,
    Connection,
    Date,
    DateTime,
    Numeric,
    Row,
    Select,
    Text,
    case,
    cast,
    column,
    func,
    literal,
    literal_column,
    select,
    table,
    text,
)

from app.db.tables import events, nodes, sandboxes
from app.domain.admission import Known
from app.domain.base import NodeState
from app.domain.requests import LEASE_LABEL
from app.domain.sandbox_state import LIVE, SandboxState

Record = dict[str, Any]
#: A result row of any shape (its columns read by attribute).
AnyRow = Row[*tuple[Any, ...]]

#: States of a sandbox that lived and ended (a rejected create never lived: its id
#: may be asked for again).
ENDED = (SandboxState.STOPPED, SandboxState.FAILED)

_LIVE = [state.value for state in LIVE]
_PENDING = [SandboxState.REQUESTED.value, SandboxState.SCHEDULED.value]

#: The ``audit_trail`` view (migration 0002): one row per event about a sandbox.
audit_trail = table(
    "audit_trail",
    column("position", BigInteger),
    column("occurred_at", DateTime(timezone=True)),
    column("tenant", Text),
    column("job_id", Text),
    column("sandbox_id", Text),
    column("node_id", Text),
    column("type", Text),
    column("actor", Text),
    column("action", Text),
    column("outcome", Text),
    column("detail", Text),
    column("denied", Boolean),
)

#: The ``billing_daily`` view: usage per tenant, job and UTC day.
billing_daily = table(
    "billing_daily",
    column("tenant", Text),
    column("job_id", Text),
    column("day", Date),
    column("sandboxes", BigInteger),
    column("sandbox_seconds", Numeric),
    column("core_seconds", Numeric),
    column("gb_seconds", Numeric),
    column("commands", BigInteger),
)

#: Column names of ``audit`` and ``bill`` rows, in order (CSV headers even with no rows).
AUDIT_COLUMNS = tuple(c.name for c in audit_trail.c)
BILL_COLUMNS = tuple(c.name for c in billing_daily.c)


def _equal(query: Select[Any], *filters: tuple[ColumnElement[Any], object]) -> Select[Any]:
    """``query`` narrowed to rows whose column equals each given value (None: any)."""
    for col, value in filters:
        if value is not None:
            query = query.where(col == value)
    return query


def _records(conn: Connection, query: Select[Any]) -> list[Record]:
    return [dict(r._mapping) for r in conn.execute(query)]


# --- audit and billing (the views) ------------------------------------------------


def audit(
    conn: Connection,
    sandbox_id: str | None = None,
    tenant: str | None = None,
    job_id: str | None = None,
    since: datetime | None = None,
    limit: int = 100,
    denied: bool = False,
) -> list[Record]:
    """The latest ``limit`` audit rows matching the filters, oldest first (like ``tail``);
    with ``denied``, only refusals of the sender (unauthenticated, forbidden, replays)."""
    t = audit_trail
    query = select(t).order_by(t.c.position.desc()).limit(limit)
    if denied:
        query = query.where(t.c.denied)
    query = _equal(query, (t.c.sandbox_id, sandbox_id), (t.c.tenant, tenant), (t.c.job_id, job_id))
    if since is not None:
        query = query.where(t.c.occurred_at >= since)
    return _records(conn, query)[::-1]


def bill(
    conn: Connection,
    tenant: str | None = None,
    job_id: str | None = None,
    day_from: date | None = None,
    day_to: date | None = None,
) -> list[Record]:
    """Daily usage rows (UTC days, ``day_to`` included), by day, tenant and job."""
    t = billing_daily
    query = select(t).order_by(t.c.day, t.c.tenant, t.c.job_id)
    query = _equal(query, (t.c.tenant, tenant), (t.c.job_id, job_id))
    if day_from is not None:
        query = query.where(t.c.day >= day_from)
    if day_to is not None:
        query = query.where(t.c.day <= day_to)
    return _records(conn, query)


# A job's bill straight from the raw log, the way an operator would write it in psql
# (the demo prints it beside its own tally).
_JOB_BILL = text(
    """
    WITH lives AS (
        SELECT sandbox_id,
               min(occurred_at) FILTER (WHERE type = 'SandboxStarted') AS started,
               max(occurred_at) FILTER (WHERE type = 'SandboxStopped') AS stopped,
               count(*) FILTER (WHERE type = 'CommandCompleted') AS commands
        FROM events
        WHERE tenant = :tenant AND job_id = :job AND sandbox_id IS NOT NULL
        GROUP BY sandbox_id
    )
    SELECT count(*) FILTER (WHERE started IS NOT NULL) AS sandboxes,
           round(sum(extract(epoch FROM coalesce(stopped, now()) - started))::numeric, 3)
               AS sandbox_seconds,
           sum(commands) AS commands,
           (SELECT count(*) FROM events
            WHERE tenant = :tenant AND job_id = :job AND type = 'SandboxStopped') AS stopped
    FROM lives
    """
)


def job_bill(conn: Connection, tenant: str, job_id: str) -> AnyRow:
    """One job's sandboxes, sandbox-seconds, commands and stopped sandboxes, from the log."""
    return conn.execute(_JOB_BILL, {"tenant": tenant, "job": job_id}).one()


# --- sandboxes and their log --------------------------------------------------------


def sandbox_list(
    conn: Connection,
    *,
    include_ended: bool = False,
    tenant: str = "",
    job_id: str = "",
    limit: int = 50,
) -> list[Record]:
    """Sandboxes, newest first: live ones only unless ``include_ended``."""
    t = sandboxes
    query: Select[Any] = (
        select(
            t.c.sandbox_id,
            t.c.tenant,
            t.c.job_id,
            t.c.image,
            t.c.node_id,
            t.c.state,
            case(
                (t.c.egress.isnot(None), cast(t.c.egress, Text)),
                (t.c.network.is_(True), literal("any")),
                else_=literal("none"),
            ).label("network"),
            t.c.started_at,
            t.c.ended_at,
            t.c.end_reason,
            t.c.commands,
        )
        .order_by(t.c.requested_at.desc().nulls_last())
        .limit(limit)
    )
    if not include_ended:
        query = query.where(t.c.state.in_(_LIVE))
    query = _equal(query, (t.c.tenant, tenant or None), (t.c.job_id, job_id or None))
    return _records(conn, query)


def sandbox_detail(conn: Connection, sandbox_id: str) -> Record | None:
    """One sandbox's row, with what its events add: how many there are, the image
    content it ran (a tenant's image), the ports it opened and, once it ended, the
    last state its node reported (None: unknown)."""
    row = conn.execute(select(sandboxes).where(sandboxes.c.sandbox_id == sandbox_id)).first()
    if row is None:
        return None
    found: Record = dict(row._mapping)
    t = events
    found["events"] = conn.execute(
        select(func.count()).select_from(t).where(t.c.sandbox_id == sandbox_id)
    ).scalar_one()
    found["ports"] = [
        {"port": p["port"], "expires_at": p["expires_at"], "by": p["actor"]}
        for (p,) in conn.execute(
            select(t.c.payload)
            .where(t.c.sandbox_id == sandbox_id, t.c.type == "PortExposed")
            .order_by(t.c.position)
        )
    ]
    found["image_digest"] = conn.execute(
        select(t.c.payload["image_digest"].astext)
        .where(t.c.sandbox_id == sandbox_id, t.c.type == "SandboxStarted")
        .limit(1)
    ).scalar()
    found["last_state"] = conn.execute(
        select(t.c.payload["last_state"])
        .where(t.c.sandbox_id == sandbox_id, t.c.type == "SandboxStopped")
        .order_by(t.c.position.desc())
        .limit(1)
    ).scalar()
    return found


def sandbox_events(conn: Connection, sandbox_id: str) -> list[Record]:
    """The log of one sandbox, in order."""
    t = events
    query = (
        select(t.c.position, t.c.occurred_at, t.c.type, t.c.node_id, t.c.payload)
        .where(t.c.sandbox_id == sandbox_id)
        .order_by(t.c.position)
    )
    return _records(conn, query)


def sandbox_owner(conn: Connection, sandbox_id: str) -> tuple[str, str] | None:
    """(tenant, job) of a sandbox, or None if the projection does not know it."""
    query = select(sandboxes.c.tenant, sandboxes.c.job_id).where(
        sandboxes.c.sandbox_id == sandbox_id
    )
    row = conn.execute(query).first()
    return None if row is None else (row.tenant, row.job_id)


def live_sandboxes(conn: Connection) -> list[AnyRow]:
    """Every live sandbox's projection row."""
    return list(conn.execute(select(sandboxes).where(sandboxes.c.state.in_(_LIVE))).all())


def ended_among(conn: Connection, ids: Collection[str]) -> list[AnyRow]:
    """(sandbox_id, end_reason, tenant) of those of ``ids`` that lived and ended."""
    query = select(sandboxes.c.sandbox_id, sandboxes.c.end_reason, sandboxes.c.tenant).where(
        sandboxes.c.sandbox_id.in_(ids), sandboxes.c.state.in_([s.value for s in ENDED])
    )
    return list(conn.execute(query).all())


# By primary key: one probe per id, whatever the table's size (ANY of one array
# parameter: a batch names hundreds of sandboxes).
_ADMISSION_FACTS = text(
    "SELECT sandbox_id, node_id, state FROM sandboxes WHERE sandbox_id = ANY(:ids)"
)
_LOGGED_IDS = text("SELECT event_id FROM event_ids WHERE event_id = ANY(:ids)")


def admission_facts(conn: Connection, ids: Collection[str]) -> dict[str, Known]:
    """What the log holds of each of ``ids`` that the projector's admission rules read
    (:mod:`app.domain.admission`): where it was placed, and whether it ended."""
    ended = {s.value for s in ENDED}
    rows = conn.execute(_ADMISSION_FACTS, {"ids": sorted(ids)})
    return {r.sandbox_id: Known(placed_on=r.node_id, ended=r.state in ended) for r in rows}


def logged_ids(conn: Connection, ids: Collection[uuid.UUID]) -> set[uuid.UUID]:
    """Those of ``ids`` the log holds already."""
    return set(conn.execute(_LOGGED_IDS, {"ids": list(ids)}).scalars())


# Sandboxes whose last freeze-or-thaw in the log is a freeze, and since when.
_FROZEN_NOW = text(
    """
    SELECT sandbox_id, occurred_at FROM (
        SELECT DISTINCT ON (sandbox_id) sandbox_id, type, occurred_at FROM events
        WHERE sandbox_id = ANY(:ids) AND type IN ('SandboxFrozen', 'SandboxThawed')
        ORDER BY sandbox_id, position DESC
    ) AS last WHERE type = 'SandboxFrozen'
    """
)
# The create request behind each sandbox (a redelivered create is a no-op).
_CREATED_BY = text(
    """
    SELECT sandbox_id, (payload->>'request_id')::uuid AS request_id FROM events
    WHERE sandbox_id = ANY(:ids) AND type = 'SandboxRequested'
    """
)


def frozen_now(conn: Connection, ids: list[str]) -> dict[str, datetime]:
    """Those of ``ids`` that a freeze left frozen (the log's last word on them), with
    the time of that freeze."""
    return {r.sandbox_id: r.occurred_at for r in conn.execute(_FROZEN_NOW, {"ids": ids})}


def created_by(conn: Connection, ids: list[str]) -> dict[str, uuid.UUID]:
    """The create request behind each of ``ids``."""
    return {r.sandbox_id: r.request_id for r in conn.execute(_CREATED_BY, {"ids": ids})}


# --- nodes and load -----------------------------------------------------------------


def alive_nodes(conn: Connection) -> list[AnyRow]:
    """The projection rows of the nodes the log last saw alive."""
    return list(conn.execute(select(nodes).where(nodes.c.state == NodeState.ALIVE)).all())


# Live sandboxes on nodes the log shows lost, with what dates the node's last word on
# each: its last heartbeat, the sandbox's start, its last command (commands by sandbox).
_LIVES_ON_LOST_NODES = text(
    f"""
    SELECT s.sandbox_id, s.tenant, s.job_id, s.node_id, s.requested_at, s.started_at,
           n.last_heartbeat_at, n.lost_at,
           (SELECT max(c.occurred_at) FROM commands c WHERE c.sandbox_id = s.sandbox_id)
               AS last_command_at
      FROM sandboxes s JOIN nodes n ON n.node_id = s.node_id
     WHERE n.state = '{NodeState.LOST.value}' AND s.state IN ({", ".join(f"'{v}'" for v in _LIVE)})
     ORDER BY s.node_id, s.sandbox_id
    """
)


def lives_on_lost_nodes(conn: Connection) -> list[AnyRow]:
    """The live sandboxes on nodes the log shows lost, each with its node's last
    heartbeat and loss, its start and its last command's time."""
    return list(conn.execute(_LIVES_ON_LOST_NODES).all())


def lost_nodes(conn: Connection) -> list[AnyRow]:
    """The projection rows of the nodes the log last saw declared lost."""
    return list(conn.execute(select(nodes).where(nodes.c.state == NodeState.LOST)).all())


def node_heartbeat(conn: Connection, node_id: str) -> datetime | None:
    """When an alive node's heartbeat last reached the projection (None: not alive)."""
    query = select(nodes.c.last_heartbeat_at).where(
        nodes.c.node_id == node_id, nodes.c.state == NodeState.ALIVE
    )
    seen: datetime | None = conn.execute(query).scalar()
    return seen


def _load_columns() -> tuple[Any, Any]:
    running = func.count().filter(sandboxes.c.state == SandboxState.RUNNING.value)
    pending = func.count().filter(sandboxes.c.state.in_(_PENDING))
    return running.label("running"), pending.label("pending")


def load_per_node(conn: Connection) -> dict[str | None, AnyRow]:
    """Live sandboxes per node: running, pending, cpus and memory reserved (the key
    None gathers sandboxes not placed yet)."""
    s = sandboxes
    running, pending = _load_columns()
    query = (
        select(
            s.c.node_id,
            running,
            pending,
            func.sum(s.c.cpus).label("cpus"),
            func.sum(s.c.memory_mb).label("memory_mb"),
        )
        .where(s.c.state.in_(_LIVE))
        .group_by(s.c.node_id)
    )
    return {row.node_id: row for row in conn.execute(query)}


def nodes_overview(conn: Connection) -> list[AnyRow]:
    """Every node with its state, reported load, capacity, heartbeat age and images."""
    n = nodes
    heartbeat_age = func.extract("epoch", func.now() - n.c.last_heartbeat_at)
    query = select(
        n.c.node_id,
        n.c.state,
        n.c.running,
        n.c.capacity_sandboxes,
        n.c.capacity_cpus,
        n.c.capacity_memory_mb,
        heartbeat_age.label("heartbeat_age_s"),
        func.jsonb_array_length(n.c.images).label("images"),
    ).order_by(n.c.node_id)
    return list(conn.execute(query).all())


def load_per_tenant(conn: Connection) -> list[AnyRow]:
    """Live sandboxes per tenant (jobs, running, pending), busiest first."""
    s = sandboxes
    running, pending = _load_columns()
    query = (
        select(s.c.tenant, func.count(s.c.job_id.distinct()).label("jobs"), running, pending)
        .where(s.c.state.in_(_LIVE))
        .group_by(s.c.tenant)
        .order_by(literal_column("running").desc(), s.c.tenant)
    )
    return list(conn.execute(query).all())


# --- the invariants of lives (dsec doctor) ------------------------------------------

_IN_LIVE = ", ".join(f"'{v}'" for v in _LIVE)
# Every open life with what dates its deadline (app/domain/lives.py).
_OPEN_LIVES = text(
    f"""
    SELECT s.sandbox_id, s.tenant, s.job_id, s.node_id, s.state, s.requested_at,
           s.started_at, s.ttl_s, coalesce(s.labels ? '{LEASE_LABEL}', false) AS leased,
           CASE WHEN n.state = '{NodeState.LOST.value}' THEN n.lost_at END AS node_lost_at
      FROM sandboxes s LEFT JOIN nodes n ON n.node_id = s.node_id
     WHERE s.state IN ({_IN_LIVE})
     ORDER BY s.sandbox_id
    """
)
# The sandboxes a freeze left frozen, and since when: freezes are few, so they are
# found by type (the log's type index), not by probing every open life.
_FROZEN_LIVES = text(
    """
    SELECT sandbox_id, occurred_at FROM (
        SELECT DISTINCT ON (sandbox_id) sandbox_id, type, occurred_at FROM events
        WHERE type IN ('SandboxFrozen', 'SandboxThawed') AND sandbox_id IS NOT NULL
        ORDER BY sandbox_id, position DESC
    ) AS last WHERE type = 'SandboxFrozen'
    """
)
# Lives with more than one end in the log since a time (ends: a SandboxStopped, or a
# SandboxFailed of the create), with their reasons in log order.
_ENDED_TWICE = text(
    """
    SELECT sandbox_id, min(tenant) AS tenant, count(*) AS ends, min(occurred_at) AS first_at,
           string_agg(type || ':' || coalesce(payload->>'reason', ''), ', ' ORDER BY position)
               AS reasons
      FROM events
     WHERE occurred_at >= :since AND sandbox_id IS NOT NULL
       AND (type = 'SandboxStopped'
            OR (type = 'SandboxFailed' AND payload->>'request_type' = 'CreateSandbox'))
     GROUP BY sandbox_id HAVING count(*) > 1
     ORDER BY min(occurred_at), sandbox_id
    """
)
# Nodes the log shows lost before a time that still hold open lives.
_LOST_WITH_LIVES = text(
    f"""
    SELECT n.node_id, n.lost_at, count(*) AS lives
      FROM nodes n JOIN sandboxes s ON s.node_id = n.node_id
     WHERE n.state = '{NodeState.LOST.value}' AND n.lost_at < :before
       AND s.state IN ({_IN_LIVE})
     GROUP BY n.node_id, n.lost_at
     ORDER BY n.lost_at, n.node_id
    """
)


def open_lives(conn: Connection) -> list[AnyRow]:
    """Every life the projections hold open, with its request, start, TTL, lease and
    its node's loss (if the node is lost)."""
    return list(conn.execute(_OPEN_LIVES).all())


def frozen_lives(conn: Connection) -> dict[str, datetime]:
    """Every sandbox a freeze left frozen (the log's last word on it), with since when."""
    return {r.sandbox_id: r.occurred_at for r in conn.execute(_FROZEN_LIVES)}


def ended_twice(conn: Connection, since: datetime) -> list[AnyRow]:
    """Sandboxes whose life the log ends more than once, among ends since ``since``."""
    return list(conn.execute(_ENDED_TWICE, {"since": since}).all())


def lost_nodes_with_open_lives(conn: Connection, before: datetime) -> list[AnyRow]:
    """Nodes declared lost before ``before`` that still hold open lives (how many)."""
    return list(conn.execute(_LOST_WITH_LIVES, {"before": before}).all())
