"""``dsec top``: nodes, their capacity and load, and live sandboxes per node and tenant.

Read from the projections (``nodes``, ``sandboxes``), so it shows what the log says,
a few milliseconds behind the platform. A frame is a plain dict: the terminal view
and ``--json`` print the same figures.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text
from sqlalchemy import Connection

from app.config import Settings
from app.db import queries
from app.domain.base import NodeState

Frame = dict[str, Any]

#: A heartbeat older than this is shown as late (nodes beat every few seconds).
LATE_HEARTBEAT_S = 30.0


def _number(value: Any) -> Any:
    """Decimals and None from SQL aggregates as JSON-ready numbers."""
    if value is None:
        return 0
    return round(float(value), 3) if not isinstance(value, int) else value


def frame(conn: Connection) -> Frame:
    """One snapshot: every node with its live load, and live sandboxes per tenant."""
    per_node = queries.load_per_node(conn)
    nodes = []
    for row in queries.nodes_overview(conn):
        live = per_node.pop(row.node_id, None)
        nodes.append(
            {
                "node_id": row.node_id,
                "state": row.state,
                "running_reported": row.running,
                "capacity_sandboxes": row.capacity_sandboxes,
                "capacity_cpus": _number(row.capacity_cpus),
                "capacity_memory_mb": row.capacity_memory_mb,
                "heartbeat_age_s": None
                if row.heartbeat_age_s is None
                else _number(row.heartbeat_age_s),
                "images": row.images,
                "sandboxes_running": live.running if live else 0,
                "sandboxes_pending": live.pending if live else 0,
                "cpus_reserved": _number(live.cpus if live else None),
                "memory_mb_reserved": _number(live.memory_mb if live else None),
            }
        )
    tenants = [
        {
            "tenant": row.tenant,
            "jobs": row.jobs,
            "sandboxes_running": row.running,
            "sandboxes_pending": row.pending,
        }
        for row in queries.load_per_tenant(conn)
    ]
    # Live sandboxes on no known node: requested, not placed yet.
    unplaced = sum(r.running + r.pending for r in per_node.values())
    return {
        "at": datetime.now(UTC).isoformat(),
        "nodes": nodes,
        "tenants": tenants,
        "unplaced": unplaced,
    }


def _age(node: Frame) -> Text:
    age = node["heartbeat_age_s"]
    if age is None:
        return Text("never", style="red")
    late = age > LATE_HEARTBEAT_S or node["state"] != NodeState.ALIVE
    return Text(f"{age:.1f}s", style="red" if late else "")


def render(snapshot: Frame) -> Group:
    """The frame as two tables and a footer line."""
    nodes = Table(title="nodes", title_justify="left", expand=False)
    for name in ("node", "state", "sandboxes", "pending", "capacity", "cpus", "memory"):
        nodes.add_column(name, justify="left" if name in ("node", "state") else "right")
    nodes.add_column("heartbeat", justify="right")
    nodes.add_column("images", justify="right")
    for node in snapshot["nodes"]:
        state_style = "green" if node["state"] == NodeState.ALIVE else "red"
        nodes.add_row(
            node["node_id"],
            Text(node["state"], style=state_style),
            str(node["sandboxes_running"]),
            str(node["sandboxes_pending"]),
            f"{node['sandboxes_running']}/{node['capacity_sandboxes']}",
            f"{node['cpus_reserved']:g}/{node['capacity_cpus']:g}",
            f"{node['memory_mb_reserved']:,}/{node['capacity_memory_mb']:,} MiB",
            _age(node),
            str(node["images"]),
        )
    tenants = Table(title="live sandboxes per tenant", title_justify="left")
    for name in ("tenant", "jobs", "running", "pending"):
        tenants.add_column(name, justify="left" if name == "tenant" else "right")
    for tenant in snapshot["tenants"]:
        tenants.add_row(
            tenant["tenant"],
            str(tenant["jobs"]),
            str(tenant["sandboxes_running"]),
            str(tenant["sandboxes_pending"]),
        )
    running = sum(node["sandboxes_running"] for node in snapshot["nodes"])
    footer = Text(
        f"{snapshot['at'][:19]}Z  {len(snapshot['nodes'])} nodes, {running} sandboxes running, "
        f"{snapshot['unplaced']} not placed yet",
        style="dim",
    )
    return Group(nodes, tenants, footer)


def read(settings: Settings) -> Frame:
    """One frame from the database."""
    from app.db.engine import transaction

    with transaction(settings.database_url) as conn:
        return frame(conn)


def watch(settings: Settings, console: Console, interval_s: float) -> None:
    """Redraw a frame every ``interval_s`` until interrupted."""
    with Live(render(read(settings)), console=console, auto_refresh=False) as live:
        try:
            while True:
                time.sleep(interval_s)
                live.update(render(read(settings)), refresh=True)
        except KeyboardInterrupt:
            return
