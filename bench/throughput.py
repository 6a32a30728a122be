"""Commands per second through the whole platform, and the CPU each process spends on
one command.

    .venv/bin/python bench/throughput.py [--sandboxes 40] [--commands 800]
                                         [--in-flight 40] [--podman 200]

K sandboxes, M `true` commands spread over them, N in flight at once from SDK threads;
prints commands/s, p50/p99 and a table of CPU milliseconds per command by process
(from /proc, over the run): the scheduler, the projector, the node worker, Flower,
Redis, the broker, Postgres, the node's Podman service and conmon, and this client.
In the same run, the same `true` through raw `podman exec` (podman-py, 8 in flight)
and through the in-sandbox agent alone (serially), for the ratios. Needs `dsec up`.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from procstat import HZ, named, ticks
from rich.console import Console
from rich.table import Table

from app import tenants
from app.config import Settings, get_settings
from app.sdk import Client
from app.stats import percentile
from workers.agent.client import AgentPool
from workers.node_setup import set_up_node_user
from workers.podman_driver import PodmanDriver, container_args
from workers.sandbox_spec import SandboxSpec


def _pidfile(settings: Settings, name: str) -> list[int]:
    try:
        return [int((settings.state_dir / "run" / f"{name}.pid").read_text())]
    except (OSError, ValueError):
        return []


def processes(settings: Settings) -> dict[str, list[int]]:
    """The platform's processes by role (the client is this process)."""
    return {
        "client (SDK)": [os.getpid()],
        "scheduler": _pidfile(settings, "scheduler"),
        "projector": _pidfile(settings, "projector"),
        "node worker": _pidfile(settings, f"worker-{settings.node_id}"),
        "flower": _pidfile(settings, "flower"),
        "redis": named("redis-server"),
        "postgres": named("postgres"),
        "podman service": named("podman"),
        "conmon": named("conmon"),
        "broker": named("tansu"),
    }


def cpu(groups: dict[str, list[int]]) -> dict[str, float]:
    return {name: sum(map(ticks, pids)) / HZ for name, pids in groups.items()}


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sandboxes", type=int, default=40)
    parser.add_argument("--commands", type=int, default=800)
    parser.add_argument("--in-flight", type=int, default=40)
    parser.add_argument("--podman", type=int, default=200)
    args = parser.parse_args()
    settings = get_settings()
    # The raw substrate first (the node would take its container for an orphan after
    # two heartbeats): podman exec and the agent alone.
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
    container = None
    raw_groups = {"podman + conmon": named("podman") + named("conmon")}
    try:
        # Without the sandbox label the node leaves it alone (it is nobody's sandbox).
        options = container_args(spec)
        options["labels"] = {}
        container = driver._client().containers.create(spec.image, list(driver.command), **options)
        container.start()
        conn = pool.connection(sandbox_id, 15)
        raw_before = cpu(raw_groups)
        podman_wall, _ = run(args.podman, 8, lambda _: container.exec_run(["true"]))
        raw_after = cpu(raw_groups)
        agent_cpu = ticks(os.getpid())
        agent_wall, _ = run(args.commands, 1, lambda _: conn.exec(["true"], timeout_s=10))
        agent_ms = (ticks(os.getpid()) - agent_cpu) / HZ / args.commands * 1000
    finally:
        pool.close()
        if container is not None:
            container.remove(force=True)
    podman_ms = (raw_after["podman + conmon"] - raw_before["podman + conmon"]) / args.podman * 1000
    job = f"throughput-{uuid.uuid4().hex[:6]}"
    groups = processes(settings)
    with Client(settings, credential=tenants.local(settings, "bench"), job_id=job) as client:
        boxes = client.create_many(args.sandboxes, memory_mb=32, cpus=0.05)
        for box in boxes:  # warm every path once
            box.exec("true")
        time.sleep(1)
        before = cpu(groups)
        wall, latencies = run(
            args.commands, args.in_flight, lambda i: boxes[i % len(boxes)].exec("true")
        )
        time.sleep(0.5)  # the projector's share of the last commands
        after = cpu(groups)
        for box in boxes:
            box.close()
    per_command = {k: (after[k] - before[k]) / args.commands * 1000 for k in groups}
    platform = sum(v for k, v in per_command.items() if k != "broker")

    table = Table(title=f"CPU per command, {args.commands} x true, {args.in_flight} in flight")
    table.add_column("process")
    table.add_column("ms per command", justify="right")
    for name, ms in sorted(per_command.items(), key=lambda kv: -kv[1]):
        table.add_row(name, f"{ms:.2f}")
    table.add_row("platform (all but the broker)", f"{platform:.2f}")
    Console().print(table)
    rate = args.commands / wall
    p50, p99 = percentile(latencies, 50) * 1000, percentile(latencies, 99) * 1000
    print(f"platform: {rate:.0f} commands/s, p50 {p50:.1f} ms, p99 {p99:.1f} ms")
    print(
        f"podman exec: {args.podman / podman_wall:.0f} commands/s (8 in flight),"
        f" {podman_ms:.2f} ms CPU of podman + conmon per command"
    )
    print(
        f"agent alone: {args.commands / agent_wall:.0f} commands/s (serial),"
        f" {agent_ms:.2f} ms CPU of the caller per command"
    )
    print(
        f"RESULT throughput commands/s={rate:.0f} p50_ms={p50:.1f} p99_ms={p99:.1f}"
        f" platform_cpu_ms={platform:.2f} broker_cpu_ms={per_command['broker']:.2f}"
        f" podman_exec_commands/s={args.podman / podman_wall:.0f}"
        f" agent_commands/s={args.commands / agent_wall:.0f}"
    )


if __name__ == "__main__":
    main()
