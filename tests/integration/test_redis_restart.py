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
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from app.config import Settings
from app.stack.services import write_redis_conf
from app.taskqueue import make_celery
from tests.conftest import free_port, wait_for
from workers.celery_app import restore_unacked

pytestmark = pytest.mark.integration


@dataclass
class RedisServer:
    """A redis-server of the test's own, with the stack's configuration."""

    conf: Path
    url: str
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start it and wait until it answers."""
        self.process = subprocess.Popen(["redis-server", str(self.conf)])
        client = redis.Redis.from_url(self.url)
        wait_for(lambda: _pings(client), 20, "redis-server answering")

    def kill(self) -> None:
        """SIGKILL it, as a crash does."""
        if self.process is not None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)
            self.process = None


@pytest.fixture
def own_redis(settings: Settings, tmp_path: Path) -> Iterator[tuple[Settings, RedisServer]]:
    """Settings pointing at a Redis of the test's own (on a spare port, in a directory
    of its own), running; killed at the end."""
    ours = settings.model_copy(
        update={
            "state_dir": tmp_path,
            "celery_broker_url": f"redis://127.0.0.1:{free_port()}/0",
        }
    )
    (tmp_path / "logs").mkdir()
    write_redis_conf(ours)  # the stack's configuration, this port and directory
    server = RedisServer(tmp_path / "redis" / "redis.conf", ours.celery_broker_url)
    server.start()
    try:
        yield ours, server
    finally:
        server.kill()


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


def test_queued_creation_tasks_survive_a_redis_crash(
    own_redis: tuple[Settings, RedisServer],
) -> None:
    settings, server = own_redis
    url = settings.celery_broker_url
    queue = f"node.gone-{uuid.uuid4().hex[:6]}"
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
    server.kill()
    # Then, started again, it still holds every one of them, as they were sent
    server.start()
    client = redis.Redis.from_url(url)
    held = client.lrange(queue, 0, -1)
    assert len(held) == 5
    assert all(any(task_id.encode() in body for body in held) for task_id in sent)


#: A worker that takes one task and dies without acknowledging it (SIGKILL: it cannot
#: give it back itself, as a worker killed while Redis restarts cannot).
TAKER = """
import sys, time
from app.config import Settings
from app.taskqueue import make_celery
app = make_celery(Settings(celery_broker_url=sys.argv[1]))
with app.connection_for_read() as conn:
    queue = conn.SimpleQueue(sys.argv[2])
    queue.get(timeout=10)
    print("taken", flush=True)
    time.sleep(600)
"""


def test_a_task_a_dead_worker_took_is_given_back_when_its_node_starts_again(
    own_redis: tuple[Settings, RedisServer],
) -> None:
    settings, _server = own_redis
    url = settings.celery_broker_url
    queue = f"node.dead-{uuid.uuid4().hex[:6]}"
    celery = make_celery(settings)
    for n in range(3):
        celery.send_task("dsec.node.destroy", args=[str(n)], queue=queue)
    client = redis.Redis.from_url(url)
    # Given a worker that took a task and died holding it
    taker = subprocess.Popen(
        [sys.executable, "-c", TAKER, url, queue], stdout=subprocess.PIPE, text=True
    )
    assert taker.stdout is not None and taker.stdout.readline().strip() == "taken"
    taker.send_signal(signal.SIGKILL)
    taker.wait(10)
    assert client.llen(queue) == 2 and client.hlen("unacked") == 1
    # When the node's worker starts again, it gives the task back to the queue at once
    assert restore_unacked(queue, celery) == 1
    assert client.llen(queue) == 3 and client.hlen("unacked") == 0
    # And a queue of another node is left alone
    assert restore_unacked(f"{queue}-other", celery) == 0
    celery.close()
