"""Who besides its owner may start sandboxes from a tenant's image: one row per
repository and reader (a tenant, or ``*`` for every tenant: public, an operator's
decision). Written by the hub's token service (an owner sharing, through the SDK) and
by the operator's CLI; read by the token service and the schedulers every few seconds.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-06
"""

from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        """
        CREATE TABLE image_shares (
            repository text NOT NULL,
            reader text NOT NULL,
            shared_by text NOT NULL,
            shared_at timestamptz NOT NULL DEFAULT now(),
            PRIMARY KEY (repository, reader)
        );
        GRANT SELECT, INSERT, DELETE ON image_shares TO dsec_app;
        """
    )


def downgrade() -> None:
    op.execute("DROP TABLE image_shares")
