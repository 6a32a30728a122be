"""Postgres goes away under a running projector and scheduler and comes back: nothing
skipped, doubled or reordered, every request answered, and no one restarted anything.

The test starts a Postgres cluster of its own on a spare port (the machine's must not
be crashed) and the services on topics of their own; the events are proven with the
scheduler's key, as bench/ingest.py proves them.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from app import bus, tenants
from app.codec import encode
from app.config import Settings
from app.db.engine import engine_for
from app.db.setup import migrate
from app.domain.base import RejectReason, utcnow
from app.domain.events import RequestedPayload, SandboxRequested
from app.domain.proof import Purpose, headers
from app.errors import SandboxRejected
from app.keyring import Keyring
from app.sdk import Client
from tests.conftest import wait_for

pytestmark = pytest.mark.integration

PG_BIN = Path("/usr/lib/postgresql/15/bin")
REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Cluster:
    """A throwaway Postgres cluster run by the postgres system user."""

    data: Path
    port: int

    def ctl(self, *args: str) -> None:
        subprocess.run(
            ["runuser", "-u", "postgres", "--", str(PG_BIN / "pg_ctl"), "-D", str(self.data),
             "-l", str(self.data / "server.log"), *args],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip

    def start(self) -> None:
        opts = f"-p {self.port} -k {self.data} -c listen_addresses=127.0.0.1 -c fsync=on"
        self.ctl("-o", opts, "-w", "start")

    def crash(self) -> None:
        """Stop as a crash does: no checkpoint, WAL replayed on the next start."""
        self.ctl("-m", "immediate", "stop")


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    # Not under pytest's temporary directory: the postgres user cannot enter root's.
    home = Path(tempfile.mkdtemp(prefix="dsec-pg-outage-"))
    os.chmod(home, 0o755)
    data = home / "data"
    data.mkdir()
    shutil.chown(data, "postgres", "postgres")
    subprocess.run(
        ["runuser", "-u", "postgres", "--", str(PG_BIN / "initdb"), "-D", str(data),
         "--auth=trust", "-U", "postgres"],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    found = Cluster(data, _free_port())
    found.start()
    try:
        yield found
    finally:
        subprocess.run(
            ["runuser", "-u", "postgres", "--", str(PG_BIN / "pg_ctl"), "-D", str(data),
             "-m", "immediate", "stop"],
            capture_output=True, timeout=60,
        )  # fmt: skip
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="module")
def outage_settings(cluster: Cluster, stack: Settings) -> Iterator[Settings]:
    """The stack's settings with this cluster as the database and topics of their own."""
    base = f"127.0.0.1:{cluster.port}"
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
    bus.ensure_topics(settings)
    try:
        yield settings
    finally:
        bus.drop_topics(settings)
        engine_for(settings.database_url).dispose()


def publish(settings: Settings, tenant: str, first: int, count: int) -> None:
    """``count`` SandboxRequested events, proven with the scheduler's key."""
    signer = Keyring.from_settings(settings).scheduler
    publisher = bus.Publisher(settings)
    at = utcnow() - timedelta(seconds=5)
    for n in range(first, first + count):
        event = SandboxRequested(
            sandbox_id=f"sb-{tenant}-{n}", tenant=tenant, job_id="outage", occurred_at=at,
            payload=RequestedPayload(
                request_id=uuid.uuid4(), actor="outage", image="img", cpus=1, memory_mb=64,
                disk_mb=64, ttl_s=60, network=False,
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


def test_the_projector_waits_out_a_postgres_crash_and_loses_nothing(
    cluster: Cluster, outage_settings: Settings, tmp_path: Path
) -> None:
    settings = outage_settings
    tenant = f"pg{uuid.uuid4().hex[:6]}"
    env = {
        **os.environ,
        "DSEC_DATABASE_URL": settings.database_url,
        "DSEC_ADMIN_DATABASE_URL": settings.admin_database_url,
        "DSEC_TOPIC_PREFIX": settings.topic_prefix,
        "DSEC_METRICS_PORT": "0",
    }
    log_path = tmp_path / "projector.log"
    with open(log_path, "wb") as out:
        projector = subprocess.Popen(
            [str(REPO / ".venv" / "bin" / "dsec"), "run", "projector"],
            env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
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
        assert len({r.event_id for r in rows}) == len(rows) == 600
        by_partition: dict[int, list[int]] = {}
        for r in rows:
            by_partition.setdefault(r.partition, []).append(r.offset)
        for partition, offsets in by_partition.items():
            # appended in offset order, none skipped, and the stored position after them
            assert offsets == list(range(len(offsets))), partition
            assert stored[partition] == len(offsets)
        assert projector.poll() is None
    finally:
        projector.send_signal(signal.SIGTERM)
        try:
            projector.wait(timeout=20)
        except subprocess.TimeoutExpired:
            projector.kill()


def test_the_scheduler_answers_every_request_across_a_postgres_crash(
    cluster: Cluster, outage_settings: Settings, tmp_path: Path
) -> None:
    settings = outage_settings
    tenant = f"pgt{uuid.uuid4().hex[:6]}"
    tenants.local(settings, tenant)  # its credential, in this cluster's database
    env = {
        **os.environ,
        "DSEC_DATABASE_URL": settings.database_url,
        "DSEC_ADMIN_DATABASE_URL": settings.admin_database_url,
        "DSEC_TOPIC_PREFIX": settings.topic_prefix,
        "DSEC_METRICS_PORT": str(_free_port()),
    }
    log_path = tmp_path / "scheduler.log"
    with open(log_path, "wb") as out:
        scheduler = subprocess.Popen(
            [str(REPO / ".venv" / "bin" / "dsec"), "run", "scheduler"],
            env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        with Client(settings, tenant=tenant, job_id="outage", timeout_s=120) as client:
            # Given a scheduler that answers (no node here: a create is refused at once)
            with pytest.raises(SandboxRejected) as before:
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
                    with pytest.raises(SandboxRejected) as refused:
                        answer.result(timeout=120)
                    assert refused.value.reason == RejectReason.NO_NODES
        assert scheduler.poll() is None
        assert "waiting for postgres" in log_path.read_text().lower() or (
            "waits for a backing service" in log_path.read_text()
        )
    finally:
        scheduler.send_signal(signal.SIGTERM)
        try:
            scheduler.wait(timeout=20)
        except subprocess.TimeoutExpired:
            scheduler.kill()
