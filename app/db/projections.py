"""Projections: read models folded from the log, in the log's own transaction.

A batch of events is first folded in memory (pure code, per sandbox, node and
tenant/job), then written with one set-based statement per table. The live projector
and ``dsec projections rebuild`` run exactly this code over events in position order,
so a rebuild yields the same rows however the events were batched: columns take the
latest value, states only move forward, and counters and sums are exact (integers
and numerics, never floats). The commands projection is the exception to the
folding: its rows are the CommandCompleted events themselves, made in Postgres by
:func:`commands_from`, as the log appends them (live) or reads them (rebuild).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, func, select, text
from sqlalchemy.dialects.postgresql import insert

from app.db import billing, staging
from app.db.fold import fold
from app.db.tables import (
    commands,
    lives,
    nodes,
    projection_version,
    running_usage,
    sandboxes,
    usage,
    usage_daily,
)
from app.domain.events import (
    Event,
)
from app.domain.sandbox_state import ENDED, SandboxState, rank

PROJECTION_TABLES = (sandboxes, nodes, commands, usage, lives, usage_daily, running_usage)
#: The projections that hold history the log may no longer hold (see :func:`rebuild`).
BILLING_TABLES = (lives, usage_daily, running_usage)

#: The version of the rules here and in :mod:`app.db.fold`. Raise it with any change
#: to what a projection holds for a given log: a projector that finds another version
#: recorded rebuilds every projection from the log before it folds anything new
#: (:func:`ensure_current`).
VERSION = 8
_VERSION_ROW = "projections"

#: The sandbox columns that lifecycle events set, with their Postgres types.
_SANDBOX_COLUMN_TYPES = (
    ("actor", "text"), ("image", "text"), ("node_id", "text"), ("cpus", "float8"),
    ("memory_mb", "int4"), ("disk_mb", "int4"), ("ttl_s", "int4"), ("network", "bool"),
    ("egress", "jsonb"), ("labels", "jsonb"), ("requested_at", "timestamptz"),
    ("scheduled_at", "timestamptz"), ("started_at", "timestamptz"), ("ended_at", "timestamptz"),
    ("end_reason", "text"), ("detail", "text"),
)  # fmt: skip
SANDBOX_COLUMNS = tuple(name for name, _ in _SANDBOX_COLUMN_TYPES)

#: A batch's sandbox rows, COPYed for :data:`_UPSERT_SANDBOXES` (see app.db.staging).
SANDBOX_STAGE = staging.stage(
    "sandbox_stage",
    [("sandbox_id", "text"), ("tenant", "text"), ("job_id", "text"), ("state", "text"),
     ("commands", "int4"), ("last_position", "int8"), *_SANDBOX_COLUMN_TYPES],
)  # fmt: skip


_RANK_CASE = "CASE {col} " + " ".join(f"WHEN '{s.value}' THEN {rank(s)}" for s in SandboxState)
_COLS = ", ".join(SANDBOX_COLUMNS)
_ENDED = "s.state IN (" + ", ".join(f"'{t.value}'" for t in sorted(ENDED)) + ")"
_REJECTED = SandboxState.REJECTED.value
#: A refused id that lives now: its row starts over, whose it is included.
_ANEW = f"s.state = '{_REJECTED}' AND excluded.state <> '{_REJECTED}'"

# The sandboxes upsert reads the batch's rows from its COPYed stage; the smaller
# statements take theirs as ONE json parameter that Postgres unpacks: binding
# thousands of parameters from Python costs more than the statements themselves.
_UPSERT_SANDBOXES = text(
    f"""
    WITH staged AS (DELETE FROM sandbox_stage RETURNING *)
    INSERT INTO sandboxes AS s (sandbox_id, tenant, job_id, state, commands, last_position, {_COLS})
    SELECT sandbox_id, tenant, job_id, state, commands, last_position, {_COLS}
    FROM staged
    ON CONFLICT (sandbox_id) DO UPDATE SET
        tenant = CASE WHEN {_ANEW} THEN excluded.tenant ELSE s.tenant END,
        job_id = CASE WHEN {_ANEW} THEN excluded.job_id ELSE s.job_id END,
        state = CASE WHEN {_ENDED} THEN s.state
                     WHEN excluded.state = '{_REJECTED}' THEN s.state
                     WHEN s.state = '{_REJECTED}' THEN excluded.state
                     WHEN ({_RANK_CASE.format(col="s.state")} END)
                       <= ({_RANK_CASE.format(col="excluded.state")} END)
                     THEN excluded.state ELSE s.state END,
        commands = s.commands + excluded.commands,
        last_position = CASE WHEN {_ENDED} THEN s.last_position
                             ELSE greatest(s.last_position, excluded.last_position) END,
        {
        ", ".join(
            f"{c} = CASE WHEN {_ENDED} THEN s.{c}"
            f" WHEN excluded.state = '{_REJECTED}' AND s.state <> '{_REJECTED}' THEN s.{c}"
            f" WHEN {_ANEW} THEN excluded.{c}"
            f" ELSE coalesce(excluded.{c}, s.{c}) END"
            for c in SANDBOX_COLUMNS
        )
    }
    """
)
# Commands of a sandbox whose row an earlier batch made (none: nothing to count).
_COUNT_COMMANDS = text(
    f"""
    UPDATE sandboxes AS s SET commands = s.commands + r.commands,
                              last_position = CASE WHEN {_ENDED} THEN s.last_position
                                  ELSE greatest(s.last_position, r.last_position) END
    FROM jsonb_to_recordset(CAST(:rows AS jsonb))
         AS r(sandbox_id text, commands int, last_position bigint)
    WHERE s.sandbox_id = r.sandbox_id
    """
)
#: The commands projection's columns, as :func:`commands_from` fills them.
_COMMAND_COLUMNS = (
    "request_id, sandbox_id, tenant, job_id, actor, trajectory_id, step, command, exit_code,"
    " duration_ms, timed_out, truncated, stdout_head, stderr_head, occurred_at, position,"
    " stdout_b64, stderr_b64"
)


def commands_from(relation: str) -> str:
    """The INSERT that projects the CommandCompleted events of ``relation`` into ``commands``.

    ``relation`` has the log's columns (a CTE over rows being appended, or the log
    itself). The rows are made in Postgres from the stored payload, whose keys are the
    columns' names: they never travel to Python and back (that cost ~12 us of Postgres
    and ~4 us of Python per command as one json parameter). In position order, so that
    of two events claiming one trajectory step the first one is kept, live or rebuilt.
    """
    return f"""
    INSERT INTO commands ({_COMMAND_COLUMNS})
    SELECT r.request_id, e.sandbox_id, e.tenant, e.job_id, r.actor, r.trajectory_id, r.step,
           r.command, r.exit_code, r.duration_ms, r.timed_out, r.truncated, r.stdout_head,
           r.stderr_head, e.occurred_at, e.position, r.stdout_b64, r.stderr_b64
    FROM {relation} AS e
    CROSS JOIN LATERAL jsonb_populate_record(NULL::commands, e.payload) AS r
    WHERE e.type = 'CommandCompleted'
    ORDER BY e.position
    ON CONFLICT DO NOTHING
    """


_REBUILD_COMMANDS = text(
    commands_from("(SELECT * FROM events WHERE position > :after AND position <= :last)")
)
_ADD_USAGE = text(
    """
    INSERT INTO usage AS u (tenant, job_id, sandboxes_started, commands, last_position)
    SELECT tenant, job_id, started, commands, last_position
    FROM jsonb_to_recordset(CAST(:rows AS jsonb))
         AS r(tenant text, job_id text, started int, commands int, last_position bigint)
    ON CONFLICT (tenant, job_id) DO UPDATE SET
        sandboxes_started = u.sandboxes_started + excluded.sandboxes_started,
        commands = u.commands + excluded.commands,
        last_position = greatest(u.last_position, excluded.last_position)
    """
)
# By primary key only, the state tested on the rows found: with a state condition and
# stale statistics the planner combined the state index with the key and read every
# stopped sandbox (7 ms a batch, growing with the table).
_ALREADY_STOPPED = text(
    "SELECT sandbox_id FROM (SELECT sandbox_id, state FROM sandboxes"
    " WHERE sandbox_id = ANY(:ids) OFFSET 0) AS found WHERE state = 'stopped'"
)
# Ended sandboxes are charged from their projected row (started_at, cpus, memory),
# which the sandboxes upsert above has just brought up to date.
_CHARGE_ENDED = text(
    """
    UPDATE usage AS u SET
        sandboxes_ended = u.sandboxes_ended + x.n,
        ended_sandbox_seconds = u.ended_sandbox_seconds + x.secs,
        ended_core_seconds = u.ended_core_seconds + x.core,
        ended_gb_seconds = u.ended_gb_seconds + x.gb
    FROM (
        SELECT tenant, job_id, count(*) AS n, sum(s) AS secs,
               sum(s * coalesce(cpus, 0)::numeric) AS core,
               sum(s * coalesce(memory_mb, 0) / 1024.0) AS gb
        FROM (SELECT tenant, job_id, cpus, memory_mb,
                     coalesce(extract(epoch FROM ended_at - started_at), 0) AS s
              FROM sandboxes WHERE sandbox_id = ANY(:ids)) AS lives
        GROUP BY tenant, job_id
    ) AS x
    WHERE u.tenant = x.tenant AND u.job_id = x.job_id
    """
)


def _rows(rows: list[dict[str, Any]]) -> str:
    return json.dumps(rows, default=str)


def apply_batch(
    conn: Connection, items: Sequence[tuple[Event, int]], with_billing: bool = True
) -> None:
    """Fold a batch of (event, position), ascending, into every projection but ``commands``.

    Those rows come from the log's rows themselves: :func:`app.db.log.append` inserts
    them with the events, :func:`rebuild` from the log. ``with_billing=False`` leaves
    the :data:`BILLING_TABLES` alone (a rebuild after archival).
    """
    if not items:
        return
    if with_billing:
        billing.apply(conn, items)
    folded = fold(items)
    lifecycle, counts = [], []
    for sid, f in sorted(folded.sandboxes.items()):
        if f.early_commands:
            counts.append(
                {"sandbox_id": sid, "commands": f.early_commands, "last_position": f.early_position}
            )
        if f.state is None:
            continue
        cols = f.columns
        lifecycle.append(
            (sid, f.tenant, f.job_id, f.state.value, f.commands, f.last_position,
             *[cols.get(c) for c in SANDBOX_COLUMNS])
        )  # fmt: skip
    # A sandbox is charged once, at its first Stopped: a second one (two parties
    # ending it at once) must count neither live nor in a rebuild, however batched.
    stopping = [sid for u in folded.usage.values() for sid in u.ended]
    already_ended: set[str] = set()
    if stopping:
        already_ended = set(
            conn.execute(_ALREADY_STOPPED, {"ids": sorted(set(stopping))}).scalars()
        )
    # Counts first: they are of rows made before this batch (see SandboxFold).
    if counts:
        conn.execute(_COUNT_COMMANDS, {"rows": _rows(counts)})
    if lifecycle:
        staging.copy_rows(conn, SANDBOX_STAGE, lifecycle)
        conn.execute(_UPSERT_SANDBOXES)
    for node_id, row in sorted(folded.nodes.items()):
        _upsert_node(conn, node_id, row)
    if folded.usage:
        usage_rows = [
            {"tenant": t, "job_id": j, "started": u.started, "commands": u.commands,
             "last_position": u.last_position}
            for (t, j), u in sorted(folded.usage.items())
        ]  # fmt: skip
        conn.execute(_ADD_USAGE, {"rows": _rows(usage_rows)})
        ended = {sid for u in folded.usage.values() for sid in u.ended}
        if ended:
            conn.execute(_CHARGE_ENDED, {"ids": sorted(ended - already_ended)})


def _upsert_node(conn: Connection, node_id: str, row: dict[str, Any]) -> None:
    existing = conn.execute(select(nodes.c.node_id).where(nodes.c.node_id == node_id)).first()
    if existing is None:
        if "queue" not in row:
            return  # lost before it was ever registered: nothing to show
        conn.execute(insert(nodes).values(node_id=node_id, **row))
    else:
        conn.execute(nodes.update().where(nodes.c.node_id == node_id).values(**row))


def clear(conn: Connection, with_billing: bool = True) -> None:
    """Empty every projection (before a rebuild); ``with_billing=False`` keeps the
    :data:`BILLING_TABLES`."""
    for table in PROJECTION_TABLES:
        if with_billing or table not in BILLING_TABLES:
            conn.execute(table.delete())


def snapshot(conn: Connection) -> list[tuple[object, ...]]:
    """Every projection row, ordered, for comparing a rebuild with the live state."""
    out: list[tuple[object, ...]] = []
    for table in PROJECTION_TABLES:
        keys = list(table.primary_key.columns)
        for row in conn.execute(select(table).order_by(*keys)):
            out.append((table.name, *(_hashable(v) for v in row)))
    return out


def _hashable(value: object) -> object:
    if isinstance(value, dict | list):
        return json.dumps(value, sort_keys=True)
    return value


def lock(conn: Connection) -> None:
    """Hold the projections still until the transaction ends (the projector waits)."""
    _lock_in_order(conn, "SHARE ROW EXCLUSIVE")


def lock_for_writing(conn: Connection) -> None:
    """Take the projector's write locks on every projection, in :func:`lock`'s order.

    A batch touches the tables in the order of its events; a rebuild or `dsec doctor`
    locking them all meanwhile, in its own order, deadlocked with it. Taken in one
    order up front (the mode conflicts with no other writer), neither can hold a table
    the other waits for while it waits for one the other holds.
    """
    _lock_in_order(conn, "ROW EXCLUSIVE")


def _lock_in_order(conn: Connection, mode: str) -> None:
    names = ", ".join(t.name for t in PROJECTION_TABLES)
    conn.execute(text(f"LOCK TABLE {names} IN {mode} MODE"))


def recorded_version(conn: Connection) -> int | None:
    """The version of the rules that built the projections, if one was recorded."""
    row = conn.execute(
        select(projection_version.c.version).where(projection_version.c.name == _VERSION_ROW)
    ).scalar()
    return None if row is None else int(row)


def ensure_current(conn: Connection) -> int | None:
    """Rebuild the projections if other rules built them; return the events folded then.

    Runs in the caller's transaction. The version row is locked first, so of several
    projectors starting at once one rebuilds and the others find it done. Returns
    None when the projections were current.
    """
    conn.execute(
        insert(projection_version)
        .values(name=_VERSION_ROW, version=0, events_folded=0)
        .on_conflict_do_nothing()
    )
    found = conn.execute(
        select(projection_version.c.version)
        .where(projection_version.c.name == _VERSION_ROW)
        .with_for_update()
    ).scalar()
    if found == VERSION:
        return None
    return rebuild(conn)


def _record_version(conn: Connection, folded: int) -> None:
    stmt = insert(projection_version).values(
        name=_VERSION_ROW, version=VERSION, rebuilt_at=func.now(), events_folded=folded
    )
    conn.execute(
        stmt.on_conflict_do_update(
            index_elements=["name"],
            set_={
                "version": stmt.excluded.version,
                "rebuilt_at": stmt.excluded.rebuilt_at,
                "events_folded": stmt.excluded.events_folded,
            },
        )
    )


def rebuild(conn: Connection, chunk: int = 5000) -> int:
    """Empty the projections and fold the whole log again; return events folded.

    The rules' :data:`VERSION` is recorded with the result. Runs in the caller's
    transaction, which first locks the projection tables so a
    live projector waits instead of interleaving its batch with the rebuild.

    Once days of the log were archived (``dsec log archive``), the log no longer holds
    the lives and bills of those days: the :data:`BILLING_TABLES` are then kept as
    they are, not rebuilt, and ``dsec bill --verify`` checks them against the days
    the log still holds.
    """
    from app.db.tables import events
    from app.domain.codec import decode_event

    lock(conn)
    with_billing = not billing.archived(conn)
    clear(conn, with_billing)
    total, after = 0, 0
    while True:
        rows = conn.execute(
            select(events.c.position, events.c.type, events.c.event_id, events.c.version,
                   events.c.sandbox_id, events.c.node_id, events.c.tenant, events.c.job_id,
                   events.c.occurred_at, events.c.payload)
            .where(events.c.position > after)
            .order_by(events.c.position)
            .limit(chunk)
        ).all()  # fmt: skip
        if not rows:
            _record_version(conn, total)
            return total
        items = []
        for r in rows:
            body = {
                "event_id": str(r.event_id), "type": r.type, "version": r.version,
                "sandbox_id": r.sandbox_id, "node_id": r.node_id, "tenant": r.tenant,
                "job_id": r.job_id, "occurred_at": r.occurred_at.isoformat(),
                "payload": r.payload,
            }  # fmt: skip
            items.append((decode_event(json.dumps(body).encode(), max_bytes=1 << 30), r.position))
        apply_batch(conn, items, with_billing)
        conn.execute(_REBUILD_COMMANDS, {"after": after, "last": rows[-1].position})
        total += len(rows)
        after = rows[-1].position
