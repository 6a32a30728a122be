"""Postgres goes away under a running projector and scheduler and comes back: nothing
skipped, doubled or reordered, every request answered, and no one restarted anything.

The test starts a Postgres cluster of its own on a spare port (the machine's must not
be crashed) and the services on topics of their own; the events are proven with the
scheduler's key, as bench/ingest.py proves them.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from app import bus, kafka_admin
from app.config import Settings
from app.control import tenants
from app.control.keyring import Keyring
from app.db.engine import engine_for
from app.db.setup import migrate
from app.domain.base import RejectReason, utcnow
from app.domain.codec import encode
from app.domain.events import RequestedPayload, SandboxRequested
from app.domain.proof import Purpose, headers
from app.errors import SandboxRejectedError
from app.sdk import Client
from tests.conftest import free_port, wait_for
from tests.pg_cluster import Cluster, own_cluster
from tests.side_platform import dsec_service

pytestmark = pytest.mark.integration


@contextmanager
def settings_for(cluster: Cluster, stack: Settings) -> Iterator[Settings]:
    """The stack's settings with ``cluster`` as the database and topics of their own."""
    base = f"{cluster.host}:{cluster.port}"
    su = create_engine(
        f"postgresql+psycopg://postgres@{base}/postgres", isolation_level="AUTOCOMMIT"
    )
    with su.connect() as conn:
        conn.execute(text("CREATE ROLE dsec_owner LOGIN CREATEDB"))
        conn.execute(text("CREATE ROLE dsec_app LOGIN"))
        conn.execute(text("CREATE DATABASE dsec OWNER dsec_owner"))
    su.dispose()
    settings = stack.model_copy(
        update={
            "database_url": f"postgresql+psycopg://dsec_app@{base}/dsec",
            "admin_database_url": f"postgresql+psycopg://dsec_owner@{base}/dsec",
            "topic_prefix": f"pgout{uuid.uuid4().hex[:6]}",
        }
    )
    migrate(settings)
    kafka_admin.ensure_topics(settings)
    try:
        yield settings
    finally:
        kafka_admin.drop_topics(settings)
        engine_for(settings.database_url).dispose()
        engine_for(settings.admin_database_url).dispose()


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with own_cluster() as found:
        yield found


@pytest.fixture(scope="module")
def outage_settings(cluster: Cluster, stack: Settings) -> Iterator[Settings]:
    with settings_for(cluster, stack) as settings:
        yield settings


@contextmanager
def service(settings: Settings, name: str, log_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``dsec run <name>`` on ``settings``'s database and topics, stopped at the end."""
    env = {
        **os.environ,
        "DSEC_DATABASE_URL": settings.database_url,
        "DSEC_ADMIN_DATABASE_URL": settings.admin_database_url,
        "DSEC_TOPIC_PREFIX": settings.topic_prefix,
        "DSEC_METRICS_PORT": str(free_port()),
    }
    with dsec_service(["run", name], env, log_path) as process:
        yield process


def publish(settings: Settings, tenant: str, first: int, count: int, labels: int = 0) -> None:
    """``count`` SandboxRequested events (``labels`` of 60 bytes each), proven with the
    scheduler's key."""
    signer = Keyring.from_settings(settings).scheduler
    publisher = bus.Publisher(settings)
    at = utcnow() - timedelta(seconds=5)
    for n in range(first, first + count):
        event = SandboxRequested(
            sandbox_id=f"sb-{tenant}-{n}", tenant=tenant, job_id="outage", occurred_at=at,
            payload=RequestedPayload(
                request_id=uuid.uuid4(), actor="outage", image="img", cpus=1, memory_mb=64,
                disk_mb=64, ttl_s=60, network=False,
                labels={f"k{i}": uuid.uuid4().hex + "x" * 16 for i in range(labels)},
            ),
        )  # fmt: skip
        value = encode(event)
        proof = headers(Purpose.EVENT, signer.principal.key_id, signer.secret, value)
        publisher.publish(settings.topic_events, event.key, value, headers=proof)
    publisher.flush()
    publisher.close()


def logged(settings: Settings, tenant: str) -> int:
    with engine_for(settings.database_url).connect() as conn:
        return int(
            conn.execute(text("SELECT count(*) FROM events WHERE tenant = :t"), {"t": tenant})
            .scalar() or 0
        )  # fmt: skip


def assert_once_and_in_order(settings: Settings, tenant: str, count: int) -> None:
    """``count`` events of ``tenant`` in the log, each once, each partition's in offset
    order with none skipped, and the projector's stored positions just after them."""
    with engine_for(settings.database_url).connect() as conn:
        rows = conn.execute(
            text(
                'SELECT partition, "offset", event_id FROM events WHERE tenant = :t'
                " ORDER BY partition, position"
            ),
            {"t": tenant},
        ).all()
        stored = dict(
            conn.execute(
                text(
                    "SELECT partition, next_offset FROM consumer_offsets"
                    " WHERE consumer = 'projector' AND topic = :topic"
                ),
                {"topic": settings.topic_events},
            ).all()
        )
    assert len({r.event_id for r in rows}) == len(rows) == count
    by_partition: dict[int, list[int]] = {}
    for r in rows:
        by_partition.setdefault(r.partition, []).append(r.offset)
    for partition, offsets in by_partition.items():
        assert offsets == list(range(len(offsets))), partition
        assert stored[partition] == len(offsets)


def test_the_projector_waits_out_a_postgres_crash_and_loses_nothing(
    cluster: Cluster, outage_settings: Settings, tmp_path: Path
) -> None:
    settings = outage_settings
    tenant = f"pg{uuid.uuid4().hex[:6]}"
    log_path = tmp_path / "projector.log"
    with service(settings, "projector", log_path) as projector:
        # Given a projector appending events
        publish(settings, tenant, 0, 300)
        wait_for(lambda: logged(settings, tenant) == 300, 60, "the first 300 events in the log")
        engine_for(settings.database_url).dispose()

        # When Postgres crashes, and events keep coming while it is down
        cluster.crash()
        publish(settings, tenant, 300, 300)
        time.sleep(4)

        # Then the projector is still there, saying what it waits for
        assert projector.poll() is None, log_path.read_text()[-3000:]
        wait_for(lambda: "waiting for postgres" in log_path.read_text(), 30, "the projector's wait")

        # When Postgres comes back
        cluster.start()

        # Then every event is in the log once, each partition in its offsets' order
        wait_for(lambda: logged(settings, tenant) == 600, 120, "all 600 events in the log")
        assert_once_and_in_order(settings, tenant, 600)
        assert projector.poll() is None


def test_the_scheduler_answers_every_request_across_a_postgres_crash(
    cluster: Cluster, outage_settings: Settings, tmp_path: Path
) -> None:
    settings = outage_settings
    tenant = f"pgt{uuid.uuid4().hex[:6]}"
    tenants.local(settings, tenant)  # its credential, in this cluster's database
    log_path = tmp_path / "scheduler.log"
    with (
        service(settings, "scheduler", log_path) as scheduler,
        Client(settings, tenant=tenant, job_id="outage", timeout_s=120) as client,
    ):
        # Given a scheduler that answers (no node here: a create is refused at once)
        with pytest.raises(SandboxRejectedError) as before:
            client.create(queue_s=0)
        assert before.value.reason == RejectReason.NO_NODES

        # When Postgres crashes and creates arrive meanwhile
        cluster.crash()
        with ThreadPoolExecutor(8) as pool:
            answers = [pool.submit(client.create, queue_s=0) for _ in range(8)]
            time.sleep(4)
            assert scheduler.poll() is None, log_path.read_text()[-3000:]
            # And Postgres comes back
            cluster.start()
            # Then every one of them is answered, none lost to the outage
            for answer in answers:
                with pytest.raises(SandboxRejectedError) as refused:
                    answer.result(timeout=120)
                assert refused.value.reason == RejectReason.NO_NODES
        assert scheduler.poll() is None
        said = log_path.read_text()
        assert "waiting for postgres" in said or "waits for a backing service" in said


def test_a_full_disk_under_postgres_makes_the_projector_wait_not_skip(
    stack: Settings, tmp_path: Path
) -> None:
    with own_cluster(data_mb=160) as full, settings_for(full, stack) as settings:
        tenant = f"pgf{uuid.uuid4().hex[:6]}"
        # Given a database whose disk has ~3 MB left
        free = os.statvfs(full.data)
        filler = full.data / "filler"
        with open(filler, "wb") as f:
            f.write(b"\0" * max(0, free.f_bavail * free.f_frsize - 3 * 2**20))
        log_path = tmp_path / "projector.log"
        with service(settings, "projector", log_path) as projector:
            # When more events come than the disk can hold
            publish(settings, tenant, 0, 4000, labels=8)
            wait_for(lambda: "No space left on device" in log_path.read_text(), 120, "a full disk")
            stuck = logged(settings, tenant)
            time.sleep(3)
            # Then the projector waits: nothing is dead-lettered or skipped meanwhile
            assert projector.poll() is None, log_path.read_text()[-3000:]
            assert stuck < 4000 and logged(settings, tenant) == stuck
            assert "unstorable" not in log_path.read_text().lower()
            # When room is made, everything arrives, once and in order
            filler.unlink()
            wait_for(lambda: logged(settings, tenant) == 4000, 180, "all 4000 events")
            assert_once_and_in_order(settings, tenant, 4000)
