"""The raw substrate the benchmarks compare the platform with, in the same run: a
container made straight on the node's Podman service with the in-sandbox agent, and
Kafka records through the platform's own adapters with nothing around them."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kafka import TopicPartition
from procstat import HZ, broker_pids, ticks

from app import bus, kafka_admin
from app.config import Settings
from workers.agent.connection import AgentConnection
from workers.agent.pool import AgentPool
from workers.containers.podman_api import container_args
from workers.containers.podman_driver import PodmanDriver
from workers.containers.spec import SandboxSpec
from workers.host.user import set_up_node_user

#: Records a command costs on the bus: the request (straight to the node's inbox),
#: CommandCompleted, the reply; through the scheduler, also the inbox record it sends.
RECORDS_PER_COMMAND = 3
#: Broker hops an exec waits on: the request, the reply (through the scheduler, 3).
HOPS_PER_EXEC = 2
#: About an exec request's size on the bus.
VALUE = b"x" * 400


def run(n: int, in_flight: int, call: Callable[[int], object]) -> tuple[float, list[float]]:
    """Wall seconds and per-call seconds of ``n`` calls, ``in_flight`` at a time."""
    latencies: list[float] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        t = time.perf_counter()
        call(i)
        took = time.perf_counter() - t
        with lock:
            latencies.append(took)

    started = time.perf_counter()
    with ThreadPoolExecutor(in_flight) as pool:
        list(pool.map(one, range(n)))
    return time.perf_counter() - started, latencies


@contextmanager
def raw_sandbox(settings: Settings) -> Iterator[tuple[Any, AgentConnection]]:
    """A container on the node's Podman service with the platform's secure defaults
    and its agent, but no sandbox label, so the node leaves it alone (it would take a
    labelled one it did not create for an orphan); yields the podman-py container and
    a connection to its agent, and removes it after."""
    user = set_up_node_user(settings.node_id, settings)
    driver = PodmanDriver(user.socket_url)
    sandbox_id = f"sb-raw-{uuid.uuid4().hex[:8]}"
    run_dir = settings.state_dir / "nodes" / settings.node_id / "bench" / sandbox_id
    run_dir.mkdir(parents=True, exist_ok=True)
    pool = AgentPool()
    pool.register(sandbox_id, run_dir)
    spec = SandboxSpec(
        sandbox_id=sandbox_id, image=settings.default_image,
        agent_bin_dir=settings.state_dir / "agent", run_dir=run_dir,
    )  # fmt: skip
    options = container_args(spec)
    options["labels"] = {}
    container = driver._client().containers.create(spec.image, list(driver.command), **options)
    try:
        container.start()
        yield container, pool.connection(sandbox_id, 15)
    finally:
        pool.close()
        container.remove(force=True)
        _reap_exec_monitors(str(container.id))


def _reap_exec_monitors(container_id: str) -> int:
    """Kill the conmon processes left by the container's exec sessions.

    Each `podman exec` through the REST API leaves its conmon (two processes) running
    after the command exited, and removing the container does not end them (Podman
    4.3): 200 execs left 400 processes, whose system time slowed every later run,
    the platform and the raw substrate alike. Returns how many were killed."""
    killed = 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"conmon") and container_id.encode() in argv:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(proc.name), signal.SIGKILL)
                killed += 1
    return killed


@contextmanager
def _topic(settings: Settings) -> Iterator[str]:
    """A topic of its own, made like a node's inbox (one partition), dropped after."""
    node = f"bench-{uuid.uuid4().hex[:8]}"
    kafka_admin.ensure_topics(settings, nodes=[node], platform=False)
    topic = settings.node_topic(node)
    try:
        yield topic
    finally:
        kafka_admin.drop_topics(settings, [topic])


def kafka_records(settings: Settings, n: int, in_flight: int) -> tuple[float, float]:
    """CPU ms of this process and of the broker per record produced (acknowledged, as
    the platform does) and consumed once, through the platform's Publisher and
    consumer settings, ``in_flight`` at once: the floor of the Kafka client's cost."""
    with _topic(settings) as topic:
        publisher = bus.Publisher(settings)
        consumer = bus.make_consumer(settings)
        consumer.assign([TopicPartition(topic, 0)])
        publisher.publish(topic, "warm", VALUE, wait=True, partition=0)
        seen = 0

        def consume() -> None:
            nonlocal seen
            while seen < n + 1:
                for records in consumer.poll(timeout_ms=200, max_records=500).values():
                    seen += len(records)

        broker = broker_pids(settings.state_dir)
        before = (ticks(os.getpid()), sum(map(ticks, broker)))
        reader = threading.Thread(target=consume)
        reader.start()
        run(n, in_flight, lambda i: publisher.publish(topic, str(i), VALUE, wait=True, partition=0))
        reader.join()
        after = (ticks(os.getpid()), sum(map(ticks, broker)))
        consumer.close()
        publisher.close()
    own, broker_ms = ((a - b) / HZ / n * 1000 for a, b in zip(after, before, strict=True))
    return own, broker_ms


def kafka_hop(settings: Settings, n: int) -> list[float]:
    """Seconds from handing a record to the platform's Publisher (acknowledged) to its
    arrival at a consumer with the platform's settings that polls all the time, as the
    platform's consumers do: one hop of an exec. Records leave at random moments, so a
    broker that holds a fetch for its whole wait instead of answering when data arrives
    shows it (a consumer that fetches only after the send would not)."""
    with _topic(settings) as topic:
        publisher = bus.Publisher(settings)
        consumer = bus.make_consumer(settings)
        consumer.assign([TopicPartition(topic, 0)])
        arrived: dict[str, float] = {}
        total = n + 5

        def consume() -> None:
            while len(arrived) < total:
                for records in consumer.poll(timeout_ms=200).values():
                    now = time.perf_counter()
                    for record in records:
                        arrived[record.key.decode()] = now

        reader = threading.Thread(target=consume)
        reader.start()
        sent: dict[str, float] = {}
        pace = random.Random(7)
        for i in range(total):
            time.sleep(pace.uniform(0.005, 0.025))
            sent[str(i)] = time.perf_counter()
            publisher.publish(topic, str(i), VALUE, wait=True, partition=0)
        reader.join()
        consumer.close()
        publisher.close()
    # The first ones find the connections cold.
    return [arrived[k] - sent[k] for k in list(sent)[5:]]
