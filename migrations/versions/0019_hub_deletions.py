"""What a tenant holds in the hub follows its deletions: each manifest push keeps the
blobs it references (``refs``, as the registry reported them), so a blob is held from
its first push until the last manifest that referenced it is deleted. ``hub_blobs``
says that per tenant, job and blob; ``image_storage`` (bytes held now, GB-hours held so
far) and the megabytes quota read it.

A blob that no manifest of its tenant references (an upload whose manifest never came,
or one pushed before manifests kept their references) stays held: it is on the hub's
disk until a garbage collection, and nothing reports that.

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-06
"""

from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None

_OLD_STORAGE = """
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


def upgrade() -> None:
    op.execute(
        """
        ALTER TABLE hub_events ADD COLUMN refs jsonb;
        CREATE INDEX hub_events_by_digest ON hub_events (repository, digest);

        CREATE VIEW hub_blobs AS
        WITH manifest_life AS (
            -- each push of a manifest holds it and what it references until the next
            -- deletion of that manifest in that repository
            SELECT p.tenant, coalesce(p.job, '') AS job, p.digest, p.size, p.refs,
                   p.at AS held_from,
                   (SELECT min(d.at) FROM hub_events d
                    WHERE d.action = 'delete' AND d.repository = p.repository
                      AND d.digest = p.digest AND d.at >= p.at) AS held_until
            FROM hub_events p
            WHERE p.action = 'push' AND jsonb_typeof(p.refs) = 'array' AND p.tenant IS NOT NULL
        ), referenced AS (
            SELECT tenant, job, digest, size, held_from, held_until FROM manifest_life
            UNION ALL
            SELECT m.tenant, m.job, r ->> 'digest', (r ->> 'size')::bigint,
                   m.held_from, m.held_until
            FROM manifest_life m CROSS JOIN LATERAL jsonb_array_elements(m.refs) AS r
        ), unreferenced AS (
            SELECT b.tenant, coalesce(b.job, '') AS job, b.digest, b.size,
                   b.at AS held_from, NULL::timestamptz AS held_until
            FROM hub_events b
            WHERE b.action = 'push' AND b.tenant IS NOT NULL AND b.tag IS NULL
              AND jsonb_typeof(b.refs) IS DISTINCT FROM 'array'
              AND b.media_type NOT LIKE '%manifest%'
              AND b.media_type NOT LIKE '%index%'
              AND NOT EXISTS (SELECT 1 FROM referenced r
                              WHERE r.tenant = b.tenant AND r.digest = b.digest)
        )
        SELECT tenant, job, digest, max(size) AS size, min(held_from) AS first_at,
               CASE WHEN bool_or(held_until IS NULL) THEN NULL
                    ELSE max(held_until) END AS released_at
        FROM (SELECT * FROM referenced UNION ALL SELECT * FROM unreferenced) AS held
        GROUP BY tenant, job, digest;
        GRANT SELECT ON hub_blobs TO dsec_app;

        DROP VIEW image_storage;
        -- bytes and blobs: held now; gb_hours: each blob from its first push until it
        -- was released (or now)
        CREATE VIEW image_storage AS
        SELECT tenant, job,
               count(*) FILTER (WHERE released_at IS NULL) AS blobs,
               coalesce(sum(size) FILTER (WHERE released_at IS NULL), 0) AS bytes,
               sum(size / 1e9 * extract(epoch FROM coalesce(released_at, now()) - first_at)
                   / 3600) AS gb_hours
        FROM hub_blobs
        GROUP BY tenant, job;
        GRANT SELECT ON image_storage TO dsec_app;
        """
    )


def downgrade() -> None:
    op.execute("DROP VIEW image_storage")
    op.execute("DROP VIEW hub_blobs")
    op.execute("DROP INDEX hub_events_by_digest")
    op.execute("ALTER TABLE hub_events DROP COLUMN refs")
    op.execute(_OLD_STORAGE)
