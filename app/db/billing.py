"""The billing projections: ``lives``, ``usage_daily`` and ``running_usage``, and
their check.

``billing_daily`` and ``sandbox_lives`` (migrations 0009, 0011) read these instead of
the whole log, so a bill costs what the period asked for, not what the platform's
history holds nor how many sandboxes run. Their rules are the raw views'
(``billing_daily_from_log``, ``sandbox_lives_from_log``), restated as a fold:

- a sandbox's first ``SandboxRequested`` gives its actor, image, cpus and memory, its
  first ``SandboxStarted`` its tenant, job, node and start, its first
  ``SandboxStopped`` its end: later ones (a replay, a second party ending it) change
  nothing, however the events were batched;
- when a life has both a start and an end for the first time, it is cut into UTC
  day pieces by ``dsec_utc_day_pieces`` (the view's own function and expressions) and
  the pieces are added to ``usage_daily``;
- while it has a start and no end, it counts in ``running_usage`` (per tenant, job,
  UTC start day and shape: the lives and the sum of their starts), which the view
  cuts into days at query time, one row per group;
- commands are counted per (tenant, job, UTC day of ``occurred_at``).

Sums are numerics and never rounded here (GB-seconds are kept as MiB-seconds and
divided once by the view), so the projections give the raw view's figures to the
last digit; :func:`differences` checks it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import Connection, exists, func, select, text

from app.db import staging
from app.db.tables import log_archives
from app.domain.events import (
    CommandCompleted,
    Event,
    SandboxRequested,
    SandboxStarted,
    SandboxStopped,
)

_REQUESTED, _STARTED, _STOPPED, _COMMAND = (
    cls.model_fields["type"].default
    for cls in (SandboxRequested, SandboxStarted, SandboxStopped, CommandCompleted)
)


@dataclass
class LifeFold:
    """What a batch says about one sandbox's life (first values win)."""

    tenant: str
    job_id: str
    node_id: str | None = None
    actor: str | None = None
    image: str | None = None
    cpus: Decimal | None = None
    memory_mb: int | None = None
    started_at: datetime | None = None
    ended_at: datetime | None = None
    end_reason: str | None = None
    end_detail: str | None = None
    last_position: int = 0


@dataclass
class BillingFold:
    """A batch folded per life and per (tenant, job, day) of commands."""

    lives: dict[str, LifeFold] = field(default_factory=dict)
    commands: dict[tuple[str, str, date], int] = field(default_factory=dict)


def fold(items: Sequence[tuple[Event, int]]) -> BillingFold:
    """Fold events (with their positions, ascending) into life rows and command counts."""
    out = BillingFold()
    for event, position in items:
        kind = event.type
        if kind == _COMMAND:
            key = (event.tenant, event.job_id, event.occurred_at.astimezone(UTC).date())
            out.commands[key] = out.commands.get(key, 0) + 1
            continue
        if kind not in (_REQUESTED, _STARTED, _STOPPED) or event.sandbox_id is None:
            continue
        life = out.lives.setdefault(event.sandbox_id, LifeFold(event.tenant, event.job_id))
        # The last lifecycle event of the sandbox, used or not: a position that moved
        # only with changes would depend on how the events were batched.
        life.last_position = position
        match event:
            case SandboxRequested(payload=p) if life.image is None:
                life.actor, life.image = p.actor, p.image
                life.cpus, life.memory_mb = Decimal(repr(p.cpus)), p.memory_mb
            case SandboxStarted() if life.started_at is None:
                life.tenant, life.job_id = event.tenant, event.job_id
                life.node_id, life.started_at = event.node_id, event.occurred_at
            case SandboxStopped(payload=p) if life.ended_at is None:
                life.ended_at, life.end_reason = event.occurred_at, p.reason.value
                life.end_detail = p.detail
    return out


_LIFE_COLUMNS = (
    ("sandbox_id", "text"), ("tenant", "text"), ("job_id", "text"), ("node_id", "text"),
    ("actor", "text"), ("image", "text"), ("cpus", "numeric"), ("memory_mb", "int4"),
    ("started_at", "timestamptz"), ("ended_at", "timestamptz"), ("end_reason", "text"),
    ("end_detail", "text"), ("last_position", "int8"),
)  # fmt: skip
LIFE_STAGE = staging.stage("life_stage", _LIFE_COLUMNS)
_COLS = ", ".join(name for name, _ in _LIFE_COLUMNS)

#: The pieces of ``relation``'s lives (tenant, job_id, cpus, memory_mb, started_at,
#: ended_at), with the raw view's expressions.
_PIECES = """
    SELECT e.tenant, e.job_id, p.day, 1 AS sandboxes, p.seconds,
           p.seconds * e.cpus AS core, p.seconds * e.memory_mb AS mb, 0 AS commands
      FROM {relation} e
      CROSS JOIN LATERAL dsec_utc_day_pieces(
          e.started_at AT TIME ZONE 'UTC',
          greatest(e.started_at, e.ended_at) AT TIME ZONE 'UTC') p
"""
#: Add grouped pieces to the rollup, rows in key order (two projector lanes that meet
#: on a row lock it in the same order). NULL sums stay NULL until a number comes, as
#: SQL's sum() does.
_ADD_TO_ROLLUP = """
INSERT INTO usage_daily AS u
       (tenant, job_id, day, sandboxes, sandbox_seconds, core_seconds, mb_seconds, commands)
SELECT tenant, job_id, day, sum(sandboxes), sum(seconds), sum(core), sum(mb), sum(commands)
  FROM pieces
 GROUP BY tenant, job_id, day
 ORDER BY tenant, job_id, day
ON CONFLICT (tenant, job_id, day) DO UPDATE SET
    sandboxes = u.sandboxes + excluded.sandboxes,
    sandbox_seconds = u.sandbox_seconds + excluded.sandbox_seconds,
    core_seconds = coalesce(u.core_seconds + excluded.core_seconds,
                            u.core_seconds, excluded.core_seconds),
    mb_seconds = coalesce(u.mb_seconds + excluded.mb_seconds, u.mb_seconds, excluded.mb_seconds),
    commands = u.commands + excluded.commands
"""

# One statement: the staged lives are upserted with first-wins rules, and those that
# have a start and an end for the first time (``was_ended`` reads the rows as they
# were before the statement) are cut into pieces and added with the batch's commands.
_UPSERT = text(
    f"""
    WITH staged AS (DELETE FROM life_stage RETURNING *),
    was AS (
        SELECT sandbox_id, tenant, job_id, cpus, memory_mb, started_at, ended_at FROM lives
         WHERE sandbox_id IN (SELECT sandbox_id FROM staged)
    ),
    was_ended AS (
        SELECT sandbox_id FROM was WHERE started_at IS NOT NULL AND ended_at IS NOT NULL
    ),
    up AS (
        INSERT INTO lives AS l ({_COLS})
        SELECT {_COLS} FROM staged
        ON CONFLICT (sandbox_id) DO UPDATE SET
            tenant = CASE WHEN l.started_at IS NULL AND excluded.started_at IS NOT NULL
                          THEN excluded.tenant ELSE l.tenant END,
            job_id = CASE WHEN l.started_at IS NULL AND excluded.started_at IS NOT NULL
                          THEN excluded.job_id ELSE l.job_id END,
            node_id = CASE WHEN l.started_at IS NULL AND excluded.started_at IS NOT NULL
                           THEN excluded.node_id ELSE l.node_id END,
            started_at = coalesce(l.started_at, excluded.started_at),
            actor = CASE WHEN l.image IS NULL THEN excluded.actor ELSE l.actor END,
            cpus = CASE WHEN l.image IS NULL THEN excluded.cpus ELSE l.cpus END,
            memory_mb = CASE WHEN l.image IS NULL THEN excluded.memory_mb ELSE l.memory_mb END,
            image = coalesce(l.image, excluded.image),
            end_reason = CASE WHEN l.ended_at IS NULL THEN excluded.end_reason
                              ELSE l.end_reason END,
            end_detail = CASE WHEN l.ended_at IS NULL THEN excluded.end_detail
                              ELSE l.end_detail END,
            ended_at = coalesce(l.ended_at, excluded.ended_at),
            last_position = greatest(l.last_position, excluded.last_position)
        RETURNING sandbox_id, tenant, job_id, cpus, memory_mb, started_at, ended_at
    ),
    -- A life counts in running_usage while it has a start and no end, under the key
    -- it had then: +1 as it is now, -1 as it was (a change of key while running, a
    -- request logged after the start, moves it).
    running_delta AS (
        SELECT tenant, job_id, (started_at AT TIME ZONE 'UTC')::date AS since, cpus,
               memory_mb, 1 AS n, extract(epoch FROM started_at) AS epoch
          FROM up WHERE started_at IS NOT NULL AND ended_at IS NULL
        UNION ALL
        SELECT tenant, job_id, (started_at AT TIME ZONE 'UTC')::date, cpus, memory_mb, -1,
               -extract(epoch FROM started_at)
          FROM was WHERE started_at IS NOT NULL AND ended_at IS NULL
    ),
    running_moved AS (
        INSERT INTO running_usage AS r
               (tenant, job_id, since, cpus, memory_mb, lives, started_epoch)
        SELECT tenant, job_id, since, cpus, memory_mb, sum(n), sum(epoch)
          FROM running_delta
         GROUP BY tenant, job_id, since, cpus, memory_mb
        HAVING sum(n) <> 0 OR sum(epoch) <> 0
         ORDER BY tenant, job_id, since, cpus, memory_mb
        ON CONFLICT ON CONSTRAINT running_usage_key DO UPDATE SET
            lives = r.lives + excluded.lives,
            started_epoch = r.started_epoch + excluded.started_epoch
        RETURNING 1
    ),
    ended AS (
        SELECT * FROM up
         WHERE started_at IS NOT NULL AND ended_at IS NOT NULL
           AND sandbox_id NOT IN (SELECT sandbox_id FROM was_ended)
    ),
    pieces AS (
        {_PIECES.format(relation="ended")}
        UNION ALL
        SELECT tenant, job_id, day, 0, 0, NULL, NULL, commands
          FROM jsonb_to_recordset(CAST(:commands AS jsonb))
               AS c(tenant text, job_id text, day date, commands bigint)
    )
    {_ADD_TO_ROLLUP}
    """
)


# Groups whose lives all ended (a partial index finds them; the table stays the size
# of what runs now).
_DROP_EMPTY = text("DELETE FROM running_usage WHERE lives = 0")


def apply(conn: Connection, items: Sequence[tuple[Event, int]]) -> None:
    """Fold a batch of (event, position), ascending, into ``lives``, ``usage_daily`` and
    ``running_usage``."""
    folded = fold(items)
    if not folded.lives and not folded.commands:
        return
    if folded.lives:
        staging.copy_rows(
            conn,
            LIFE_STAGE,
            [
                (sid, f.tenant, f.job_id, f.node_id, f.actor, f.image, f.cpus, f.memory_mb,
                 f.started_at, f.ended_at, f.end_reason, f.end_detail, f.last_position)
                for sid, f in sorted(folded.lives.items())
            ],
        )  # fmt: skip
    else:
        staging.ensure(conn, LIFE_STAGE)  # the upsert reads it, empty
    commands = [
        {"tenant": t, "job_id": j, "day": d.isoformat(), "commands": n}
        for (t, j, d), n in sorted(folded.commands.items())
    ]
    conn.execute(_UPSERT, {"commands": json.dumps(commands)})
    if folded.lives:
        conn.execute(_DROP_EMPTY)


def archived(conn: Connection) -> bool:
    """Whether days of the log were archived: then the log alone no longer holds the
    whole history these projections fold, and a rebuild keeps them as they are."""
    return bool(conn.execute(select(exists().select_from(log_archives))).scalar())


_OUT = log_archives.c.restored_at.is_(None)


def archived_between(conn: Connection, day_from: date, day_to: date) -> list[date]:
    """The archived days of the log within ``[day_from, day_to]`` (not restored)."""
    days = log_archives.c.day
    query = select(days).where(days.between(day_from, day_to), _OUT).order_by(days)
    return list(conn.execute(query).scalars())


def last_archived_day(conn: Connection) -> date | None:
    """The last archived (and not restored) day of the log, if any: an audit that
    finds nothing may be asking about a day that left Postgres."""
    return conn.execute(select(func.max(log_archives.c.day)).where(_OUT)).scalar()


#: The bill both ways for a period, full outer joined on (tenant, job, day): the rows
#: where the rollup and the raw log's view disagree in any column.
_DIFFERENCES = text(
    """
    WITH fast AS (SELECT * FROM billing_daily WHERE day BETWEEN :lo AND :hi
                     AND (tenant = :tenant OR :tenant IS NULL)
                     AND (job_id = :job OR :job IS NULL)),
         raw AS (SELECT * FROM billing_daily_from_log WHERE day BETWEEN :lo AND :hi
                    AND (tenant = :tenant OR :tenant IS NULL)
                    AND (job_id = :job OR :job IS NULL))
    SELECT coalesce(f.tenant, r.tenant) AS tenant, coalesce(f.job_id, r.job_id) AS job_id,
           coalesce(f.day, r.day) AS day,
           f.sandboxes AS rollup_sandboxes, r.sandboxes AS log_sandboxes,
           f.sandbox_seconds AS rollup_seconds, r.sandbox_seconds AS log_seconds,
           f.core_seconds AS rollup_core_seconds, r.core_seconds AS log_core_seconds,
           f.gb_seconds AS rollup_gb_seconds, r.gb_seconds AS log_gb_seconds,
           f.commands AS rollup_commands, r.commands AS log_commands
      FROM fast f
      FULL JOIN raw r ON (f.tenant, f.job_id, f.day) = (r.tenant, r.job_id, r.day)
     WHERE (f.sandboxes, f.sandbox_seconds, f.core_seconds, f.gb_seconds, f.commands)
           IS DISTINCT FROM
           (r.sandboxes, r.sandbox_seconds, r.core_seconds, r.gb_seconds, r.commands)
     ORDER BY 3, 1, 2
    """
)


def differences(
    conn: Connection,
    day_from: date,
    day_to: date,
    tenant: str | None = None,
    job_id: str | None = None,
) -> list[dict[str, Any]]:
    """Rows of the bill for ``[day_from, day_to]`` (of a tenant, a job) where the rollup
    and the raw log disagree.

    Both sides are read in one statement, so running lives are cut at the same now().
    The raw side costs what ``billing_daily_from_log`` costs: every life of the
    tenant (or of the whole log) is looked at, so narrow it on a big log.
    """
    params = {"lo": day_from, "hi": day_to, "tenant": tenant, "job": job_id}
    rows = conn.execute(_DIFFERENCES, params)
    return [dict(r._mapping) for r in rows]


#: Fill ``usage_daily`` and ``running_usage`` from ``lives`` and the log's commands in
#: one pass each: for a bulk-loaded log (the billing benchmark).
RUNNING_FROM_LIVES = """
INSERT INTO running_usage (tenant, job_id, since, cpus, memory_mb, lives, started_epoch)
SELECT tenant, job_id, (started_at AT TIME ZONE 'UTC')::date, cpus, memory_mb, count(*),
       sum(extract(epoch FROM started_at))
  FROM lives WHERE started_at IS NOT NULL AND ended_at IS NULL
 GROUP BY 1, 2, 3, 4, 5
"""
ROLLUP_FROM_LIVES = f"""
WITH pieces AS (
    {
    _PIECES.format(
        relation="(SELECT * FROM lives WHERE started_at IS NOT NULL AND ended_at IS NOT NULL)"
    )
}
    UNION ALL
    SELECT tenant, job_id, (occurred_at AT TIME ZONE 'UTC')::date, 0, 0, NULL, NULL, 1
      FROM events WHERE type = 'CommandCompleted'
)
{_ADD_TO_ROLLUP}
"""
