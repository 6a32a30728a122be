"""SQLAlchemy Core description of the schema (Alembic migrations create it)."""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Float,
    Integer,
    MetaData,
    SmallInteger,
    Table,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB, UUID

metadata = MetaData()

#: The append-only log. The database refuses UPDATE, DELETE and TRUNCATE on it.
events = Table(
    "events",
    metadata,
    Column("position", BigInteger, primary_key=True, autoincrement=True),
    Column("event_id", UUID(as_uuid=True), nullable=False, unique=True),
    Column("type", Text, nullable=False),
    Column("version", SmallInteger, nullable=False),
    Column("sandbox_id", Text),
    Column("node_id", Text),
    Column("tenant", Text, nullable=False),
    Column("job_id", Text, nullable=False),
    Column("occurred_at", DateTime(timezone=True), nullable=False),
    Column("recorded_at", DateTime(timezone=True), nullable=False, server_default=text("now()")),
    Column("payload", JSONB, nullable=False),
    Column("topic", Text, nullable=False),
    Column("topic_id", UUID(as_uuid=True), nullable=False),
    Column("partition", Integer, nullable=False),
    Column("offset", BigInteger, nullable=False),
    UniqueConstraint("topic_id", "partition", "offset", name="events_source_uq"),
)

#: Where each consumer that writes Postgres stands in each Kafka partition.
consumer_offsets = Table(
    "consumer_offsets",
    metadata,
    Column("consumer", Text, primary_key=True),
    Column("topic", Text, primary_key=True),
    Column("partition", Integer, primary_key=True),
    Column("topic_id", UUID(as_uuid=True), nullable=False),
    Column("next_offset", BigInteger, nullable=False),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=text("now()")),
)

#: Projection: one row per sandbox, its current state.
sandboxes = Table(
    "sandboxes",
    metadata,
    Column("sandbox_id", Text, primary_key=True),
    Column("tenant", Text, nullable=False),
    Column("job_id", Text, nullable=False),
    Column("actor", Text),
    Column("image", Text),
    Column("node_id", Text),
    Column("state", Text, nullable=False),
    Column("cpus", Float),
    Column("memory_mb", Integer),
    Column("disk_mb", Integer),
    Column("ttl_s", Integer),
    Column("network", Boolean),
    Column("labels", JSONB),
    Column("requested_at", DateTime(timezone=True)),
    Column("scheduled_at", DateTime(timezone=True)),
    Column("started_at", DateTime(timezone=True)),
    Column("ended_at", DateTime(timezone=True)),
    Column("end_reason", Text),
    Column("detail", Text),
    Column("commands", Integer, nullable=False, server_default=text("0")),
    Column("last_position", BigInteger, nullable=False),
)

#: Projection: one row per node, its declared capacity and last heartbeat.
nodes = Table(
    "nodes",
    metadata,
    Column("node_id", Text, primary_key=True),
    Column("state", Text, nullable=False),
    Column("queue", Text, nullable=False),
    Column("capacity_sandboxes", Integer, nullable=False),
    Column("capacity_cpus", Float, nullable=False),
    Column("capacity_memory_mb", Integer, nullable=False),
    Column("running", Integer, nullable=False),
    Column("images", JSONB, nullable=False),
    Column("registered_at", DateTime(timezone=True)),
    Column("last_heartbeat_at", DateTime(timezone=True)),
    Column("lost_at", DateTime(timezone=True)),
    Column("last_position", BigInteger, nullable=False),
)
