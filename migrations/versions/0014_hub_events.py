"""The image hub's audit trail: what was pushed to or deleted from the hub, by whom,
when, with its digest and size, as the registry reported it to the token service
(app/control/hub_auth.py). Append-only for the platform's role: it inserts and
reads, never changes a row; the registry's own event id makes a report it sends again
land once. ``image_storage`` bills what they hold: bytes and GB-hours per tenant and
job (a snapshot's job; a tenant's own pushes have none).

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
            job text,
            repository text NOT NULL,
            tag text,
            digest text NOT NULL,
            media_type text NOT NULL,
            size bigint NOT NULL CHECK (size >= 0),
            recorded_at timestamptz NOT NULL DEFAULT now()
        );
        CREATE INDEX hub_events_by_tenant ON hub_events (tenant, repository);
        GRANT SELECT, INSERT ON hub_events TO dsec_app;

        -- What each tenant's images hold in the hub, and for how long: every blob it
        -- pushed, counted once per tenant and job, from its first push until now.
        -- Snapshots carry their job; a tenant's own pushes have none ('').
        CREATE VIEW image_storage AS
        SELECT tenant, job, count(*) AS blobs, sum(size) AS bytes,
               sum(size / 1e9 * extract(epoch FROM now() - first_at) / 3600) AS gb_hours
        FROM (
            SELECT tenant, coalesce(job, '') AS job, digest, max(size) AS size,
                   min(at) AS first_at
            FROM hub_events
            WHERE action = 'push' AND tag IS NULL AND tenant IS NOT NULL
            GROUP BY tenant, coalesce(job, ''), digest
        ) AS blob
        GROUP BY tenant, job;
        GRANT SELECT ON image_storage TO dsec_app;
        """
    )


def downgrade() -> None:
    op.execute("DROP VIEW image_storage")
    op.execute("DROP TABLE hub_events")
