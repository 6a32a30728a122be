"""Tenants' own limit on the megabytes their images hold in the hub (`image_mb`), beside
the repositories they hold (`images`).

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-06
"""

from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

_BEFORE = "'sandboxes', 'leases', 'groups', 'pending_creates', 'commands', 'trajectories', 'images'"


def _allow(resources: str) -> None:
    op.execute(
        f"""
        ALTER TABLE tenant_quotas DROP CONSTRAINT tenant_quotas_resource_check;
        ALTER TABLE tenant_quotas ADD CONSTRAINT tenant_quotas_resource_check
            CHECK (resource IN ({resources}));
        """
    )


def upgrade() -> None:
    _allow(f"{_BEFORE}, 'image_mb'")


def downgrade() -> None:
    op.execute("DELETE FROM tenant_quotas WHERE resource = 'image_mb'")
    _allow(_BEFORE)
