"""A sandbox's egress allowlist, beside its ``network`` flag: the rules it was created
with (NULL: no allowlist), folded from its SandboxRequested event.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-06
"""

from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE sandboxes ADD COLUMN egress jsonb")


def downgrade() -> None:
    op.execute("ALTER TABLE sandboxes DROP COLUMN egress")
