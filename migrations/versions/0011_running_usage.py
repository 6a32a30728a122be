"""Running lives folded too: a bill's cost stops growing with the sandboxes running.

``billing_daily`` cut every running life into day pieces at query time: 8 us a life,
so an all-tenant bill took 1.4 s with the ~124,000 sandboxes DSec runs at once. The
projector now keeps ``running_usage``: per (tenant, job, UTC start day, cpus, memory)
the lives running and the sum of their start times (exact numerics). A running life's
piece of a day is then the same for every life of its group but the start day's, and
the start day's pieces sum to ``lives * (the day's end or now) - sum of starts``: the
view reads one row per group, whatever the number of lives.

GB-seconds become exact too: they were summed from per-piece divisions by 1024, each
rounded by numeric division to 8-12 decimals (on a day of 100,000 lives up to 5e-4
GB-s off, and not a sum a grouped form can reproduce); both views now sum MiB-seconds
(``usage_daily.mb_seconds``) and divide once. ``billing_daily_from_log`` keeps every
other expression of migration 0002.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-02
"""

from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

# The raw view, as in 0002 (reading the renamed sandbox_lives_from_log), but for GB.
BILLING_FROM_LOG = """
CREATE OR REPLACE VIEW billing_daily_from_log AS
SELECT u.tenant, u.job_id, u.day, u.sandboxes,
       round(u.sandbox_seconds, 3) AS sandbox_seconds,
       round(u.core_seconds, 3) AS core_seconds,
       round(u.mb_seconds / 1024, 3) AS gb_seconds,
       (SELECT count(*) FROM events c
         WHERE c.tenant = u.tenant AND c.job_id = u.job_id AND c.type = 'CommandCompleted'
           AND c.occurred_at >= (u.day::timestamp AT TIME ZONE 'UTC')
           AND c.occurred_at < ((u.day + 1)::timestamp AT TIME ZONE 'UTC')) AS commands
  FROM (
    SELECT l.tenant, l.job_id, p.day, count(*) AS sandboxes,
           sum(p.seconds) AS sandbox_seconds,
           sum(p.seconds * l.cpus) AS core_seconds,
           sum(p.seconds * l.memory_mb) AS mb_seconds
      FROM (
        SELECT tenant, job_id, cpus, memory_mb,
               started_at AT TIME ZONE 'UTC' AS s,
               greatest(started_at, coalesce(ended_at, now())) AT TIME ZONE 'UTC' AS e
          FROM sandbox_lives_from_log
      ) l
      CROSS JOIN LATERAL dsec_utc_day_pieces(l.s, l.e) AS p
     GROUP BY l.tenant, l.job_id, p.day
  ) u
"""

# Three arms: the ended lives' rollup; the running lives' start-day pieces per group
# (lives started "in the future" by a skewed clock count zero, as in the raw view:
# the last arm takes back what the group's sum gave them); their later days per group.
BILLING_DAILY = """
CREATE VIEW billing_daily AS
WITH running AS (
    SELECT tenant, job_id, since, cpus, memory_mb, lives, started_epoch,
           least(now(), (since + 1)::timestamp AT TIME ZONE 'UTC') AS upto
      FROM running_usage
     WHERE lives > 0
)
SELECT u.tenant, u.job_id, u.day,
       sum(u.sandboxes)::bigint AS sandboxes,
       round(sum(u.sandbox_seconds), 3) AS sandbox_seconds,
       round(sum(u.core_seconds), 3) AS core_seconds,
       round(sum(u.mb_seconds) / 1024, 3) AS gb_seconds,
       sum(u.commands)::bigint AS commands
  FROM (
    SELECT tenant, job_id, day, sandboxes, sandbox_seconds, core_seconds, mb_seconds, commands
      FROM usage_daily
    UNION ALL
    SELECT r.tenant, r.job_id, r.since, r.lives, x.seconds, x.seconds * r.cpus,
           x.seconds * r.memory_mb, 0
      FROM running r
      CROSS JOIN LATERAL (
          SELECT r.lives * extract(epoch FROM r.upto) - r.started_epoch AS seconds) x
    UNION ALL
    SELECT r.tenant, r.job_id, p.day, r.lives, r.lives * p.seconds,
           r.lives * p.seconds * r.cpus, r.lives * p.seconds * r.memory_mb, 0
      FROM running r
      CROSS JOIN LATERAL dsec_utc_day_pieces(r.since::timestamp, now() AT TIME ZONE 'UTC') p
     WHERE r.since < (now() AT TIME ZONE 'UTC')::date AND p.day > r.since
    UNION ALL
    SELECT f.tenant, f.job_id, (f.started_at AT TIME ZONE 'UTC')::date, 0, x.seconds,
           x.seconds * f.cpus, x.seconds * f.memory_mb, 0
      FROM lives f
      CROSS JOIN LATERAL (
          SELECT extract(epoch FROM f.started_at) - extract(epoch FROM least(now(),
                 (((f.started_at AT TIME ZONE 'UTC')::date + 1)::timestamp AT TIME ZONE 'UTC')))
                 AS seconds) x
     WHERE f.started_at > now() AND f.ended_at IS NULL
  ) u
 GROUP BY u.tenant, u.job_id, u.day
HAVING sum(u.sandboxes) > 0
"""


def upgrade() -> None:
    op.execute("DROP VIEW billing_daily")
    op.execute(
        """
        ALTER TABLE usage_daily ADD COLUMN mb_seconds numeric;
        ALTER TABLE usage_daily DROP COLUMN gb_seconds;
        CREATE TABLE running_usage (
            tenant text NOT NULL,
            job_id text NOT NULL,
            since date NOT NULL,
            cpus numeric,
            memory_mb integer,
            lives bigint NOT NULL,
            started_epoch numeric NOT NULL,
            CONSTRAINT running_usage_key
                UNIQUE NULLS NOT DISTINCT (tenant, job_id, since, cpus, memory_mb)
        );
        CREATE INDEX running_usage_empty_idx ON running_usage (tenant) WHERE lives = 0;
        GRANT SELECT, INSERT, UPDATE, DELETE ON running_usage TO dsec_app;
        """
    )
    op.execute(BILLING_FROM_LOG)
    op.execute(BILLING_DAILY)
    op.execute("GRANT SELECT ON billing_daily TO dsec_app")


def downgrade() -> None:
    raise NotImplementedError("restore a backup; the projections rebuild from the log")
