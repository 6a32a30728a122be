"""Keep trajectory steps' whole output in the commands projection, for replay.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-29
"""

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE commands ADD COLUMN stdout_b64 text, ADD COLUMN stderr_b64 text")


def downgrade() -> None:
    op.execute("ALTER TABLE commands DROP COLUMN stdout_b64, DROP COLUMN stderr_b64")
