"""The one settings object. Every endpoint and path comes from here (``DSEC_*``)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal
from urllib.parse import SplitResult, quote, urlsplit, urlunsplit

from pydantic import AliasChoices, Field, model_validator
from pydantic_settings import SettingsConfigDict

from app.egress_config import EgressSettings
from app.image_config import ImageSettings


class Settings(EgressSettings, ImageSettings):
    """Platform configuration, read from ``DSEC_*`` environment variables."""

    model_config = SettingsConfigDict(
        env_prefix="DSEC_", extra="ignore", populate_by_name=True, env_parse_none_str="none"
    )

    kafka_bootstrap: str = Field(
        "127.0.0.1:19092", description="Kafka bootstrap servers, comma separated."
    )
    kafka_security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        "SASL_PLAINTEXT",
        description=(
            "How every client of the platform and the SDK talks to Kafka: SASL on the"
            " embedded broker's loopback listener, SASL_SSL where traffic leaves the machine."
        ),
    )
    kafka_sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = Field(
        "SCRAM-SHA-512", description="SASL mechanism (with SASL_PLAINTEXT or SASL_SSL)."
    )
    sdk_kafka_client: Literal["kafka-python", "librdkafka"] = Field(
        "kafka-python",
        description=(
            "The Kafka client of a trainer's SDK (librdkafka: confluent-kafka installed,"
            " app/sdk/transport_rdkafka.py): a serial command ~4 ms sooner, 1/3 the CPU."
        ),
    )
    node_kafka_client: Literal["kafka-python", "librdkafka"] = Field(
        "librdkafka",
        description="The Kafka client of a node's inbox and producer (app/rdkafka_bus.py).",
    )
    kafka_sasl_username: str | None = Field(
        None,
        description=(
            "SASL principal name. Unset: a trainer's or node's credential file names its own;"
            " root on the stack's host uses the stack's admin principal."
        ),
    )
    kafka_sasl_password_file: Path | None = Field(
        None, description="File holding the SASL password (never the password itself)."
    )
    kafka_credential_bootstrap: str | None = Field(
        None,
        description=(
            "The brokers' TLS listeners as other hosts reach them. Set, every credential"
            " file `dsec tenant create` and `dsec node add` write carries them, SASL_SSL"
            " and the stack's CA, so its holder needs nothing else; unset, holders use"
            " their own DSEC_KAFKA_* settings."
        ),
    )
    kafka_dist_dir: Path | None = Field(
        None,
        description=(
            "Where Apache Kafka's checked jars are kept (default: <state_dir>/kafka): hosts"
            " of one machine, or a shared disk, fetch them once."
        ),
    )
    kafka_ssl_cafile: Path | None = Field(
        None, description="CA bundle the brokers are checked with."
    )
    kafka_ssl_certfile: Path | None = Field(None, description="Client certificate (mTLS).")
    kafka_ssl_keyfile: Path | None = Field(None, description="Client certificate's key (mTLS).")
    database_url: str = Field(
        "postgresql+psycopg://dsec_app@127.0.0.1:5432/dsec",
        description=(
            "SQLAlchemy URL the services use (least-privilege role). Without a password,"
            " the local stack's <secrets_dir>/postgres-<user>.password is used."
        ),
    )
    admin_database_url: str = Field(
        "postgresql+psycopg://dsec_owner@127.0.0.1:5432/dsec",
        description="SQLAlchemy URL for migrations and credentials (the owner role).",
    )
    postgres_superuser_url: str = Field(
        "postgresql+psycopg://postgres@127.0.0.1:5432/postgres",
        description=(
            "Used by `dsec up` alone, to make the dsec roles on a local Postgres (if it"
            " cannot connect, it runs psql as the postgres system user instead)."
        ),
    )
    celery_broker_url: str = Field(
        "redis://127.0.0.1:6390/0",
        description=(
            "Celery broker URL. Without a password, the local stack's"
            " <secrets_dir>/redis.password is used (its own Redis, on port 6390)."
        ),
    )
    node_id: str = Field("node0", description="Id of the node this worker drives.")
    state_dir: Path = Field(Path("/var/lib/dsec"), description="Logs, pid files, node homes.")
    secrets_dir: Path = Field(
        Path("/var/lib/dsec/secrets"),
        description="Root-only directory of the local stack's keys and passwords.",
    )
    master_key_file: Path | None = Field(
        None,
        description=(
            "The control plane's master key (default: <secrets_dir>/master.key). Every"
            " credential's key is derived from it; only control hosts hold it."
        ),
    )
    node_credential_file: Path | None = Field(
        None,
        description="This node's credential (default: <secrets_dir>/nodes/<node_id>.json).",
    )
    node_agent: Path | None = Field(
        None,
        description=(
            "The release's agent binary (`dsec node agent`) that `dsec node up` installs;"
            " unset: compiled on the node."
        ),
    )
    credentials_file: Path | None = Field(
        None,
        # The documented name; DSEC_CREDENTIALS_FILE, the prefix's, works too.
        validation_alias=AliasChoices("DSEC_CREDENTIALS", "DSEC_CREDENTIALS_FILE"),
        description="The credential a trainer's client signs with (DSEC_CREDENTIALS).",
    )
    default_tenant: str = Field(
        "default", description="Tenant whose credential the local stack makes for a new user."
    )
    request_max_age_s: float = Field(
        300.0,
        gt=0,
        le=86_400,
        description=(
            "A request sent longer ago than this (by its sent_at, or that far in the future)"
            " is refused as stale: a captured request cannot be replayed later."
        ),
    )
    layer_store: Path = Field(
        Path("/var/lib/dsec/store"), description="Shared read-only Podman image store."
    )
    topic_prefix: str = Field("dsec", description="Prefix of every Kafka topic name.")
    topic_partitions: int = Field(
        8,
        description=(
            "Partitions the platform gives its requests and events topics when it makes"
            " them (consumers read the count from the broker's metadata)."
        ),
    )
    reply_partitions: int = Field(
        16,
        description=(
            "Partitions the platform gives a tenant's replies topic when it makes it (the"
            " gate and the SDK read the count from the broker's metadata, never this)."
        ),
    )
    kafka_replication_factor: int = Field(
        1, ge=1, description="Replicas of every topic the platform makes (3 on Apache Kafka)."
    )
    kafka_min_insync_replicas: int | None = Field(
        None,
        ge=1,
        description=(
            "min.insync.replicas of every topic the platform makes (2 with 3 replicas:"
            " an acknowledged record, acks=all, is on two brokers); unset: the broker's."
        ),
    )
    log_retention_hours: int = Field(
        168,
        ge=1,
        description=(
            "How long Kafka keeps requests, events and node inboxes (the log itself is"
            " in Postgres: this only bounds how far behind a consumer may fall)."
        ),
    )
    replies_retention_hours: int = Field(24, ge=1, description="How long Kafka keeps replies.")
    dead_letters_retention_hours: int = Field(
        720, ge=1, description="How long Kafka keeps dead letters (for `dsec dead-letters`)."
    )
    flower_port: int = Field(5555, description="Celery Flower HTTP port.")
    flower_host: str = Field(
        "127.0.0.1",
        description="Address Flower serves on (behind its password; 0.0.0.0 for any).",
    )
    metrics_port: int = Field(9464, description="First Prometheus metrics port of the services.")
    log_format: Literal["text", "json"] = Field(
        "text", description="How the services log: text, or one JSON object per line."
    )
    metrics_host: str = Field(
        "127.0.0.1",
        description=(
            "Address every service serves its Prometheus metrics on (0.0.0.0 for a"
            " Prometheus on another host)."
        ),
    )
    node_metrics_port: int | None = Field(
        None,
        description=(
            "This node worker's metrics port (default: metrics_port + 100 + the number"
            " its id ends in, see node_metrics_port_of; 0: none)."
        ),
    )
    schedulers: int = Field(
        1,
        ge=1,
        le=64,
        description=(
            "Scheduler processes `dsec up` runs; they share the requests topic by partition"
            " and take over a dead one's partitions (docs/architecture.md)."
        ),
    )
    scheduler_metrics_port: int | None = Field(
        None,
        description=(
            "This scheduler process's metrics port (default: metrics_port + 1; the stack"
            " gives each of several schedulers its own, 0: none)."
        ),
    )
    node_capacity_sandboxes: int = Field(2000, description="Sandboxes a node accepts.")
    node_capacity_cpus: float = Field(
        0.0, description="Declared CPUs of a node (0: its cores times node_cpu_overcommit)."
    )
    node_capacity_memory_mb: int = Field(
        0,
        description=(
            "Declared memory of a node (0: its memory less node_memory_reserve_mb, times"
            " node_memory_overcommit)."
        ),
    )
    node_max_commands: int = Field(
        4096,
        ge=1,
        description=(
            "Commands a node runs at once, all sandboxes together (each waits on a thread"
            " of its own; the sandboxes' own limits are what bound their work)."
        ),
    )
    node_max_commands_per_tenant: int = Field(
        2048,
        ge=1,
        description=(
            "Commands one tenant runs at once on a node (fair share: a tenant that floods a"
            " node leaves room for the others; its further commands wait their turn)."
        ),
    )
    node_min_free_mb: int = Field(
        512,
        ge=0,
        description=(
            "A node refuses creates (reason no_space) while its state disk (its home:"
            " container layers, run directories) has less free than this."
        ),
    )
    node_cpu_overcommit: float = Field(
        8.0,
        gt=0,
        description=(
            "CPUs a node promises per core. Sandboxes idle mostly, and a CPU limit is a"
            " ceiling: overcommitted CPU only runs slower (docs/isolation.md)."
        ),
    )
    node_memory_overcommit: float = Field(
        1.5,
        gt=0,
        description=(
            "Memory a node promises per MiB it has. Above 1, sandboxes that all use their"
            " whole limit at once exhaust the host: the kernel's OOM killer then picks"
            " among them (docs/isolation.md)."
        ),
    )
    node_memory_reserve_mb: int = Field(
        1024, ge=0, description="Memory a node keeps for itself, never promised to sandboxes."
    )
    node_pids_share: float = Field(
        0.25,
        gt=0,
        le=1,
        description="Most of the host's pid_max one sandbox may ask for (pids_limit).",
    )
    default_image: str = Field("dsec/busybox:latest", description="Image used when none is named.")
    direct_exec: bool = Field(
        True,
        description=(
            "A tenant's commands go straight to the node that holds the sandbox, proven"
            " under a key the scheduler hands the node at create (app/domain/direct.py);"
            " false keeps every command on the scheduler (read by the scheduler)."
        ),
    )
    default_tenant_quota: int = Field(0, description="Live sandboxes per tenant (0: no quota).")
    tenant_quotas: dict[str, int] = Field(
        default_factory=dict,
        description=(
            'Per-tenant sandbox quotas, JSON: {"team-a": 500} (`dsec tenant quota` overrides'
            " them, and sets every other resource's)."
        ),
    )
    # Every other resource a tenant may hold at once (app/domain/quotas.py); "none": no
    # quota. `dsec tenant quota TENANT` sets a tenant's own limits over these.
    quota_leases: int | None = Field(1000, ge=0, description="Trainer leases per tenant.")
    quota_groups: int | None = Field(1000, ge=0, description="Live rollout groups per tenant.")
    quota_pending_creates: int | None = Field(
        10_000, ge=0, description="Sandboxes per tenant waiting for room (queue_s)."
    )
    quota_commands: int | None = Field(
        100_000, ge=0, description="Commands per tenant in flight, per scheduler."
    )
    quota_trajectories: int | None = Field(
        100_000, ge=0, description="Trajectories per tenant being written by live sandboxes."
    )
    quota_images: int | None = Field(
        None, ge=0, description="Image repositories per tenant in the hub (docs/images.md)."
    )
    quota_image_mb: int | None = Field(
        None, ge=0, description="Megabytes per tenant's images in the hub (docs/images.md)."
    )
    lease_ttl_s: float = Field(30.0, description="Default trainer lease, seconds.")
    lease_grace_s: float = Field(300.0, description="Frozen this long after a lapse.")
    create_grace_s: float = Field(
        60.0,
        ge=0,
        le=86_400,
        description=(
            "How long a create may still take once its request is DSEC_REQUEST_MAX_AGE_S old"
            " (a node refuses older ones): a placement not started by then ends create_lost"
            " and gives its node's room back. Raise it for restores of long trajectories."
        ),
    )
    max_message_bytes: int = Field(
        1_048_576, description="Largest accepted request or event (Kafka message)."
    )
    fetch_max_wait_ms: int = Field(
        5000,
        ge=1,
        le=5000,
        description=(
            "How long the broker holds a fetch that finds nothing. A held fetch is answered"
            " as soon as data arrives, so reading costs no latency; it sets how often an"
            " idle consumer asks again (500 ms: ~8 fetches a second from an idle stack) and"
            " how long a consumer that moves (a rewind after a failure) waits for its"
            " held fetch before reading from the new place."
        ),
    )
    projector_lanes: int = Field(
        2,
        ge=1,
        le=16,
        description=(
            "Transactions one projector process keeps in flight, each for its own share of"
            " the partitions (partition mod lanes): one lane's Postgres work overlaps"
            " another's and the process's Python. Each lane is one database connection."
        ),
    )
    max_reply_bytes: int = Field(
        48 << 20,
        description=(
            "Largest reply record the SDK accepts (a node sends larger outputs and files as"
            " pieces of reply_piece_bytes; this admits a whole reply from an older node)."
        ),
    )
    reply_piece_bytes: int = Field(
        512 << 10,
        ge=1024,
        description=(
            "Most data one reply record carries (its base64 a third more): larger outputs"
            " and files go first as pieces, so no record exceeds Kafka's default 1 MiB."
        ),
    )
    step_output_bytes: int = Field(
        256 << 10,
        description=(
            "Output per stream a trajectory step keeps in the log for replays (more is cut"
            " and the replay says truncated); the live reply has it all."
        ),
    )
    warm_pool: dict[str, int] = Field(
        default_factory=lambda: {"dsec/busybox:latest": 4},
        description=(
            'Started sandboxes each node keeps ready per image, JSON: {"dsec/busybox:latest": 8}'
            " ({} turns warm pools off). A create of that image with the default disk and no"
            " network claims one instead of starting a container (workers/warm_pool.py)."
        ),
    )

    @model_validator(mode="after")
    def _local_passwords(self) -> Settings:
        return self.fill_local_passwords()

    def fill_local_passwords(self) -> Settings:
        """Fill in the local stack's passwords where the URLs carry none (and the
        files are readable: root's, on a host that has them). ``dsec up`` calls it
        again once it has made them."""
        for name in ("database_url", "admin_database_url"):
            url = urlsplit(getattr(self, name))
            if url.password is None and url.username:
                found = _secret(self.secrets_dir / f"postgres-{url.username}.password")
                if found is not None:
                    setattr(self, name, with_password(url, found))
        broker = urlsplit(self.celery_broker_url)
        if broker.scheme.startswith("redis") and broker.password is None:
            found = _secret(self.secrets_dir / "redis.password")
            if found is not None:
                self.celery_broker_url = with_password(broker, found)
        return self

    def node_metrics_port_of(self, node_id: str) -> int:
        """Node ``node_id``'s metrics port unless ``node_metrics_port`` says otherwise:
        metrics_port + 100 + the number its id ends in (0 when metrics are off)."""
        digits = node_id[len(node_id.rstrip("0123456789")) :]
        return self.metrics_port + 100 + int(digits or 0) if self.metrics_port else 0

    @property
    def topic_requests(self) -> str:
        return f"{self.topic_prefix}.requests"

    @property
    def topic_events(self) -> str:
        return f"{self.topic_prefix}.events"

    @property
    def topic_replies(self) -> str:
        return f"{self.topic_prefix}.replies"

    @property
    def topic_dead_letters(self) -> str:
        return f"{self.topic_prefix}.deadletters"

    @property
    def topic_probe(self) -> str:
        """Written by schedulers to prove the log commits writes; read by nobody."""
        return f"{self.topic_prefix}.probe"

    def replies_topic(self, tenant: str) -> str:
        """The topic a tenant reads its replies from (and no other tenant may)."""
        return f"{self.topic_prefix}.replies.{tenant}"

    @property
    def kafka_secrets_dir(self) -> Path:
        """What Kafka's brokers read (root only): their password file, their
        certificate, the CA's certificate."""
        return self.secrets_dir / "kafka"

    @property
    def kafka_logins_dir(self) -> Path:
        """The control plane's Kafka passwords, one file per principal (root only)."""
        return self.secrets_dir / "kafka-logins"

    @property
    def ca_dir(self) -> Path:
        """The stack's certificate authority: its key and certificate (root only)."""
        return self.secrets_dir / "ca"

    @property
    def master_key_path(self) -> Path:
        return self.master_key_file or self.secrets_dir / "master.key"

    def node_queue(self, node_id: str | None = None) -> str:
        """Celery queue a node's worker consumes."""
        return f"node.{node_id or self.node_id}"

    def node_topic(self, node_id: str | None = None) -> str:
        """A node's inbox: the Kafka topic its commands come on (workers/inbox.py)."""
        return f"{self.topic_prefix}.node.{node_id or self.node_id}"


def _secret(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:  # missing, or not ours to read
        return None


def with_password(url: SplitResult, password: str) -> str:
    """``url`` with ``password`` (quoted) for its user (none: Redis's bare password)."""
    host = url.netloc.rpartition("@")[2]
    user = quote(url.username or "", safe="")
    return urlunsplit(url._replace(netloc=f"{user}:{quote(password, safe='')}@{host}"))


def redact(url: str) -> str:
    """A URL fit to print: its password replaced."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """Settings of this process (read once)."""
    return Settings()
