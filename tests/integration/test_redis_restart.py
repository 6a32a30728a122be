"""Creation tasks queued in Redis survive its crash: the stack's Redis keeps an
append-only file, and a task acknowledged to the scheduler is on disk before Redis
answers.

A Redis of the test's own (the stack's configuration, on a spare port and in a
directory of its own) is SIGKILLed with a node's tasks queued and nobody consuming
them; the same tasks are there when it comes back. That a restarted Redis is found
again by every service is tested with the stack's own in test_supervisor.py.
"""

from __future__ import annotations

import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from app.config import Settings
from app.stack import write_redis_conf
from app.taskqueue import make_celery
from tests.conftest import free_port, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def own_redis(settings: Settings, tmp_path: Path) -> Iterator[tuple[Settings, Path]]:
    ours = settings.model_copy(
        update={
            "state_dir": tmp_path,
            "celery_broker_url": f"redis://127.0.0.1:{free_port()}/0",
        }
    )
    (tmp_path / "logs").mkdir()
    write_redis_conf(ours)  # the stack's configuration, this port and directory
    yield ours, tmp_path / "redis" / "redis.conf"


def _start(conf: Path, url: str) -> subprocess.Popen[bytes]:
    server = subprocess.Popen(["redis-server", str(conf)])
    client = redis.Redis.from_url(url)
    wait_for(lambda: _pings(client), 20, "redis-server answering")
    return server


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


def test_queued_creation_tasks_survive_a_redis_crash(own_redis: tuple[Settings, Path]) -> None:
    settings, conf = own_redis
    url = settings.celery_broker_url
    server = _start(conf, url)
    queue = f"node.gone-{uuid.uuid4().hex[:6]}"
    try:
        # Given creation tasks queued for a node that is not consuming
        celery = make_celery(settings)
        sent = [
            celery.send_task("workers.create_sandbox", args=[{"n": n}], queue=queue).id
            for n in range(5)
        ]
        celery.close()
        client = redis.Redis.from_url(url)
        assert client.llen(queue) == 5
        # When Redis is killed without a word
        server.send_signal(signal.SIGKILL)
        server.wait(10)
        # Then, started again, it still holds every one of them, as they were sent
        server = _start(conf, url)
        client = redis.Redis.from_url(url)
        held = client.lrange(queue, 0, -1)
        assert len(held) == 5
        assert all(any(task_id.encode() in body for body in held) for task_id in sent)
    finally:
        server.send_signal(signal.SIGKILL)
        server.wait(10)
