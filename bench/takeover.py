"""Scheduler takeover: how long a SIGKILLed scheduler's partitions wait for another.

    .venv/bin/python bench/takeover.py [--rounds 5] [--trainers 8]

Two scheduler processes share the requests topic of a private topic prefix (no node
there: every create is refused ``no_nodes`` by the scheduler at once, so a request's
round trip is the scheduler's alone). Trainers send creates one after another from
``--trainers`` threads. Each round SIGKILLs the scheduler that holds partition 0,
measures how long until the other owns every partition (Postgres's locks, polled every
20 ms), and starts a fresh one, which takes half back. Reported: the takeover time,
and the round trips of requests that were in flight or sent during it, against the
rest. Needs the broker and Postgres of `dsec up` (the stack's own scheduler is left
alone: it reads other topics).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

from app import bus, kafka_admin
from app.config import get_settings
from app.control import tenants
from app.domain.requests import CreateSandbox
from app.errors import SandboxRejectedError
from app.sdk import Client
from app.stack import services as stack
from app.stats import percentile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--trainers", type=int, default=8)
    args = parser.parse_args()

    prefix = f"takeover{uuid.uuid4().hex[:6]}"
    settings = get_settings().model_copy(update={"topic_prefix": prefix})
    tenants.local(settings, "bench")
    kafka_admin.ensure_topics(settings, ["bench"])
    # As many as the broker made (the embedded one makes every topic with its own count).
    probe = bus.make_consumer(settings)
    partitions = len(bus.partitions(probe, settings.topic_requests))
    probe.close()
    env = {**os.environ, "DSEC_TOPIC_PREFIX": prefix, "DSEC_SCHEDULER_METRICS_PORT": "0"}

    started: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "run", "scheduler"], env=env,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        started.append(proc)
        return proc

    def owners() -> dict[int, list[int]]:
        return stack.scheduler_partitions(settings) or {}

    def wait_until(check: object, what: str, timeout_s: float = 120.0) -> float:
        started = time.monotonic()
        while not check():  # type: ignore[operator]
            if time.monotonic() - started > timeout_s:
                raise SystemExit(f"timed out waiting for {what}")
            time.sleep(0.02)
        return time.monotonic() - started

    try:
        procs = [start()]
        wait_until(lambda: owners().get(procs[0].pid) == list(range(partitions)), "one owner")
        procs.append(start())
        half = [partitions // 2, partitions - partitions // 2]
        wait_until(lambda: sorted(map(len, owners().values())) == half, "two owners")

        # (sent at, round trip) of every request
        samples: list[tuple[float, float]] = []
        failures: list[uuid.UUID] = []
        stop = threading.Event()
        client = Client(settings, tenant="bench", job_id="takeover", timeout_s=120)

        def trainer() -> None:
            while not stop.is_set():
                request = CreateSandbox(
                    queue_s=0, **client.request_fields(f"sb-{uuid.uuid4().hex[:12]}")
                )
                sent = time.monotonic()
                try:
                    client.call(request, timeout_s=120)
                except SandboxRejectedError:
                    pass  # no_nodes: the answer expected
                except Exception:  # no answer (or a wrong one): counted, never hidden
                    failures.append(request.request_id)
                samples.append((sent, time.monotonic() - sent))

        threads = [threading.Thread(target=trainer, daemon=True) for _ in range(args.trainers)]
        for t in threads:
            t.start()
        time.sleep(3)
        takeovers: list[float] = []
        windows: list[tuple[float, float]] = []
        for _ in range(args.rounds):
            victim = next(p for p in procs if 0 in owners().get(p.pid, []))
            survivor = next(p for p in procs if p is not victim)
            killed_at = time.monotonic()
            victim.send_signal(signal.SIGKILL)
            victim.wait()
            takeover = wait_until(
                lambda s=survivor: owners().get(s.pid) == list(range(partitions)), "takeover"
            )
            takeovers.append(takeover)
            windows.append((killed_at, killed_at + takeover))
            procs = [survivor, start()]
            wait_until(lambda: sorted(map(len, owners().values())) == half, "two owners again")
            time.sleep(3)
        stop.set()
        for t in threads:
            t.join(timeout=150)
        client.close()
    finally:
        # Every scheduler this run started goes, whatever ended it (a timeout too).
        for proc in started:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in started:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        kafka_admin.drop_topics(settings)

    def touched(sent: float, took: float) -> bool:
        """In flight at, or sent during, a takeover."""
        return any(sent <= end and sent + took >= start for start, end in windows)

    during = [took for sent, took in samples if touched(sent, took)]
    steady = [took for sent, took in samples if not touched(sent, took)]
    ms = 1000.0
    print(
        f"rounds={args.rounds} trainers={args.trainers} requests={len(samples)} "
        f"unanswered={len(failures)}\n"
        f"takeover (SIGKILL -> survivor owns all {partitions}): "
        f"p50={percentile(takeovers, 50):.2f}s max={max(takeovers):.2f}s\n"
        f"round trip, steady: p50={percentile(steady, 50) * ms:.0f}ms "
        f"p99={percentile(steady, 99) * ms:.0f}ms (n={len(steady)})\n"
        f"round trip, in flight during a takeover: p50={percentile(during, 50) * ms:.0f}ms "
        f"max={max(during, default=0) * ms:.0f}ms (n={len(during)})"
    )
    print(
        f"RESULT takeover_p50={percentile(takeovers, 50):.2f}s "
        f"takeover_max={max(takeovers):.2f}s steady_p50={percentile(steady, 50) * ms:.0f}ms "
        f"during_max={max(during, default=0) * ms:.0f}ms unanswered={len(failures)}"
    )


if __name__ == "__main__":
    main()
