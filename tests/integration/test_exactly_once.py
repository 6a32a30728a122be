"""The projector survives SIGKILL at random moments with exactly-once effect."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from datetime import timedelta
from typing import Any

import pytest

from app import kafka_admin
from app.config import Settings
from app.domain.base import StopReason, utcnow
from app.domain.events import (
    CommandCompleted,
    CommandPayload,
    EventBase,
    RequestedPayload,
    SandboxRequested,
    SandboxStarted,
    SandboxStopped,
    StartedPayload,
    StoppedPayload,
)
from tests.conftest import PlatformPublisher, live_and_rebuilt, scalar, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SANDBOXES = 400  # x 5 events each


def lifecycle(tenant: str, sandbox_id: str) -> list[EventBase]:
    """Requested, Started, two commands, Stopped: what one short sandbox leaves."""
    request_id = uuid.uuid4()
    t0 = utcnow() - timedelta(seconds=30)
    common: dict[str, Any] = {"sandbox_id": sandbox_id, "tenant": tenant, "job_id": "crash"}
    out: list[EventBase] = [
        SandboxRequested(
            occurred_at=t0,
            payload=RequestedPayload(
                request_id=request_id, actor="t", image="img", cpus=2, memory_mb=512,
                disk_mb=64, ttl_s=60, network=False,
            ),
            **common,
        ),
        SandboxStarted(
            occurred_at=t0 + timedelta(seconds=1), node_id="n",
            payload=StartedPayload(request_id=request_id, container_id="c"),
            **common,
        ),
    ]  # fmt: skip
    for i in range(2):
        out.append(
            CommandCompleted(
                occurred_at=t0 + timedelta(seconds=2 + i),
                payload=CommandPayload(
                    request_id=uuid.uuid4(), actor="t", command="true", exit_code=0,
                    duration_ms=1.0, stdout_bytes=0, stderr_bytes=0,
                ),
                **common,
            )
        )  # fmt: skip
    out.append(
        SandboxStopped(
            occurred_at=t0 + timedelta(seconds=11),
            payload=StoppedPayload(reason=StopReason.DESTROYED),
            **common,
        )
    )
    return out


def test_sigkill_at_random_moments_loses_and_duplicates_nothing(stack: Settings, db: Any) -> None:
    # Given a private events topic and a projector process of its own
    prefix = f"crash{uuid.uuid4().hex[:6]}"
    settings = stack.model_copy(update={"topic_prefix": prefix})
    kafka_admin.ensure_topics(settings)
    tenant = f"crash-{uuid.uuid4().hex[:6]}"
    stream = [e for i in range(SANDBOXES) for e in lifecycle(tenant, f"sb-crash-{tenant}-{i}")]
    env = {**os.environ, "DSEC_TOPIC_PREFIX": prefix, "DSEC_METRICS_PORT": "0"}

    def produce() -> None:
        publisher = PlatformPublisher(settings)
        for i, event in enumerate(stream):
            publisher.publish(settings.topic_events, event.key, event)
            if i % 100 == 99:
                publisher.flush()
                time.sleep(0.05)  # a stream, not a burst: kills land mid-flow
        publisher.flush()
        publisher.close()

    producer = threading.Thread(target=produce)
    producer.start()
    rng = random.Random(7)
    kills = 0
    # When the projector is killed with SIGKILL at random moments, many times over
    while producer.is_alive() or kills < 6:
        proc = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "run", "projector"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        time.sleep(rng.uniform(0.8, 2.5))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills += 1
    producer.join()
    # And finally allowed to finish
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "run", "projector"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        with db() as conn:
            wait_for(
                lambda: (
                    scalar(conn, "SELECT count(*) FROM events WHERE tenant = :t", t=tenant)
                    >= len(stream)
                ),
                timeout_s=120,
                what="every event in the log",
            )
        time.sleep(1.0)  # anything duplicated would land now
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        kafka_admin.drop_topics(settings)  # a private prefix: nobody else reads them

    # Then the log holds each event exactly once
    with db() as conn:
        assert scalar(conn, "SELECT count(*) FROM events WHERE tenant = :t", t=tenant) == len(
            stream
        )
        assert scalar(
            conn, "SELECT count(DISTINCT event_id) FROM events WHERE tenant = :t", t=tenant
        ) == len(stream)
        # And the projections the killed projectors left equal a rebuild from the log
        assert (
            scalar(conn, "SELECT commands FROM usage WHERE tenant = :t", t=tenant) == 2 * SANDBOXES
        )
        assert (
            scalar(conn, "SELECT sandboxes_ended FROM usage WHERE tenant = :t", t=tenant)
            == SANDBOXES
        )
        assert (
            scalar(conn, "SELECT ended_core_seconds FROM usage WHERE tenant = :t", t=tenant)
            == 2 * 10 * SANDBOXES
        )
    assert kills >= 6
    live, rebuilt = live_and_rebuilt(stack)
    assert live ^ rebuilt == set()
