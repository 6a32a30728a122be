"""Credentials (key ids, owners, revocations; never secrets), request ids already
handled, trajectories scoped by tenant.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A credential's key is derived from the master key (a root-only file), so this
    # table holds nothing a reader could sign with. Services read it; only the owner
    # role (the operator's `dsec tenant` / `dsec node` commands) changes it.
    op.execute(
        """
        CREATE TABLE credentials (
            key_id text PRIMARY KEY,
            role text NOT NULL CHECK (role IN ('tenant', 'operator', 'node')),
            subject text NOT NULL,
            label text NOT NULL DEFAULT '',
            created_at timestamptz NOT NULL DEFAULT now(),
            created_by text NOT NULL DEFAULT current_user,
            revoked_at timestamptz,
            revoked_by text
        );
        CREATE INDEX credentials_subject_idx ON credentials (role, subject);
        GRANT SELECT ON credentials TO dsec_app;
        """
    )
    # Request ids the scheduler has handled, with where it read them: the same id at
    # another place on the bus is a replay. Kept for the freshness window (plus
    # margin) and pruned by the scheduler: this is bookkeeping, not the log.
    op.execute(
        """
        CREATE TABLE handled_requests (
            request_id uuid PRIMARY KEY,
            partition integer NOT NULL,
            "offset" bigint NOT NULL,
            handled_at timestamptz NOT NULL DEFAULT now()
        );
        CREATE INDEX handled_requests_at_idx ON handled_requests (handled_at);
        GRANT SELECT, INSERT, DELETE ON handled_requests TO dsec_app;
        """
    )
    # Trajectory ids are the tenant's own: two tenants may both have "episode-1".
    op.execute(
        """
        DROP INDEX IF EXISTS commands_trajectory_step_uq;
        CREATE UNIQUE INDEX commands_trajectory_step_uq
            ON commands (tenant, trajectory_id, step) WHERE trajectory_id IS NOT NULL;
        """
    )


def downgrade() -> None:
    op.execute(
        """
        DROP INDEX IF EXISTS commands_trajectory_step_uq;
        CREATE UNIQUE INDEX commands_trajectory_step_uq ON commands (trajectory_id, step)
            WHERE trajectory_id IS NOT NULL;
        DROP TABLE handled_requests;
        DROP TABLE credentials;
        """
    )
