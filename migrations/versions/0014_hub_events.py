"""The image hub's audit trail: what was pushed to or deleted from the hub, by whom,
when, with its digest and size, as the registry reported it to the token service
(app/control/hub_auth.py). Append-only for the platform's role: it inserts and
reads, never changes a row; the registry's own event id makes a report it sends again
land once.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-06
"""

from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        """
        CREATE TABLE hub_events (
            event_id text PRIMARY KEY,
            at timestamptz NOT NULL,
            action text NOT NULL CHECK (action IN ('push', 'delete')),
            actor_key text NOT NULL,
            tenant text,
            repository text NOT NULL,
            tag text,
            digest text NOT NULL,
            media_type text NOT NULL,
            size bigint NOT NULL CHECK (size >= 0),
            recorded_at timestamptz NOT NULL DEFAULT now()
        );
        CREATE INDEX hub_events_by_tenant ON hub_events (tenant, repository);
        GRANT SELECT, INSERT ON hub_events TO dsec_app;
        """
    )


def downgrade() -> None:
    op.execute("DROP TABLE hub_events")
