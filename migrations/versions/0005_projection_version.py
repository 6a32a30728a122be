"""Record which version of the projections' rules built the read models.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # No row yet: the first projector of this version rebuilds the projections once,
    # since they may have been folded by rules older than any recorded version.
    op.execute(
        """
        CREATE TABLE projection_version (
            name text PRIMARY KEY,
            version integer NOT NULL,
            rebuilt_at timestamptz NOT NULL DEFAULT now(),
            events_folded bigint NOT NULL
        );
        GRANT SELECT, INSERT, UPDATE ON projection_version TO dsec_app;
        """
    )


def downgrade() -> None:
    op.execute("DROP TABLE projection_version")
