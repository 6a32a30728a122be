"""Tenants' egress secrets: a header the node adds to their sandboxes' requests to one
destination. The value is stored encrypted (AES-GCM under a key derived from the
platform's master key, bound to its tenant, destination and header), never in clear.
Written by the hub's token service (a tenant, through the SDK), read by the schedulers.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-06
"""

from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        """
        CREATE TABLE egress_secrets (
            tenant text NOT NULL,
            destination text NOT NULL,
            header_key text NOT NULL,
            header text NOT NULL,
            sealed bytea NOT NULL,
            set_by text NOT NULL,
            set_at timestamptz NOT NULL DEFAULT now(),
            PRIMARY KEY (tenant, destination, header_key)
        );
        GRANT SELECT, INSERT, UPDATE, DELETE ON egress_secrets TO dsec_app;
        """
    )


def downgrade() -> None:
    op.execute("DROP TABLE egress_secrets")
