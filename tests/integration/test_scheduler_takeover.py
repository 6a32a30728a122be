"""Two scheduler processes share the requests topic by partition; when one is killed
with SIGKILL, the other takes its partitions over and no request is lost or doubled."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kafka import TopicPartition

from app import bus
from app.config import Settings
from app.consuming import key_partition
from app.domain.replies import ExecOutput
from app.domain.requests import CreateSandbox
from app.sdk.client import Client, ExecResult, exec_request
from app.stack import services as stack_mod
from tests.conftest import scalar, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SANDBOXES = 4  # per scheduler: each one's partitions carry some of the load


def owned(settings: Settings) -> dict[int, list[int]]:
    """Partitions of the requests topic each scheduler process owns (by its pid)."""
    return stack_mod.scheduler_partitions(settings) or {}


def _partitions(settings: Settings) -> int:
    """Partitions of the requests topic, as the broker has it now (an embedded broker
    that restarted made it with its own number)."""
    consumer = bus.make_consumer(settings)
    try:
        return len(bus.partitions(consumer, settings.topic_requests))
    finally:
        consumer.close()


@pytest.fixture
def schedulers(stack: Settings, tmp_path: Path) -> Iterator[Callable[[], subprocess.Popen[bytes]]]:
    """Scheduler processes of the test's own, in place of the stack's (put back after)."""
    theirs = [s for s in stack_mod.services(stack) if s.name.startswith("scheduler")]
    for service in theirs:
        service.stop(stack)  # its pid file goes: the supervisor leaves it down
    procs: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        log = open(tmp_path / f"scheduler-{len(procs)}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "run", "scheduler"],
            env={**os.environ, "DSEC_SCHEDULER_METRICS_PORT": "0"},
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        procs.append(proc)
        return proc

    try:
        yield start
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=30)
        for service in theirs:
            service.start(stack)
        wait_for(
            lambda: sum(len(p) for p in owned(stack).values()) == _partitions(stack),
            timeout_s=60, what="the stack's scheduler owning every partition again",
        )  # fmt: skip


class Replies:
    """Counts the answers on a trainer's replies partition, from now on."""

    def __init__(self, settings: Settings, topic: str, partition: int) -> None:
        self.settings = settings
        self.tp = TopicPartition(topic, partition)
        self.start = bus.high_watermarks(settings, [self.tp])[self.tp]

    def count(self, request_ids: set[uuid.UUID]) -> Counter[uuid.UUID]:
        consumer = bus.make_consumer(self.settings)
        try:
            consumer.assign([self.tp])
            consumer.seek(self.tp, self.start)
            end = bus.high_watermarks(self.settings, [self.tp])[self.tp]
            seen: Counter[uuid.UUID] = Counter()
            while consumer.position(self.tp) < end:
                for records in consumer.poll(timeout_ms=500).values():
                    for r in records:
                        found = uuid.UUID(json.loads(r.value)["request_id"])
                        if found in request_ids:
                            seen[found] += 1
            return seen
        finally:
            consumer.close()


def test_sigkill_of_one_scheduler_hands_its_partitions_to_the_other(
    stack: Settings, db: Any, schedulers: Callable[[], subprocess.Popen[bytes]]
) -> None:
    # Given two scheduler processes that share the requests topic
    first = schedulers()
    wait_for(lambda: owned(stack).get(first.pid) == list(range(_partitions(stack))),
             timeout_s=60, what="the first scheduler owning every partition")  # fmt: skip
    second = schedulers()
    half = _partitions(stack) // 2
    wait_for(
        lambda: {len(owned(stack).get(p.pid, [])) for p in (first, second)} == {half},
        timeout_s=60, what="both schedulers owning half the partitions",
    )  # fmt: skip
    victim_parts = set(owned(stack)[first.pid])
    # and a trainer with sandboxes on the partitions of each
    client = Client(stack, tenant="tests", job_id=f"takeover-{uuid.uuid4().hex[:6]}")
    replies = Replies(stack, client._reply_to.topic, client._reply_to.partition)
    boxes: list[str] = []
    on_victim = 0
    while len(boxes) < 2 * SANDBOXES:
        sandbox_id = f"sb-take-{uuid.uuid4().hex[:10]}"
        mine = key_partition(sandbox_id, _partitions(stack)) in victim_parts
        if (on_victim if mine else len(boxes) - on_victim) >= SANDBOXES:
            continue
        client.call(CreateSandbox(**client.request_fields(sandbox_id)), timeout_s=60)
        boxes.append(sandbox_id)
        on_victim += mine

    # When the trainer keeps sending commands to every sandbox
    sent: dict[str, list[tuple[uuid.UUID, int]]] = {b: [] for b in boxes}
    done = {b: 0 for b in boxes}
    failures: list[BaseException] = []
    stop = threading.Event()

    def load(sandbox_id: str) -> None:
        i = 0
        try:
            while not stop.is_set():
                i += 1
                request = exec_request(client.request_fields(sandbox_id),
                                       f"echo {i} >> /tmp/ran; echo {i}", timeout_s=30)  # fmt: skip
                sent[sandbox_id].append((request.request_id, i))
                reply = client.call(request, timeout_s=120)
                assert isinstance(reply, ExecOutput)
                assert ExecResult.from_reply(reply).stdout == f"{i}\n".encode()
                done[sandbox_id] = i
        except BaseException as exc:  # reported by the test below
            failures.append(exc)

    threads = [threading.Thread(target=load, args=(b,), daemon=True) for b in boxes]
    for t in threads:
        t.start()
    wait_for(lambda: min(done.values()) >= 3 or failures, timeout_s=60, what="load flowing")
    # and the first scheduler is killed mid-load
    before = dict(done)
    first.send_signal(signal.SIGKILL)
    first.wait()

    # Then the second takes its partitions over
    wait_for(lambda: owned(stack).get(second.pid) == list(range(_partitions(stack))),
             timeout_s=60, what="the survivor owning every partition")  # fmt: skip
    # and requests keep being answered, on the victim's partitions too
    wait_for(
        lambda: all(done[b] >= before[b] + 3 for b in boxes) or failures,
        timeout_s=120, what="load flowing after the takeover",
    )  # fmt: skip
    stop.set()
    for t in threads:
        t.join(timeout=150)
    assert failures == []

    # Then every request got exactly one answer
    issued = {rid for b in boxes for rid, _ in sent[b]}
    assert set(replies.count(issued).values()) == {1}
    assert len(replies.count(issued)) == len(issued)
    # and every command ran once, in order, in its sandbox
    for b in boxes:
        ran = client.sandbox(b).exec("cat /tmp/ran", timeout_s=30).stdout.decode().split()
        assert ran == [str(i) for _, i in sent[b]], b
    # and the log holds each command once
    completed = "SELECT count(*) FROM events WHERE sandbox_id = :s AND type = 'CommandCompleted'"
    projected = "SELECT count(*) FROM commands WHERE sandbox_id = :s"
    with db() as conn:
        for b in boxes:
            expected = len(sent[b]) + 1  # and the cat

            def in_log(b: str = b, expected: int = expected) -> bool:
                return bool(scalar(conn, projected, s=b) == expected)

            wait_for(in_log, timeout_s=60, what=f"{b}'s commands in the log")
            assert scalar(conn, completed, s=b) == expected
    for b in boxes:
        client.sandbox(b).close()
    client.close()
