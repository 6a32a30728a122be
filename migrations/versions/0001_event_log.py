"""Append-only event log, consumer offsets, sandboxes projection, service role.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB, UUID

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

TZ = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "events",
        sa.Column("position", sa.BigInteger, sa.Identity(always=True), primary_key=True),
        sa.Column("event_id", UUID(as_uuid=True), nullable=False, unique=True),
        sa.Column("type", sa.Text, nullable=False),
        sa.Column("version", sa.SmallInteger, nullable=False),
        sa.Column("sandbox_id", sa.Text),
        sa.Column("node_id", sa.Text),
        sa.Column("tenant", sa.Text, nullable=False),
        sa.Column("job_id", sa.Text, nullable=False),
        sa.Column("occurred_at", TZ, nullable=False),
        sa.Column("recorded_at", TZ, nullable=False, server_default=sa.text("now()")),
        sa.Column("payload", JSONB, nullable=False),
        sa.Column("topic", sa.Text, nullable=False),
        sa.Column("topic_id", UUID(as_uuid=True), nullable=False),
        sa.Column("partition", sa.Integer, nullable=False),
        sa.Column("offset", sa.BigInteger, nullable=False),
        # topic_id, not the name: a broker that restarts empty (the embedded one is
        # memory only) reuses offsets under the same name but a new topic id.
        sa.UniqueConstraint("topic_id", "partition", "offset", name="events_source_uq"),
    )
    op.create_index("events_sandbox_idx", "events", ["sandbox_id", "position"])
    op.create_index("events_tenant_job_idx", "events", ["tenant", "job_id", "occurred_at"])
    op.create_index("events_type_idx", "events", ["type", "occurred_at"])

    # The log is append-only for everyone, operators included: row triggers refuse
    # UPDATE/DELETE, a statement trigger refuses TRUNCATE, and ENABLE ALWAYS keeps
    # them firing under session_replication_role=replica.
    op.execute(
        """
        CREATE FUNCTION dsec_refuse_change() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            RAISE EXCEPTION 'events is append-only: % refused', TG_OP
                USING ERRCODE = 'insufficient_privilege';
        END $$;
        CREATE TRIGGER events_no_update_delete BEFORE UPDATE OR DELETE ON events
            FOR EACH ROW EXECUTE FUNCTION dsec_refuse_change();
        CREATE TRIGGER events_no_truncate BEFORE TRUNCATE ON events
            FOR EACH STATEMENT EXECUTE FUNCTION dsec_refuse_change();
        ALTER TABLE events ENABLE ALWAYS TRIGGER events_no_update_delete;
        ALTER TABLE events ENABLE ALWAYS TRIGGER events_no_truncate;
        """
    )

    op.create_table(
        "consumer_offsets",
        sa.Column("consumer", sa.Text, primary_key=True),
        sa.Column("topic", sa.Text, primary_key=True),
        sa.Column("partition", sa.Integer, primary_key=True),
        sa.Column("topic_id", UUID(as_uuid=True), nullable=False),
        sa.Column("next_offset", sa.BigInteger, nullable=False),
        sa.Column("updated_at", TZ, nullable=False, server_default=sa.text("now()")),
    )

    op.create_table(
        "sandboxes",
        sa.Column("sandbox_id", sa.Text, primary_key=True),
        sa.Column("tenant", sa.Text, nullable=False),
        sa.Column("job_id", sa.Text, nullable=False),
        sa.Column("actor", sa.Text),
        sa.Column("image", sa.Text),
        sa.Column("node_id", sa.Text),
        sa.Column("state", sa.Text, nullable=False),
        sa.Column("cpus", sa.Float),
        sa.Column("memory_mb", sa.Integer),
        sa.Column("disk_mb", sa.Integer),
        sa.Column("ttl_s", sa.Integer),
        sa.Column("network", sa.Boolean),
        sa.Column("labels", JSONB),
        sa.Column("requested_at", TZ),
        sa.Column("scheduled_at", TZ),
        sa.Column("started_at", TZ),
        sa.Column("ended_at", TZ),
        sa.Column("end_reason", sa.Text),
        sa.Column("detail", sa.Text),
        sa.Column("commands", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("last_position", sa.BigInteger, nullable=False),
    )
    op.create_index("sandboxes_state_idx", "sandboxes", ["state", "node_id"])
    op.create_index("sandboxes_tenant_job_idx", "sandboxes", ["tenant", "job_id"])

    op.create_table(
        "nodes",
        sa.Column("node_id", sa.Text, primary_key=True),
        sa.Column("state", sa.Text, nullable=False),
        sa.Column("queue", sa.Text, nullable=False),
        sa.Column("capacity_sandboxes", sa.Integer, nullable=False),
        sa.Column("capacity_cpus", sa.Float, nullable=False),
        sa.Column("capacity_memory_mb", sa.Integer, nullable=False),
        sa.Column("running", sa.Integer, nullable=False),
        sa.Column("images", JSONB, nullable=False),
        sa.Column("registered_at", TZ),
        sa.Column("last_heartbeat_at", TZ),
        sa.Column("lost_at", TZ),
        sa.Column("last_position", sa.BigInteger, nullable=False),
    )

    # Services connect as dsec_app, which does not own the tables: it may append to
    # and read the log, and maintain the projections, nothing more.
    op.execute(
        """
        DO $$ BEGIN
            IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'dsec_app') THEN
                CREATE ROLE dsec_app LOGIN;
            END IF;
        END $$;
        GRANT SELECT, INSERT ON events TO dsec_app;
        GRANT SELECT, INSERT, UPDATE, DELETE ON consumer_offsets, sandboxes, nodes TO dsec_app;
        """
    )


def downgrade() -> None:
    op.drop_table("nodes")
    op.drop_table("sandboxes")
    op.drop_table("consumer_offsets")
    op.execute("ALTER TABLE events DISABLE TRIGGER ALL")
    op.drop_table("events")
    op.execute("DROP FUNCTION IF EXISTS dsec_refuse_change()")
