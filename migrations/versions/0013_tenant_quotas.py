"""Tenants' own quotas: the limits an operator set for a tenant (`dsec tenant quota`),
over the settings' defaults. One row per tenant and resource; no row: the default;
a NULL ``max_held``: no limit. The scheduler reads them every few seconds, as the
keyring reads revocations; only the owner role (the operator's CLI) writes them.

A row raises or lowers how much a tenant may hold, never what a key may do: a key's
role and subject are not here.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-03
"""

from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        """
        CREATE TABLE tenant_quotas (
            tenant text NOT NULL,
            resource text NOT NULL CHECK (resource IN ('sandboxes', 'leases', 'groups',
                'pending_creates', 'commands', 'trajectories', 'images')),
            max_held bigint CHECK (max_held >= 0),
            set_at timestamptz NOT NULL DEFAULT now(),
            set_by text NOT NULL DEFAULT current_user,
            PRIMARY KEY (tenant, resource)
        );
        GRANT SELECT ON tenant_quotas TO dsec_app;
        """
    )


def downgrade() -> None:
    op.execute("DROP TABLE tenant_quotas")
