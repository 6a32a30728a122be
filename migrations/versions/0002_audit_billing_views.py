"""Views for people: audit_trail, sandbox_lives, billing_daily (read from events only).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

# Partial indexes: a few rows per sandbox, so they stay small and cheap to maintain on a
# log that grows by tens of millions of rows a day.
# - lifecycle: "the Requested/Started/Stopped event of sandbox X" is one index probe
#   instead of a walk through all of X's events (commands included).
# - started: "the sandboxes of tenant T / job J" without reading T's commands.
INDEXES = {
    "events_lifecycle_idx": "events (sandbox_id, type, position) WHERE type IN "
    "('SandboxRequested', 'SandboxStarted', 'SandboxStopped')",
    "events_started_idx": "events (tenant, job_id, occurred_at) WHERE type = 'SandboxStarted'",
}

AUDIT_TRAIL = """
CREATE OR REPLACE VIEW audit_trail AS
SELECT
    e.position,
    e.occurred_at,
    e.tenant,
    e.job_id,
    e.sandbox_id,
    coalesce(e.node_id, e.payload->>'node_id') AS node_id,
    e.type,
    e.payload->>'actor' AS actor,
    CASE e.type
        WHEN 'SandboxRequested' THEN format(
            'create %s cpus=%s memory_mb=%s disk_mb=%s ttl_s=%s network=%s',
            e.payload->>'image', e.payload->>'cpus', e.payload->>'memory_mb',
            e.payload->>'disk_mb', e.payload->>'ttl_s', e.payload->>'network')
        WHEN 'SandboxScheduled' THEN 'place on ' || (e.payload->>'node_id')
        WHEN 'SandboxStarted' THEN 'start container ' || left(e.payload->>'container_id', 12)
        WHEN 'SandboxRejected' THEN 'refuse ' || (e.payload->>'request_type')
        WHEN 'SandboxFailed' THEN 'fail ' || (e.payload->>'request_type')
        WHEN 'SandboxStopped' THEN 'stop'
        WHEN 'CommandCompleted' THEN 'exec ' || CASE jsonb_typeof(e.payload->'command')
            WHEN 'array' THEN array_to_string(
                ARRAY(SELECT jsonb_array_elements_text(e.payload->'command')), ' ')
            ELSE e.payload->>'command' END
        WHEN 'FileWritten' THEN 'write ' || (e.payload->>'path')
        WHEN 'FileRead' THEN 'read ' || (e.payload->>'path')
        ELSE e.type
    END AS action,
    CASE e.type
        WHEN 'SandboxRequested' THEN 'accepted'
        WHEN 'SandboxScheduled' THEN 'placed'
        WHEN 'SandboxStarted' THEN CASE WHEN (e.payload->>'warm')::boolean
            THEN 'running (warm)' ELSE 'running' END
        WHEN 'CommandCompleted' THEN 'exit ' || (e.payload->>'exit_code')
            || CASE WHEN (e.payload->>'timed_out')::boolean THEN ' timed out' ELSE '' END
            || CASE WHEN (e.payload->>'truncated')::boolean THEN ' truncated' ELSE '' END
        WHEN 'FileWritten' THEN (e.payload->>'size') || ' bytes'
        WHEN 'FileRead' THEN (e.payload->>'size') || ' bytes'
        ELSE e.payload->>'reason'
    END AS outcome,
    coalesce(nullif(e.payload->>'detail', ''), nullif(e.payload->>'stderr_head', '')) AS detail,
    (e.payload->>'request_id')::uuid AS request_id,
    e.payload->>'trajectory_id' AS trajectory_id,
    (e.payload->>'step')::integer AS step,
    e.event_id
FROM events e
WHERE e.sandbox_id IS NOT NULL
"""

# One row per sandbox that started. A simple (flattenable) query over events, so a
# filter on tenant/job_id/sandbox_id/started_at reaches the index scan of `st`; the
# other events of the sandbox are single probes of events_lifecycle_idx. NOT EXISTS
# (rather than DISTINCT ON) keeps the first Started if one were ever logged twice
# without blocking that pushdown.
SANDBOX_LIVES = """
CREATE OR REPLACE VIEW sandbox_lives AS
SELECT
    st.tenant,
    st.job_id,
    st.sandbox_id,
    st.node_id,
    rq.payload->>'actor' AS actor,
    rq.payload->>'image' AS image,
    (rq.payload->>'cpus')::numeric AS cpus,
    (rq.payload->>'memory_mb')::integer AS memory_mb,
    st.occurred_at AS started_at,
    sp.occurred_at AS ended_at,
    sp.payload->>'reason' AS end_reason,
    sp.payload->>'detail' AS end_detail,
    (SELECT count(*) FROM events c
      WHERE c.sandbox_id = st.sandbox_id AND c.type = 'CommandCompleted') AS commands
FROM events st
LEFT JOIN LATERAL (
    SELECT r.payload FROM events r
     WHERE r.sandbox_id = st.sandbox_id AND r.type = 'SandboxRequested'
     ORDER BY r.position LIMIT 1
) rq ON true
LEFT JOIN LATERAL (
    SELECT x.occurred_at, x.payload FROM events x
     WHERE x.sandbox_id = st.sandbox_id AND x.type = 'SandboxStopped'
     ORDER BY x.position LIMIT 1
) sp ON true
WHERE st.type = 'SandboxStarted'
  AND st.sandbox_id IS NOT NULL
  AND NOT EXISTS (
      SELECT FROM events d
       WHERE d.sandbox_id = st.sandbox_id AND d.type = 'SandboxStarted'
         AND d.position < st.position)
"""

# [start, end) in UTC wall-clock time, cut at midnights: one (day, seconds) row per day
# touched. The start day always gets a row (zero seconds for an empty life); a life that
# ends exactly at midnight does not reach the next day. STRICT keeps the planner from
# inlining it, so it keeps its ROWS estimate: inlined, generate_series is guessed at
# 1000 rows per sandbox, which inflates billing plans a thousandfold and triggers JIT.
DAY_PIECES = """
CREATE OR REPLACE FUNCTION dsec_utc_day_pieces(start_utc timestamp, end_utc timestamp)
RETURNS TABLE (day date, seconds numeric)
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE ROWS 2 AS $$
    SELECT d::date,
           extract(epoch FROM least(end_utc, d + interval '1 day') - greatest(start_utc, d))
      FROM generate_series(date_trunc('day', start_utc), end_utc, interval '1 day') AS d
     WHERE d < end_utc OR d = date_trunc('day', start_utc)
$$
"""

# Each life [started, coalesce(ended, now())) is cut at UTC midnights: `AT TIME ZONE
# 'UTC'` turns instants into UTC wall-clock timestamps, so the session TimeZone never
# moves a day boundary. A clock-skewed life (ended before started) counts zero seconds.
# Commands are counted per (tenant, job, day) row with a range scan of
# events_tenant_job_idx, so a day filter never reads other days' commands.
BILLING_DAILY = """
CREATE OR REPLACE VIEW billing_daily AS
SELECT
    u.tenant,
    u.job_id,
    u.day,
    u.sandboxes,
    round(u.sandbox_seconds, 3) AS sandbox_seconds,
    round(u.core_seconds, 3) AS core_seconds,
    round(u.gb_seconds, 3) AS gb_seconds,
    (SELECT count(*) FROM events c
      WHERE c.tenant = u.tenant AND c.job_id = u.job_id AND c.type = 'CommandCompleted'
        AND c.occurred_at >= (u.day::timestamp AT TIME ZONE 'UTC')
        AND c.occurred_at < ((u.day + 1)::timestamp AT TIME ZONE 'UTC')) AS commands
FROM (
    SELECT
        l.tenant,
        l.job_id,
        p.day,
        count(*) AS sandboxes,
        sum(p.seconds) AS sandbox_seconds,
        sum(p.seconds * l.cpus) AS core_seconds,
        sum(p.seconds * l.memory_mb / 1024) AS gb_seconds
    FROM (
        SELECT
            tenant,
            job_id,
            cpus,
            memory_mb,
            started_at AT TIME ZONE 'UTC' AS s,
            greatest(started_at, coalesce(ended_at, now())) AT TIME ZONE 'UTC' AS e
        FROM sandbox_lives
    ) l
    CROSS JOIN LATERAL dsec_utc_day_pieces(l.s, l.e) AS p
    GROUP BY l.tenant, l.job_id, p.day
) u
"""

VIEWS = ("billing_daily", "sandbox_lives", "audit_trail")  # dependents first


def upgrade() -> None:
    # CONCURRENTLY: building an index on a big log must not block the projector's
    # inserts for minutes; it cannot run in a transaction, hence the autocommit block.
    # If a concurrent build fails it leaves an INVALID index: drop it and rerun.
    with op.get_context().autocommit_block():
        for name, definition in INDEXES.items():
            op.execute(f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {name} ON {definition}")
    op.execute(AUDIT_TRAIL)
    op.execute(SANDBOX_LIVES)
    op.execute(DAY_PIECES)
    op.execute(BILLING_DAILY)
    op.execute(f"GRANT SELECT ON {', '.join(VIEWS)} TO dsec_app")


def downgrade() -> None:
    for view in VIEWS:
        op.execute(f"DROP VIEW IF EXISTS {view}")
    op.execute("DROP FUNCTION IF EXISTS dsec_utc_day_pieces(timestamp, timestamp)")
    for name in INDEXES:
        op.execute(f"DROP INDEX IF EXISTS {name}")
