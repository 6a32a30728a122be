"""The audit trail says who was refused: a ``denied`` column for refusals of the
sender (no proof, another tenant's sandbox, a replay), with the authenticated actor
the events now carry.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""

from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

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
    e.event_id,
    -- A refusal of who sent it, not of what it asked: no proof, another's sandbox,
    -- a replay. `dsec audit --denied` lists these.
    (e.type = 'SandboxRejected'
     AND e.payload->>'reason' IN ('unauthenticated', 'forbidden', 'duplicate')) AS denied
FROM events e
WHERE e.sandbox_id IS NOT NULL
"""
# Refusals of senders, newest first: `dsec audit --denied` reads this index only.
DENIED = (
    "(position) WHERE type = 'SandboxRejected' "
    "AND payload->>'reason' IN ('unauthenticated', 'forbidden', 'duplicate')"
)


def upgrade() -> None:
    op.execute(AUDIT_TRAIL)  # a column added at the end: CREATE OR REPLACE keeps grants
    # A partitioned table takes no CONCURRENTLY index: the parent's is made empty
    # (ON ONLY), each day's is built without blocking the projector's inserts and
    # attached; partitions made later get theirs from the parent.
    op.execute(f"CREATE INDEX IF NOT EXISTS events_denied_idx ON ONLY events {DENIED}")
    parts = [
        row[0]
        for row in op.get_bind().exec_driver_sql(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = 'events'::regclass"
        )
    ]
    with op.get_context().autocommit_block():
        for part in parts:
            index = f"{part}_denied_idx"
            op.execute(f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {index} ON {part} {DENIED}")
            attached = op.get_bind().exec_driver_sql(
                f"SELECT 1 FROM pg_inherits WHERE inhrelid = '{index}'::regclass"
            ).scalar()
            if not attached:
                op.execute(f"ALTER INDEX events_denied_idx ATTACH PARTITION {index}")


def downgrade() -> None:
    op.execute("DROP INDEX IF EXISTS events_denied_idx")
    before = AUDIT_TRAIL[: AUDIT_TRAIL.index(",\n    -- A refusal")] + "\nFROM events e\nWHERE e.sandbox_id IS NOT NULL\n"
    op.execute("DROP VIEW audit_trail")
    op.execute(before)
    op.execute("GRANT SELECT ON audit_trail TO dsec_app")
