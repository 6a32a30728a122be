"""The running lives' index leads with tenant and job.

``billing_daily`` adds the lives still running at query time; a tenant's or a job's
bill finds its own running lives in this index instead of filtering all of them, and
an all-tenant bill still reads the whole (small, partial) index.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02
"""

from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("DROP INDEX IF EXISTS lives_running_idx")
    op.execute(
        "CREATE INDEX lives_running_idx ON lives (tenant, job_id, started_at)"
        " WHERE started_at IS NOT NULL AND ended_at IS NULL"
    )


def downgrade() -> None:
    op.execute("DROP INDEX IF EXISTS lives_running_idx")
    op.execute(
        "CREATE INDEX lives_running_idx ON lives (started_at)"
        " WHERE started_at IS NOT NULL AND ended_at IS NULL"
    )
