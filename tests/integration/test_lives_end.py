"""Every life ends (issue 28), as the faults that left lives open did: a create whose
task was lost with its node's worker and Redis, and lives on a node declared lost
after the scheduler that placed them stopped.

Each runs on a side platform (tests/side_platform.py): its own topics, database,
scheduler, projector and node, so what it breaks is its own, and `dsec doctor` on its
database is clean at the end.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib
from sqlalchemy import text

from app.config import Settings
from app.db import doctor
from app.db.engine import transaction
from app.errors import SandboxError
from app.sdk import Client
from app.stack.services import write_redis_conf
from tests.conftest import declare_lost, free_port, wait_for
from tests.integration.test_redis_restart import RedisServer
from tests.side_platform import first_sandbox, side_setup
from workers.host.mounts import remove_tree
from workers.host.user import user_name

pytestmark = [pytest.mark.integration, pytest.mark.slow]

#: A create older than this is refused by its node; DSEC_CREATE_GRACE_S after it, a
#: placement not started ends create_lost (short here, 300 s and 60 s by default).
MAX_AGE_S, GRACE_S = 20, 5


@pytest.fixture
def state() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="dsec-lives-"))
    os.chmod(path, 0o755)  # the node user walks through it to its home
    try:
        yield path
    finally:
        remove_tree(path)


def _one(settings: Settings, sql: str, **params: Any) -> Any:
    with transaction(settings.database_url) as conn:
        return conn.execute(text(sql), params).first()


def _holds_a_task(client: Any) -> bool:
    """A queue (a Redis list) of ``client``'s holds a message."""
    return any(client.type(key) == b"list" and client.llen(key) for key in client.keys("*"))


def _sound(settings: Settings, since: datetime) -> None:
    """`dsec doctor` finds nothing on the side platform's database."""
    found = doctor.examine(settings, since, timedelta(seconds=5))
    assert found == [], [f.row() for f in found]


def test_a_create_lost_with_its_worker_and_redis_ends_create_lost_and_frees_its_room(
    stack: Settings, state: Path
) -> None:
    began = datetime.now(UTC)
    node = "node7"
    # A Redis of the test's own, which loses what it held (its host crashed within its
    # fsync second): the side node's queue lives there
    port = free_port()
    redis_settings = stack.model_copy(
        update={"state_dir": state, "celery_broker_url": f"redis://127.0.0.1:{port}/0"}
    )
    (state / "logs").mkdir()
    write_redis_conf(redis_settings)
    redis = RedisServer(state / "redis" / "redis.conf", redis_settings.celery_broker_url)
    redis.start()
    env = {
        "DSEC_CELERY_BROKER_URL": redis_settings.celery_broker_url,
        "DSEC_REQUEST_MAX_AGE_S": str(MAX_AGE_S),
        "DSEC_CREATE_GRACE_S": str(GRACE_S),
        "DSEC_NODE_CAPACITY_SANDBOXES": "1",  # room for one: a lost create holds it all
        "DSEC_WARM_POOL": "{}",
    }
    job = f"lost-{uuid.uuid4().hex[:6]}"
    try:
        with (
            side_setup(stack, node, state, env=env) as side,
            side.service("run", "projector"),
            side.service("run", "scheduler"),
            side.restartable("run", "worker", "--node", node) as worker,
            Client(side.settings, tenant="tests", job_id=job) as client,
            ThreadPoolExecutor(1) as pool,
        ):
            worker.start()
            served = first_sandbox(client, node)  # the node serves
            served.close()
            # Given the node's worker killed, and a create placed on it meanwhile
            worker.kill()
            waiting = pool.submit(client.create, timeout_s=120)
            # (not the first sandbox: its row may still say 'scheduled' while the
            # projector gathers the rest of its life)
            placed = wait_for(
                lambda: _one(side.settings, "SELECT sandbox_id FROM sandboxes"
                             " WHERE job_id = :j AND state = 'scheduled' AND sandbox_id <> :s",
                             j=job, s=served.id),
                15, "the create placed on the node",
            )  # fmt: skip
            # (the scheduler sends the task a moment after the log has the placement:
            # it is in Redis before Redis dies, or a send retried into the new Redis
            # would deliver it after all)
            queued = redis_lib.Redis.from_url(redis_settings.celery_broker_url)
            wait_for(lambda: _holds_a_task(queued), 15, "the create's task in Redis")
            # When Redis dies and comes back empty (the task lost for good), and the
            # worker comes back before its node is declared lost
            redis.kill()
            for leftover in ("appendonlydir", "appendonly.aof", "dump.rdb"):
                shutil.rmtree(state / "redis" / leftover, ignore_errors=True)
                (state / "redis" / leftover).unlink(missing_ok=True)
            redis.start()
            worker.start()
            # Then the trainer hears create_lost within its deadline
            with pytest.raises(SandboxError) as failed:
                waiting.result(timeout=MAX_AGE_S + GRACE_S + 60)
            assert failed.value.reason == "create_lost"
            # And the log ends the life once, create_lost
            end = wait_for(
                partial(_end, side.settings, placed.sandbox_id), 30, "the lost create's end"
            )
            assert (end.ends, end.reason) == (1, "create_lost")
            # And the node's room is back: the next create gets it
            with client.create(timeout_s=60) as fresh:
                assert fresh.exec("echo room").stdout == b"room\n"
            _sound(side.settings, began)
    finally:
        redis.kill()


def test_lives_on_a_node_lost_after_its_scheduler_stopped_end_node_lost_at_its_last_word(
    stack: Settings, state: Path
) -> None:
    began = datetime.now(UTC)
    node = "node8"
    job = f"orphaned-{uuid.uuid4().hex[:6]}"
    with (
        side_setup(stack, node, state) as side,
        side.service("run", "projector"),
        side.restartable("run", "worker", "--node", node) as worker,
        side.restartable("run", "scheduler") as scheduler,
        Client(side.settings, tenant="tests", job_id=job) as client,
    ):
        worker.start()
        scheduler.start()
        # Given two running sandboxes, placed by a scheduler that has since stopped
        boxes = [first_sandbox(client, node), client.create(timeout_s=60)]
        for box in boxes:
            assert box.exec("true").exit_code == 0
        scheduler.stop()
        # When their node goes down with them (its worker and containers at once)
        down_at = datetime.now(UTC)
        worker.kill()
        subprocess.run(["pkill", "-KILL", "-u", user_name(node)], capture_output=True)
        # And it is declared lost, while no scheduler runs
        declare_lost(side.settings, [node])
        # Then the projector's rule ends every life on it, node_lost, once
        for box in boxes:
            end = wait_for(partial(_end, side.settings, box.id), 60, f"{box.id} ended")
            assert (end.ends, end.reason) == (1, "node_lost")
            # billed to the node's last word on it: not past the moment it went down,
            # not before its last command
            last = _one(
                side.settings,
                "SELECT max(occurred_at) AS at FROM events"
                " WHERE sandbox_id = :s AND type = 'CommandCompleted'", s=box.id,
            ).at  # fmt: skip
            assert last <= end.at <= down_at
            ended = _one(side.settings, "SELECT ended_at, end_reason FROM sandbox_lives"
                         " WHERE sandbox_id = :s", s=box.id)  # fmt: skip
            assert (ended.ended_at, ended.end_reason) == (end.at, "node_lost")
        _sound(side.settings, began)


def _end(settings: Settings, sandbox_id: str) -> Any:
    """How many ends the log holds for the sandbox, the first one's time and reason
    (None while there is none)."""
    return _one(
        settings,
        "SELECT count(*) AS ends, min(occurred_at) AS at, min(payload->>'reason') AS reason"
        " FROM events WHERE sandbox_id = :s AND type = 'SandboxStopped' HAVING count(*) > 0",
        s=sandbox_id,
    )
