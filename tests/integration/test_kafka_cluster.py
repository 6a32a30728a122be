"""Three Apache Kafka brokers (replication 3, min.insync.replicas 2), as production
runs them: the broker that leads the requests and events is SIGKILLed under a
trainer's workload, and commands keep being answered, each in the log once; with two
of three down, a trainer hears a clear refusal instead of waiting; when they return,
everything resumes by itself.

The brokers, a scheduler, a projector and a node worker are the test's own
(app/stack/local_cluster.py, tests/side_platform.py); Postgres and Redis are the
stack's.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from app.config import Settings
from app.errors import DsecError, ServiceUnavailable
from app.sdk import Client
from app.stack import local_cluster
from app.stats import percentile
from tests.conftest import declare_lost, wait_for
from tests.side_platform import first_sandbox, side_platform
from workers.host.mounts import remove_tree

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NODE = "node4"
TRAINERS = 4


@pytest.fixture(scope="module")
def cluster(stack: Settings) -> Iterator[tuple[local_cluster.Cluster, Settings]]:
    state = Path(tempfile.mkdtemp(prefix="dsec-cluster-"))
    os.chmod(state, 0o755)  # the node user walks through it to its home
    try:
        with (
            local_cluster.running(stack, 3, state / "kafka", subjects=["tests", NODE]) as brokers,
            side_platform(stack, NODE, state, kafka=brokers.settings, projector=True) as side,
        ):
            yield brokers, side
    finally:
        declare_lost(stack, [NODE])
        remove_tree(state)


class Trainer(threading.Thread):
    """Commands one after another in a sandbox of its own, each a unique token."""

    def __init__(self, box: Any, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.box, self.stop = box, stop
        self.sent: list[str] = []
        self.answered: dict[str, tuple[float, float]] = {}  # token -> (sent at, seconds)
        self.failed: list[str] = []

    def run(self) -> None:
        while not self.stop.is_set():
            token = uuid.uuid4().hex[:12]
            self.sent.append(token)
            at = time.monotonic()
            try:
                result = self.box.exec(f"echo {token}", timeout_s=30)
            except DsecError as exc:
                self.failed.append(f"{token}: {exc}")
                continue
            assert result.text == f"{token}\n"
            self.answered[token] = (at, time.monotonic() - at)


def _logged(settings: Settings, job: str) -> Counter[str]:
    from app.db.engine import transaction

    with transaction(settings.database_url) as conn:
        rows = conn.execute(
            text(
                "SELECT payload->>'command' FROM events"
                " WHERE job_id = :j AND type = 'CommandCompleted'"
            ),
            {"j": job},
        ).scalars()
        return Counter(str(r).removeprefix("echo ") for r in rows)


def test_a_leaders_death_loses_and_doubles_no_command(
    cluster: tuple[local_cluster.Cluster, Settings],
) -> None:
    brokers, settings = cluster
    job = f"failover-{uuid.uuid4().hex[:6]}"
    stop = threading.Event()
    with Client(settings, tenant="tests", job_id=job) as client:
        first = first_sandbox(client, NODE)
        boxes = [first, *client.create_many(TRAINERS - 1, memory_mb=32)]
        trainers = [Trainer(box, stop) for box in boxes]
        for t in trainers:
            t.start()
        time.sleep(3)
        # When the broker leading the requests and the events is SIGKILLed (and the
        # trainers go on past the new leaders' election, ~5 s)
        victim = brokers.leader(settings.topic_requests, 0)
        killed_at = time.monotonic()
        victim.kill()
        time.sleep(15)
        stop.set()
        for t in trainers:
            t.join(timeout=90)
        victim.start()
        for box in boxes:
            box.close()
    # Then every command was answered, and the log holds each one once
    sent = [token for t in trainers for token in t.sent]
    failed = [f for t in trainers for f in t.failed]
    assert not failed, failed[:5]
    answered = {k: v for t in trainers for k, v in t.answered.items()}
    assert set(answered) == set(sent)

    def all_logged() -> Counter[str] | None:
        found = _logged(settings, job)
        return found if set(found) >= set(sent) else None

    logged = wait_for(all_logged, 60, "every command in the log")
    doubled = {token: n for token, n in logged.items() if n > 1}
    assert not doubled, doubled
    during = [took for at, took in answered.values() if killed_at <= at + took <= killed_at + 30]
    print(
        f"failover: {len(sent)} commands, {len(during)} answered in the 30 s after the kill,"
        f" p99 {percentile(during, 99) * 1000:.0f} ms"
    )
    wait_for(victim.ready, 120, "the killed broker back")


def test_two_of_three_down_refuses_clearly_and_resumes(
    cluster: tuple[local_cluster.Cluster, Settings],
) -> None:
    brokers, settings = cluster
    # (a client that would rather fail fast than sit out a broker's restart)
    with Client(settings, tenant="tests", job_id="two-down", delivery_timeout_s=15) as client:
        box = first_sandbox(client, NODE)
        assert box.exec("echo before").text == "before\n"
        # When two of the three brokers die, the trainer's request cannot be stored
        # on two replicas: it is refused with the reason, not left waiting for good
        down = [m for m in brokers.members if m.plan.node_id != 1][:2]
        for member in down:
            member.kill()
        started = time.monotonic()
        with pytest.raises(ServiceUnavailable, match=r"(?i)replica|broker|kafka"):
            box.exec("echo during", timeout_s=5)
        assert time.monotonic() - started < 120
        # And when they return, the same client and sandbox work again by themselves
        for member in down:
            member.start()
        for member in down:
            wait_for(member.ready, 120, "a broker back")

        def served() -> bool:
            try:
                return bool(box.exec("echo after", timeout_s=10).text == "after\n")
            except DsecError:
                return False

        assert wait_for(served, 180, "commands answered again")
