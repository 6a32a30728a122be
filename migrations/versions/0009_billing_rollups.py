"""Billing from data the size of the question: the ``lives`` projection and the
``usage_daily`` rollup, behind the familiar view names.

``billing_daily`` and ``sandbox_lives`` recomputed every life in the log's history at
each query (seconds at a million lives, minutes at DSec's month). The views over the
raw log stay, renamed ``billing_daily_from_log`` and ``sandbox_lives_from_log``, as
the definition the projections are checked against (``dsec bill --verify``); the
names people query now read:

- ``lives``: one row per sandbox, folded by the projector with the raw view's rules
  (the first Requested, Started and Stopped of the sandbox win);
- ``usage_daily``: per (tenant, job, UTC day) the exact, unrounded sums of the ended
  lives' day pieces and the commands of the day, folded when a life ends;
- lives still running, cut into day pieces at query time.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02
"""

from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

TABLES = """
CREATE TABLE lives (
    sandbox_id text PRIMARY KEY,
    tenant text NOT NULL,
    job_id text NOT NULL,
    node_id text,
    actor text,
    image text,
    cpus numeric,
    memory_mb integer,
    started_at timestamptz,
    ended_at timestamptz,
    end_reason text,
    end_detail text,
    last_position bigint NOT NULL
);
CREATE INDEX lives_tenant_job_idx ON lives (tenant, job_id, started_at);
CREATE INDEX lives_started_idx ON lives (started_at);
CREATE INDEX lives_ended_idx ON lives (end_reason, ended_at);
CREATE INDEX lives_running_idx ON lives (started_at)
    WHERE started_at IS NOT NULL AND ended_at IS NULL;

-- numeric, unrounded: the sum of a day's pieces is exact however the lives were
-- batched, so rollup + running lives equals the raw view's sum to the last digit.
-- core_ and gb_seconds may be NULL like the raw view's sums (a life with no request).
CREATE TABLE usage_daily (
    tenant text NOT NULL,
    job_id text NOT NULL,
    day date NOT NULL,
    sandboxes bigint NOT NULL DEFAULT 0,
    sandbox_seconds numeric NOT NULL DEFAULT 0,
    core_seconds numeric,
    gb_seconds numeric,
    commands bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant, job_id, day)
);
CREATE INDEX usage_daily_day_idx ON usage_daily (day);
"""

SANDBOX_LIVES = """
CREATE VIEW sandbox_lives AS
SELECT l.tenant, l.job_id, l.sandbox_id, l.node_id, l.actor, l.image, l.cpus, l.memory_mb,
       l.started_at, l.ended_at, l.end_reason, l.end_detail,
       coalesce(s.commands, 0)::bigint AS commands
  FROM lives l
  LEFT JOIN sandboxes s ON s.sandbox_id = l.sandbox_id
 WHERE l.started_at IS NOT NULL
"""

# A row exists where a life touched the day (sandboxes > 0), as in the raw view: the
# commands of a day no life touched (clock skew only) are counted in usage_daily but
# billed nowhere. The running arm uses the raw view's expressions verbatim, so the
# pieces are the same numbers.
BILLING_DAILY = """
CREATE VIEW billing_daily AS
SELECT u.tenant, u.job_id, u.day,
       sum(u.sandboxes)::bigint AS sandboxes,
       round(sum(u.sandbox_seconds), 3) AS sandbox_seconds,
       round(sum(u.core_seconds), 3) AS core_seconds,
       round(sum(u.gb_seconds), 3) AS gb_seconds,
       sum(u.commands)::bigint AS commands
  FROM (
    SELECT tenant, job_id, day, sandboxes, sandbox_seconds, core_seconds, gb_seconds, commands
      FROM usage_daily
    UNION ALL
    SELECT l.tenant, l.job_id, p.day, 1, p.seconds, p.seconds * l.cpus,
           p.seconds * l.memory_mb / 1024, 0
      FROM lives l
      CROSS JOIN LATERAL dsec_utc_day_pieces(
          l.started_at AT TIME ZONE 'UTC', greatest(l.started_at, now()) AT TIME ZONE 'UTC') p
     WHERE l.started_at IS NOT NULL AND l.ended_at IS NULL
  ) u
 GROUP BY u.tenant, u.job_id, u.day
HAVING sum(u.sandboxes) > 0
"""


def upgrade() -> None:
    op.execute(TABLES)
    op.execute("ALTER VIEW billing_daily RENAME TO billing_daily_from_log")
    op.execute("ALTER VIEW sandbox_lives RENAME TO sandbox_lives_from_log")
    op.execute(SANDBOX_LIVES)
    op.execute(BILLING_DAILY)
    op.execute(
        """
        GRANT SELECT, INSERT, UPDATE, DELETE ON lives, usage_daily TO dsec_app;
        GRANT SELECT ON sandbox_lives, billing_daily TO dsec_app;
        """
    )


def downgrade() -> None:
    op.execute("DROP VIEW billing_daily; DROP VIEW sandbox_lives")
    op.execute("ALTER VIEW billing_daily_from_log RENAME TO billing_daily")
    op.execute("ALTER VIEW sandbox_lives_from_log RENAME TO sandbox_lives")
    op.execute("DROP TABLE usage_daily; DROP TABLE lives")
