"""The embedded stack on one machine: start, stop and report its services.

Postgres is reused where it already answers; the Makefile's bootstrap installs and
starts it where it does not. The broker (Apache Kafka, fetched and prepared by
:mod:`app.stack.broker`), the stack's own Redis, the scheduler, the projector, the
node worker(s) and Flower are started here as detached processes with pid files and
logs under the state directory.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import time
from collections.abc import Callable, Collection
from functools import partial
from urllib.parse import urlparse

from sqlalchemy.engine import make_url

from app.config import Settings
from app.domain.kafka_access import PROJECTOR, SCHEDULER
from app.errors import ServiceUnavailable
from app.stack import broker, hub, kafka_dist
from app.stack.process import Service, port_open, wait_until


def node_ids(settings: Settings, nodes: int) -> list[str]:
    """Ids of the embedded nodes: the configured one, then numbered siblings
    (``node0`` -> ``node1``, ``node2``; ``edge`` -> ``edge1``, ``edge2``)."""
    base = settings.node_id.rstrip("0123456789")
    digits = settings.node_id[len(base) :]
    first = int(digits) if digits else 0
    siblings = [f"{base}{first + i}" for i in range(1, max(nodes, 1))]
    return [settings.node_id, *siblings]


def known_node_ids(settings: Settings) -> list[str]:
    """The configured node and every node whose worker left a pid file."""
    run = settings.state_dir / "run"
    found = sorted(p.name[len("worker-") : -len(".pid")] for p in run.glob("worker-*.pid"))
    return [settings.node_id, *(n for n in found if n != settings.node_id)]


def scheduler_names(count: int) -> list[str]:
    """The services of ``count`` schedulers: ``scheduler``, ``scheduler-2`` ..."""
    return ["scheduler", *(f"scheduler-{i}" for i in range(2, count + 1))]


def known_schedulers(settings: Settings) -> int:
    """The configured schedulers, or more if more left pid files (a stack brought up
    with a larger DSEC_SCHEDULERS: `down` and the supervisor still see them)."""
    run = settings.state_dir / "run"
    numbered = [p.name[len("scheduler-") : -len(".pid")] for p in run.glob("scheduler-*.pid")]
    found = [int(n) for n in numbered if n.isdigit()]
    return max([settings.schedulers, *found])


def scheduler_service(settings: Settings, index: int) -> Service:
    """The ``index``-th scheduler (0-based), with a metrics port of its own."""
    # The projector serves on metrics_port; the schedulers on the ports after it.
    port = settings.metrics_port + 1 + index if settings.metrics_port else 0
    return Service(
        scheduler_names(index + 1)[-1],
        [sys.executable, "-m", "app.cli", "run", "scheduler"],
        endpoint=f"http://{settings.metrics_host}:{port}/metrics" if port else "",
        env={"DSEC_SCHEDULER_METRICS_PORT": str(port), **kafka_env(settings, SCHEDULER)},
    )


def kafka_env(settings: Settings, principal: str) -> dict[str, str]:
    """How a control-plane process is told its Kafka principal (its password stays in
    a root-only file)."""
    return {
        "DSEC_KAFKA_SASL_USERNAME": principal,
        "DSEC_KAFKA_SASL_PASSWORD_FILE": str(broker.password_file(settings, principal)),
    }


def services(
    settings: Settings, nodes: int | list[str] = 1, schedulers: int | None = None
) -> list[Service]:
    """Every process of the embedded stack, in start order (nodes: a count or ids;
    schedulers: how many, default :func:`known_schedulers`)."""
    py = sys.executable
    host, port, _tls, internal, _controller = broker.ports(settings)
    out = [
        Service(
            "broker",
            broker.command(kafka_dist.libs_dir(settings), broker.properties_file(settings)),
            endpoint=f"kafka://{host}:{port} (Apache Kafka {kafka_dist.KAFKA_VERSION})",
            ready=lambda: port_open(host, port) and port_open(host, internal),
            runs_our_code=False,
            config=broker.properties_file(settings),
        ),
        redis_service(settings),
        *hub.services(settings),
        Service(
            "projector",
            [py, "-m", "app.cli", "run", "projector"],
            endpoint=f"http://{settings.metrics_host}:{settings.metrics_port}/metrics",
            env=kafka_env(settings, PROJECTOR),
        ),
        *(
            scheduler_service(settings, i)
            for i in range(known_schedulers(settings) if schedulers is None else schedulers)
        ),
    ]
    for node in nodes if isinstance(nodes, list) else node_ids(settings, nodes):
        metrics = settings.node_metrics_port_of(node)
        out.append(
            Service(
                f"worker-{node}",
                [py, "-m", "app.cli", "run", "worker", "--node", node],
                endpoint=(
                    f"celery queue {settings.node_queue(node)},"
                    f" http://{settings.metrics_host}:{metrics}/metrics"
                ),
                env={"DSEC_NODE_ID": node, "DSEC_NODE_METRICS_PORT": str(metrics)},
            )
        )
    out.append(
        Service(
            "flower",
            [
                py,
                "-m",
                "celery",
                # The app, not `-b URL`: a password on the command line is anyone's to read.
                "-A",
                "app.control.flower_app",
                "flower",
                f"--port={settings.flower_port}",
                f"--address={settings.flower_host}",
                "dsec-flower",
            ],
            endpoint=f"http://{settings.flower_host}:{settings.flower_port}",
            # Basic auth from a root-only file, passed in the environment (which only
            # its user reads); its HTTP API then needs the same credentials.
            env={"FLOWER_BASIC_AUTH": f"{FLOWER_USER}:{flower_password(settings)}"},
            ready=lambda: port_open(settings.flower_host, settings.flower_port),
        )
    )
    # Last up, first down: it must not start again what `dsec down` is stopping.
    out.append(Service(SUPERVISOR, [py, "-m", "app.cli", "run", "supervisor"]))
    return out


#: The service that restarts the others (app/stack/supervisor.py).
SUPERVISOR = "supervisor"


#: The user Flower asks for (its password is <secrets_dir>/flower.password).
FLOWER_USER = "dsec"


def flower_password(settings: Settings) -> str:
    """Flower's password ('' where it is not readable: ``up`` makes it, root only)."""
    from app import secret_files

    return secret_files.read_text(settings.secrets_dir / "flower.password") or ""


def redis_service(settings: Settings) -> Service:
    """The stack's own Redis (the Celery broker): a password, and an append-only file
    so that creation tasks queued when it restarts are not lost (fsync every second).
    Its configuration, password included, is a root-only file, not its command line."""
    parts = urlparse(settings.celery_broker_url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 6379
    conf = settings.state_dir / "redis" / "redis.conf"
    return Service(
        "redis",
        ["redis-server", str(conf)],
        endpoint=f"redis://{host}:{port}",
        ready=lambda: port_open(host, port),
        runs_our_code=False,
        config=conf,
        title=f"redis-server {host}:{port}".encode(),
    )


def write_redis_conf(settings: Settings) -> None:
    """The configuration :func:`redis_service` starts with (rewritten each `up`)."""
    from app import secret_files

    parts = urlparse(settings.celery_broker_url)
    password = secret_files.ensure(settings.secrets_dir / "redis.password", text=True).decode()
    home = settings.state_dir / "redis"
    home.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(home, 0o700)
    conf = home / "redis.conf"
    body = "\n".join(
        [
            f"bind {parts.hostname or '127.0.0.1'}",
            f"port {parts.port or 6379}",
            "protected-mode yes",
            f"requirepass {password}",
            f"dir {home}",
            "appendonly yes",
            "appendfsync everysec",
            'save ""',
            f"logfile {settings.state_dir / 'logs' / 'redis-server.log'}",
            "daemonize no",
            # Its background rounds (expiry, client timeouts) 2 times a second, not 10:
            # an idle stack's Redis then costs a third of what it did; nothing here
            # needs keys to expire sooner than the next read of them.
            "hz 2",
            "",
        ]
    )
    fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(body)
    settings.fill_local_passwords()


def check_backing_services(settings: Settings) -> None:
    """Postgres must answer (the bootstrap installs it where missing); Redis and the
    broker are the stack's own, from tools the bootstrap installs."""
    pg = make_url(settings.admin_database_url)
    if not port_open(pg.host or "127.0.0.1", pg.port or 5432, 2.0):
        raise ServiceUnavailable(
            f"Postgres is not answering on {pg.host}:{pg.port or 5432} (run `make bootstrap`)"
        )
    for tool in ("redis-server", "java", "mvn"):
        if shutil.which(tool) is None:
            raise ServiceUnavailable(f"{tool} is not installed (run `make bootstrap`)")
    if settings.hub and shutil.which("docker-registry") is None:
        raise ServiceUnavailable("docker-registry is not installed (run `make bootstrap`)")
    for tool in ("podman", "runc", "newuidmap"):
        if shutil.which(tool) is None:
            raise ServiceUnavailable(f"{tool} is not installed (run `make bootstrap`)")


def prepare_node_store(settings: Settings) -> None:
    """The shared read-only layer store with the base image, and the agent binaries."""
    from app.images.store import import_busybox_image
    from workers.agent.build import ensure_agent_dir

    ensure_agent_dir(settings.state_dir / "agent")
    import_busybox_image()


#: The local stack's operator credential (the CLI acts on others' sandboxes with it).
OPERATOR = "operator"


def ensure_credentials(settings: Settings, nodes: list[str]) -> None:
    """The master key, the default tenant's, the operator's and each local node's
    credential, every tenant's replies topic and node's inbox, and the broker's
    principals and ACLs matching the credentials."""
    from app import kafka_admin, secret_files
    from app.control import tenants
    from app.domain.proof import Role

    secret_files.ensure(settings.master_key_path)
    tenants.ensure(settings, Role.TENANT, settings.default_tenant)
    tenants.ensure(settings, Role.OPERATOR, OPERATOR)
    for node in nodes:
        tenants.ensure(settings, Role.NODE, node)
    kafka_admin.ensure_topics(settings, tenants.reply_subjects(settings), nodes)
    tenants.sync_kafka(settings)


def scheduler_partitions(settings: Settings) -> dict[int, list[int]] | None:
    """Partitions of the requests topic each scheduler process of this host owns, by
    its pid, as Postgres's locks say (None: Postgres did not answer)."""
    from app.control.dispatch import NAME
    from app.db.engine import transaction
    from app.db.partition_locks import read_holders

    try:
        with transaction(settings.database_url) as conn:
            holders = read_holders(conn, NAME, settings.topic_requests)
    except Exception:
        return None
    host = socket.gethostname()
    by_backend: dict[int, int] = {}
    for backend, name in holders.names.items():
        kind, _, where = name.partition(" ")
        process_host, _, pid = where.rpartition(":")
        if kind == "dsec-scheduler" and process_host == host and pid.isdigit():
            by_backend[backend] = int(pid)
    owned: dict[int, list[int]] = {pid: [] for pid in by_backend.values()}
    for partition, backend in sorted(holders.partitions.items()):
        if backend in by_backend:
            owned[by_backend[backend]].append(partition)
    return owned


def node_alive(settings: Settings, node: str, since: float) -> bool:
    """The node's heartbeat reached the projection after ``since`` (epoch seconds)."""
    from app.db import queries
    from app.db.engine import transaction

    try:
        with transaction(settings.database_url) as conn:
            seen = queries.node_heartbeat(conn, node)
    except Exception:
        return False
    return seen is not None and seen.timestamp() >= since - 1


def schedulers_place_on(settings: Settings, node: str) -> bool:
    """Every scheduler of the stack places sandboxes on ``node``, as its metrics say
    (a heartbeat in the projection is not yet one the schedulers have read)."""
    from app.metrics import NODE_PLACEABLE, sample, scrape

    for index in range(settings.schedulers):
        endpoint = scheduler_service(settings, index).endpoint
        if not endpoint:
            continue  # metrics off: the heartbeat is all there is to wait for
        try:
            placeable = sample(scrape(endpoint, timeout_s=2), NODE_PLACEABLE, node=node)
        except OSError:
            return False
        if placeable != 1.0:
            return False
    return True


def start_all(settings: Settings, each: list[Service], log: Callable[[str], None]) -> None:
    """Start ``each`` service (again where it runs other code) and wait until ready."""
    for service in each:
        replaced = service.stale(settings)
        started = service.start(settings)
        said = "restarted: it ran other code" if replaced else "started"
        log(f"{service.name}: {said if started else 'already running'}")
    for service in each:
        if service.ready is not None:
            wait_until(service.ready, 60, service.name)


def up(settings: Settings, nodes: int = 1, log: Callable[[str], None] = print) -> list[Service]:
    """Bring the whole embedded stack up; reuse whatever already runs."""
    from app import kafka_admin, secret_files
    from app.db.roles import ensure_roles
    from app.db.setup import ensure_database, migrate

    check_backing_services(settings)
    started_at = time.time()
    write_redis_conf(settings)
    secret_files.ensure(settings.secrets_dir / "flower.password", text=True)
    secret_files.ensure(settings.master_key_path)
    broker.prepare(settings)  # jars (fetched once), secrets, properties, formatted log
    if settings.hub:
        hub.prepare(settings)  # its settings, certificate and token key
    stack = services(settings, nodes)
    kafka, redis, rest = stack[0], stack[1], stack[2:]
    for backing, what in ((kafka, "Apache Kafka"), (redis, "Redis")):
        ready = backing.ready is not None and backing.ready()
        changed = ready and backing.stale(settings)
        if ready and not changed:
            log(f"{backing.name}: reusing {backing.endpoint}")
        else:
            backing.start(settings)
            wait_until(backing.ready or (lambda: True), 90, what)
            said = "restarted: its settings changed" if changed else "started"
            log(f"{backing.name}: {said} on {backing.endpoint}")
    host, _port, _tls, internal, _controller = broker.ports(settings)
    broker.ensure_principals(settings, host, internal)
    log("kafka: SASL/SCRAM principals and ACLs of the control plane")
    ensure_roles(settings)
    log("postgres: roles dsec_owner and dsec_app with passwords")
    ensure_database(settings)
    migrate(settings)
    log("postgres: schema at head")
    kafka_admin.ensure_topics(settings)
    ensure_credentials(settings, node_ids(settings, nodes))
    log(f"credentials: in {settings.secrets_dir} (root only); kafka: topics ready")
    prepare_node_store(settings)
    log(f"layer store: {settings.layer_store} has {settings.default_image}")
    start_all(settings, rest, log)
    workers = {s.name: s for s in rest}
    for node in node_ids(settings, nodes):
        try:
            wait_until(
                partial(node_alive, settings, node, started_at), 120, f"node {node} heartbeat"
            )
            wait_until(
                partial(schedulers_place_on, settings, node), 30, f"placement on node {node}"
            )
        except ServiceUnavailable as exc:
            # Say why: the worker's and the projector's own last words.
            tails = "\n".join(
                f"--- last lines of {s.logfile(settings)}:\n{s.log_tail(settings)}"
                for s in (workers[f"worker-{node}"], workers["projector"])
            )
            raise ServiceUnavailable(f"{exc}\n{tails}") from exc
        log(f"node {node}: alive")
    return stack


def down(
    settings: Settings, log: Callable[[str], None] = print, keep: Collection[str] = ()
) -> None:
    """Stop every process the stack started but those named in ``keep``.

    Postgres and Redis are always left alone; ``podman`` in ``keep`` spares the
    nodes' Podman services.
    """
    from workers.host.podman_service import stop_all_podman_services

    for service in reversed(services(settings, known_node_ids(settings))):
        if service.name not in keep and service.stop(settings):
            log(f"{service.name}: stopped")
    if "podman" not in keep:
        stop_all_podman_services()
        log("podman services: stopped")
