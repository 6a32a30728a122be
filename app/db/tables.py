"""SQLAlchemy Core description of the schema (Alembic migrations create it)."""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Date,
    DateTime,
    Float,
    Integer,
    LargeBinary,
    MetaData,
    Numeric,
    SmallInteger,
    Table,
    Text,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB, UUID

metadata = MetaData()

#: The append-only log, partitioned by day of ``recorded_at``. The database refuses
#: UPDATE, DELETE and TRUNCATE on it and on every partition.
events = Table(
    "events",
    metadata,
    Column("position", BigInteger, primary_key=True, autoincrement=True),
    Column("event_id", UUID(as_uuid=True), nullable=False),
    Column("type", Text, nullable=False),
    Column("version", SmallInteger, nullable=False),
    Column("sandbox_id", Text),
    Column("node_id", Text),
    Column("tenant", Text, nullable=False),
    Column("job_id", Text, nullable=False),
    Column("occurred_at", DateTime(timezone=True), nullable=False),
    Column(
        "recorded_at",
        DateTime(timezone=True),
        primary_key=True,
        nullable=False,
        server_default=text("now()"),
    ),
    Column("payload", JSONB, nullable=False),
    Column("topic", Text, nullable=False),
    Column("topic_id", UUID(as_uuid=True), nullable=False),
    Column("partition", Integer, nullable=False),
    Column("offset", BigInteger, nullable=False),
)

#: Every event id ever appended: the log's global idempotency key (a partitioned
#: table cannot carry a unique key without its partition key).
event_ids = Table(
    "event_ids",
    metadata,
    Column("event_id", UUID(as_uuid=True), primary_key=True),
    Column("recorded_at", DateTime(timezone=True), nullable=False, server_default=text("now()")),
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

#: Which version of the projections' rules built the read models (one row).
projection_version = Table(
    "projection_version",
    metadata,
    Column("name", Text, primary_key=True),
    Column("version", Integer, nullable=False),
    Column("rebuilt_at", DateTime(timezone=True), nullable=False, server_default=text("now()")),
    Column("events_folded", BigInteger, nullable=False),
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
    Column("egress", JSONB),
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

#: Projection: the trajectory log, one row per completed command.
commands = Table(
    "commands",
    metadata,
    Column("request_id", UUID(as_uuid=True), primary_key=True),
    Column("sandbox_id", Text, nullable=False),
    Column("tenant", Text, nullable=False),
    Column("job_id", Text, nullable=False),
    Column("actor", Text, nullable=False),
    Column("trajectory_id", Text),
    Column("step", Integer),
    Column("command", JSONB, nullable=False),
    Column("exit_code", Integer, nullable=False),
    Column("duration_ms", Float, nullable=False),
    Column("timed_out", Boolean, nullable=False),
    Column("truncated", Boolean, nullable=False),
    Column("stdout_head", Text, nullable=False),
    Column("stderr_head", Text, nullable=False),
    Column("occurred_at", DateTime(timezone=True), nullable=False),
    Column("position", BigInteger, nullable=False),
    Column("stdout_b64", Text),
    Column("stderr_b64", Text),
)

#: Projection: running totals per tenant and job (ended sandboxes' time is exact).
usage = Table(
    "usage",
    metadata,
    Column("tenant", Text, primary_key=True),
    Column("job_id", Text, primary_key=True),
    Column("sandboxes_started", Integer, nullable=False, server_default=text("0")),
    Column("sandboxes_ended", Integer, nullable=False, server_default=text("0")),
    Column("commands", Integer, nullable=False, server_default=text("0")),
    Column("ended_sandbox_seconds", Numeric, nullable=False, server_default=text("0")),
    Column("ended_core_seconds", Numeric, nullable=False, server_default=text("0")),
    Column("ended_gb_seconds", Numeric, nullable=False, server_default=text("0")),
    Column("last_position", BigInteger, nullable=False),
)

#: Credentials by key id: owner, role, revocation. Never a secret: keys are derived
#: from the master key (app/domain/proof.py).
credentials = Table(
    "credentials",
    metadata,
    Column("key_id", Text, primary_key=True),
    Column("role", Text, nullable=False),
    Column("subject", Text, nullable=False),
    Column("label", Text, nullable=False, server_default=text("''")),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=text("now()")),
    Column("created_by", Text, nullable=False, server_default=text("current_user")),
    Column("revoked_at", DateTime(timezone=True)),
    Column("revoked_by", Text),
)

#: Request ids the scheduler handled, scoped by the key that proved them, and where it
#: read them (replays are refused).
handled_requests = Table(
    "handled_requests",
    metadata,
    Column("key_id", Text, primary_key=True),
    Column("request_id", UUID(as_uuid=True), primary_key=True),
    Column("partition", Integer, nullable=False),
    Column("offset", BigInteger, nullable=False),
    Column("handled_at", DateTime(timezone=True), nullable=False, server_default=text("now()")),
)

#: Tenants' own quotas over the settings' defaults (app/domain/quotas.py): no row, the
#: default; a NULL ``max_held``, no limit.
tenant_quotas = Table(
    "tenant_quotas",
    metadata,
    Column("tenant", Text, primary_key=True),
    Column("resource", Text, primary_key=True),
    Column("max_held", BigInteger),
    Column("set_at", DateTime(timezone=True), nullable=False, server_default=text("now()")),
    Column("set_by", Text, nullable=False, server_default=text("current_user")),
)

#: What was pushed to or deleted from the image hub (append-only; app/db/hub_events.py).
hub_events = Table(
    "hub_events",
    metadata,
    Column("event_id", Text, primary_key=True),
    Column("at", DateTime(timezone=True), nullable=False),
    Column("action", Text, nullable=False),
    Column("actor_key", Text, nullable=False),
    Column("tenant", Text),
    Column("job", Text),
    Column("repository", Text, nullable=False),
    Column("tag", Text),
    Column("digest", Text, nullable=False),
    Column("media_type", Text, nullable=False),
    Column("size", BigInteger, nullable=False),
    Column("recorded_at", DateTime(timezone=True), nullable=False, server_default=text("now()")),
    #: A manifest push's references (``[{"digest", "size"}]``): the blobs it holds.
    Column("refs", JSONB(none_as_null=True)),
)

#: Who besides its owner may use a tenant's image (app/db/hub_events.py).
image_shares = Table(
    "image_shares",
    metadata,
    Column("repository", Text, primary_key=True),
    Column("reader", Text, primary_key=True),
    Column("shared_by", Text, nullable=False),
    Column("shared_at", DateTime(timezone=True), nullable=False, server_default=text("now()")),
)

#: A tenant's egress secrets, each sealed under the platform's key
#: (app/control/egress_secrets.py); header_key is the header's name in lower case.
egress_secrets = Table(
    "egress_secrets",
    metadata,
    Column("tenant", Text, primary_key=True),
    Column("destination", Text, primary_key=True),
    Column("header_key", Text, primary_key=True),
    Column("header", Text, nullable=False),
    Column("sealed", LargeBinary, nullable=False),
    Column("set_by", Text, nullable=False),
    Column("set_at", DateTime(timezone=True), nullable=False, server_default=text("now()")),
)

#: Projection: one row per sandbox with the raw ``sandbox_lives_from_log`` view's
#: rules (the first Requested, Started and Stopped win); ``sandbox_lives`` reads it.
lives = Table(
    "lives",
    metadata,
    Column("sandbox_id", Text, primary_key=True),
    Column("tenant", Text, nullable=False),
    Column("job_id", Text, nullable=False),
    Column("node_id", Text),
    Column("actor", Text),
    Column("image", Text),
    Column("cpus", Numeric),
    Column("memory_mb", Integer),
    Column("started_at", DateTime(timezone=True)),
    Column("ended_at", DateTime(timezone=True)),
    Column("end_reason", Text),
    Column("end_detail", Text),
    Column("last_position", BigInteger, nullable=False),
)

#: Projection: per tenant, job and UTC day, the exact sums of the ended lives' day
#: pieces and the day's commands; ``billing_daily`` adds the running lives.
usage_daily = Table(
    "usage_daily",
    metadata,
    Column("tenant", Text, primary_key=True),
    Column("job_id", Text, primary_key=True),
    Column("day", Date, primary_key=True),
    Column("sandboxes", BigInteger, nullable=False, server_default=text("0")),
    Column("sandbox_seconds", Numeric, nullable=False, server_default=text("0")),
    Column("core_seconds", Numeric),
    #: MiB-seconds (``billing_daily`` divides the sum by 1024 once).
    Column("mb_seconds", Numeric),
    Column("commands", BigInteger, nullable=False, server_default=text("0")),
)

#: Projection: the lives running now, per tenant, job, UTC start day and shape, with
#: the sum of their start times; ``billing_daily`` cuts them into days per row. (The
#: key is a UNIQUE NULLS NOT DISTINCT constraint in the database.)
running_usage = Table(
    "running_usage",
    metadata,
    Column("tenant", Text, primary_key=True),
    Column("job_id", Text, primary_key=True),
    Column("since", Date, primary_key=True),
    Column("cpus", Numeric, primary_key=True, nullable=True),
    Column("memory_mb", Integer, primary_key=True, nullable=True),
    Column("lives", BigInteger, nullable=False),
    Column("started_epoch", Numeric, nullable=False),
)

#: Days of the log moved out by ``dsec log archive``, and where they went.
log_archives = Table(
    "log_archives",
    metadata,
    Column("day", Date, primary_key=True),
    Column("partition", Text, nullable=False),
    Column("events", BigInteger, nullable=False),
    Column("first_position", BigInteger),
    Column("last_position", BigInteger),
    Column("file", Text, nullable=False),
    Column("sha256", Text, nullable=False),
    Column("archived_at", DateTime(timezone=True), nullable=False, server_default=text("now()")),
    Column("archived_by", Text, nullable=False, server_default=text("current_user")),
    Column("restored_at", DateTime(timezone=True)),
)
