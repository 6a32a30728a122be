"""A control host, brought up and down from settings alone (`dsec control up`,
`dsec control down`): the projector, the schedulers, the image hub, Flower and the
supervisor that restarts them, against a Kafka, a Postgres and a Redis that an
operator runs elsewhere.

Unlike `dsec up` it starts no broker, no Redis and no node, and it makes no database
roles: docs/deploy.md has the operator make those. It migrates the schema (as the
owner role of ``admin_database_url``), makes the master key and the operator's
credential where missing, and makes or checks the platform's topics.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError

from app import kafka_admin, taskqueue
from app.config import Settings
from app.control.hub_auth import hub_dir
from app.errors import ServiceUnavailable, first_line
from app.stack import broker, hub
from app.stack import services as stack
from app.stack.process import Service

#: The services of the embedded stack that are not a control host's: an operator's.
NOT_OURS = ("broker", "redis")


def check(settings: Settings) -> None:
    """Postgres and Redis answer; raises with the one that does not (Kafka is checked
    when the topics are made)."""
    from app.db.engine import engine_for

    where = make_url(settings.database_url)
    try:
        with engine_for(settings.database_url).connect() as conn:
            conn.execute(text("SELECT 1"))
    except SQLAlchemyError as exc:
        cause = getattr(exc, "orig", None) or exc
        raise ServiceUnavailable(
            f"Postgres at {where.host}:{where.port or 5432}/{where.database} refused"
            f" {where.username} or did not answer: {first_line(cause)}"
        ) from exc
    taskqueue.check_broker(settings)


def services(settings: Settings, schedulers: int | None = None) -> list[Service]:
    """A control host's services, in start order."""
    every = stack.services(settings, [], schedulers)
    return [s for s in every if s.name not in NOT_OURS]


def prepare(
    settings: Settings,
    log: Callable[[str], None],
    nodes: Sequence[str] = (),
    node_credentials: Path | None = None,
    kafka_internal: str | None = None,
) -> None:
    """What the control services need before they start, each step idempotent: the
    schema at head, the master key, Flower's password, the operator's credential, the
    topics, and a credential for each of ``nodes`` (copied into ``node_credentials``,
    one ``<id>.json`` each, where given). With ``kafka_internal`` (a broker's internal
    listener, ``host:port``), the stack's administrator principal is made first, as the
    brokers' own principal (the brokers' secrets are this host's: `dsec kafka secrets`)."""
    from app import credentials, secret_files
    from app.control import tenants
    from app.db.setup import migrate
    from app.domain.proof import Role

    check(settings)
    secret_files.ensure(settings.master_key_path)
    if kafka_internal is not None:
        host, _, port = kafka_internal.rpartition(":")
        broker.ensure_principals(settings, host, int(port), settings.kafka_secrets_dir / "ca.pem")
        log(f"kafka: the administrator principal, made on {kafka_internal}")
    migrate(settings)
    log("postgres: schema at head")
    secret_files.ensure(settings.master_key_path)
    secret_files.ensure(settings.secrets_dir / "flower.password", text=True)
    if settings.hub:
        hub.prepare(settings)
        log(f"hub: settings, certificate and token key in {hub_dir(settings)}")
    tenants.ensure(settings, Role.OPERATOR, stack.OPERATOR)
    for node in nodes:
        tenants.ensure(settings, Role.NODE, node)
        if node_credentials is not None:
            held = credentials.load(credentials.node_file(settings, node))
            out = credentials.save(held, node_credentials / f"{node}.json")
            log(f"node {node}: credential in {out}")
    findings = kafka_admin.ensure_topics(settings, tenants.reply_subjects(settings), nodes)
    log(f"kafka: topics ready at {settings.kafka_bootstrap}" + (" (see the log)" * bool(findings)))
    broker.ensure_service_principals(settings)
    tenants.sync_kafka(settings)
    log("kafka: principals and ACLs of the control plane, the operators, tenants and nodes")


def up(settings: Settings, schedulers: int, log: Callable[[str], None]) -> None:
    """Prepare the control host and start its services (reusing those that run)."""
    prepare(settings, log)
    stack.start_all(settings, services(settings, schedulers), log)


def down(settings: Settings, log: Callable[[str], None]) -> None:
    """Stop the control host's services, the supervisor first."""
    for service in reversed(services(settings)):
        if service.stop(settings):
            log(f"{service.name}: stopped")
