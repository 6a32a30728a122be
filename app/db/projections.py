"""Projections: read models derived from the log, updated in the log's transaction.

Each function is a pure mapping from one event to upserts, so the live projector and
``dsec projections rebuild`` run the same code and yield the same rows.
"""

from __future__ import annotations

from sqlalchemy import ColumnElement, Connection, case, delete, literal, select, update
from sqlalchemy.dialects.postgresql import insert

from app.db.tables import nodes, sandboxes
from app.domain.events import (
    CommandCompleted,
    Event,
    NodeHeartbeat,
    NodeLost,
    NodeRegistered,
    SandboxFailed,
    SandboxRejected,
    SandboxRequested,
    SandboxScheduled,
    SandboxStarted,
    SandboxStopped,
)
from app.domain.sandbox_state import SandboxState, rank

PROJECTION_TABLES = (sandboxes, nodes)


def _rank_sql(column: ColumnElement[str]) -> ColumnElement[int]:
    return case({s.value: rank(s) for s in SandboxState}, value=column, else_=-1)


def _set_state(
    conn: Connection, event: Event, state: SandboxState, position: int, **cols: object
) -> None:
    """Upsert the sandbox row, moving its state forward only."""
    assert event.sandbox_id is not None
    base = {
        "sandbox_id": event.sandbox_id,
        "tenant": event.tenant,
        "job_id": event.job_id,
        "state": state.value,
        "last_position": position,
        **cols,
    }
    stmt = insert(sandboxes).values(base)
    new_state = case(
        (_rank_sql(sandboxes.c.state) <= rank(state), literal(state.value)),
        else_=sandboxes.c.state,
    )
    updates: dict[str, object] = {"state": new_state, "last_position": position}
    updates.update({k: getattr(stmt.excluded, k) for k in cols})
    conn.execute(stmt.on_conflict_do_update(index_elements=["sandbox_id"], set_=updates))


def apply(conn: Connection, event: Event, position: int) -> None:
    """Fold one event into the projections."""
    match event:
        case SandboxRequested(payload=p):
            _set_state(
                conn,
                event,
                SandboxState.REQUESTED,
                position,
                actor=p.actor,
                image=p.image,
                cpus=p.cpus,
                memory_mb=p.memory_mb,
                disk_mb=p.disk_mb,
                ttl_s=p.ttl_s,
                network=p.network,
                labels=p.labels,
                requested_at=event.occurred_at,
            )
        case SandboxScheduled(payload=p):
            _set_state(
                conn,
                event,
                SandboxState.SCHEDULED,
                position,
                node_id=p.node_id,
                scheduled_at=event.occurred_at,
            )
        case SandboxStarted():
            _set_state(
                conn,
                event,
                SandboxState.RUNNING,
                position,
                node_id=event.node_id,
                started_at=event.occurred_at,
            )
        case SandboxStopped(payload=p):
            _set_state(
                conn,
                event,
                SandboxState.STOPPED,
                position,
                ended_at=event.occurred_at,
                end_reason=p.reason.value,
                detail=p.detail,
            )
        case SandboxRejected(payload=p) if p.request_type == "CreateSandbox":
            _set_state(
                conn,
                event,
                SandboxState.REJECTED,
                position,
                ended_at=event.occurred_at,
                end_reason=p.reason.value,
                detail=p.detail,
            )
        case SandboxFailed(payload=p) if p.request_type == "CreateSandbox":
            _set_state(
                conn,
                event,
                SandboxState.FAILED,
                position,
                ended_at=event.occurred_at,
                end_reason=p.reason.value,
                detail=p.detail,
            )
        case CommandCompleted():
            conn.execute(
                update(sandboxes)
                .where(sandboxes.c.sandbox_id == event.sandbox_id)
                .values(commands=sandboxes.c.commands + 1, last_position=position)
            )
        case NodeRegistered(payload=p) | NodeHeartbeat(payload=p):
            row = {
                "node_id": event.node_id,
                "state": "alive",
                "queue": p.queue,
                "capacity_sandboxes": p.capacity_sandboxes,
                "capacity_cpus": p.capacity_cpus,
                "capacity_memory_mb": p.capacity_memory_mb,
                "running": p.running,
                "images": p.images,
                "last_heartbeat_at": event.occurred_at,
                "last_position": position,
            }
            if isinstance(event, NodeRegistered):
                row["registered_at"] = event.occurred_at
            stmt = insert(nodes).values(row)
            conn.execute(
                stmt.on_conflict_do_update(
                    index_elements=["node_id"],
                    set_={k: getattr(stmt.excluded, k) for k in row if k != "node_id"},
                )
            )
        case NodeLost():
            conn.execute(
                update(nodes)
                .where(nodes.c.node_id == event.node_id)
                .values(state="lost", lost_at=event.occurred_at, last_position=position)
            )
        case _:
            pass


def clear(conn: Connection) -> None:
    """Empty every projection (before a rebuild)."""
    for table in PROJECTION_TABLES:
        conn.execute(delete(table))


def snapshot(conn: Connection) -> list[tuple[object, ...]]:
    """Every projection row, ordered, for comparing a rebuild with the live state."""
    out: list[tuple[object, ...]] = []
    for table in PROJECTION_TABLES:
        key = next(iter(table.primary_key.columns))
        out.extend(tuple(r) for r in conn.execute(select(table).order_by(key)))
    return out
