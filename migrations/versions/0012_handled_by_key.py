"""Handled request ids are scoped by the key that proved them: the gate remembers
(key id, request id), so nobody else's record (unproven, or under another key) with
the same request id can use one up, and a proven attempt is attributed to its prover
whatever came before it. Replay protection across schedulers (a takeover reloads
these rows) is keyed the same way.

Rows are bookkeeping kept for the freshness window (the scheduler prunes them): the
ones there when this runs get the empty key id, which no key has, so they stop
counting at once instead of counting for every key.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-03
"""

from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        """
        ALTER TABLE handled_requests ADD COLUMN key_id text NOT NULL DEFAULT '';
        ALTER TABLE handled_requests ALTER COLUMN key_id DROP DEFAULT;
        ALTER TABLE handled_requests DROP CONSTRAINT handled_requests_pkey;
        ALTER TABLE handled_requests ADD PRIMARY KEY (key_id, request_id);
        """
    )


def downgrade() -> None:
    # Two keys may have used one request id: the older row of each id stays.
    op.execute(
        """
        DELETE FROM handled_requests a USING handled_requests b
            WHERE a.request_id = b.request_id AND a.handled_at > b.handled_at;
        DELETE FROM handled_requests a USING handled_requests b
            WHERE a.request_id = b.request_id AND a.handled_at = b.handled_at
              AND a.key_id > b.key_id;
        ALTER TABLE handled_requests DROP CONSTRAINT handled_requests_pkey;
        ALTER TABLE handled_requests DROP COLUMN key_id;
        ALTER TABLE handled_requests ADD PRIMARY KEY (request_id);
        """
    )
