"""The trajectory log read from the ``commands`` projection in Postgres."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select

from app.db.engine import transaction
from app.db.tables import commands
from app.domain.trajectory import RecordedStep

_COLUMNS = (
    commands.c.request_id,
    commands.c.step,
    commands.c.command,
    commands.c.exit_code,
    commands.c.stdout_b64,
    commands.c.stderr_b64,
    commands.c.duration_ms,
    commands.c.timed_out,
    commands.c.truncated,
)


def _step(row: Any) -> RecordedStep:
    m = row._mapping
    return RecordedStep(
        request_id=m["request_id"],
        step=m["step"],
        command=m["command"],
        exit_code=m["exit_code"],
        stdout_b64=m["stdout_b64"] or "",
        stderr_b64=m["stderr_b64"] or "",
        duration_ms=m["duration_ms"],
        timed_out=m["timed_out"],
        truncated=m["truncated"],
    )


class PostgresTrajectoryLog:
    """Looks steps up by the (tenant, trajectory_id, step) unique index."""

    def __init__(self, url: str) -> None:
        self.url = url

    def lookup(self, tenant: str, trajectory_id: str, step: int) -> RecordedStep | None:
        with transaction(self.url) as conn:
            row = conn.execute(
                select(*_COLUMNS).where(
                    commands.c.tenant == tenant,
                    commands.c.trajectory_id == trajectory_id,
                    commands.c.step == step,
                    commands.c.stdout_b64.is_not(None),
                )
            ).first()
        return _step(row) if row is not None else None

    def steps(self, tenant: str, trajectory_id: str) -> list[RecordedStep]:
        with transaction(self.url) as conn:
            rows = conn.execute(
                select(*_COLUMNS)
                .where(commands.c.tenant == tenant, commands.c.trajectory_id == trajectory_id)
                .order_by(commands.c.step)
            ).all()
        return [_step(r) for r in rows]
