"""Commands per second through the whole platform, and the CPU each process spends on
one command.

    .venv/bin/python bench/throughput.py [--sandboxes 40] [--commands 800]
                                         [--in-flight 40] [--podman 200]
                                         [--route direct|scheduler]

K sandboxes, M `true` commands spread over them, N in flight at once from SDK threads;
prints commands/s, p50/p99 and a table of CPU milliseconds per command by process
(from /proc, over the run): the scheduler, the projector, the node worker, Flower,
Redis, the broker, Postgres, the node's Podman service and conmon, and this client.
In the same run, the same `true` through raw `podman exec` (podman-py, 8 in flight)
and through the in-sandbox agent alone (serially), for the ratios; and the floor the
Kafka client sets: M records of an exec's size produced (acknowledged, as the platform
does) and consumed through the platform's own Kafka adapters, N in flight, with the
CPU of this process and of the broker per record. A command is three such records
(request, CommandCompleted, reply), four through the scheduler (its inbox record).
``--route scheduler`` sends every command through the scheduler instead of straight
to the node (the direct route). Needs `dsec up`.
"""

from __future__ import annotations

import argparse
import os
import time
import uuid

from procstat import HZ, cpu_seconds, named, stack_processes, ticks
from rich.console import Console
from rich.table import Table
from substrate import RECORDS_PER_COMMAND, kafka_records, raw_sandbox, run

from app.config import Settings, get_settings
from app.control import tenants
from app.sdk import Client
from app.stats import percentile


def processes(settings: Settings) -> dict[str, list[int]]:
    """The platform's processes by role (the client is this process)."""
    return {"client (SDK)": [os.getpid()], **stack_processes(settings.state_dir, settings.node_id)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sandboxes", type=int, default=40)
    parser.add_argument("--commands", type=int, default=800)
    parser.add_argument("--in-flight", type=int, default=40)
    parser.add_argument("--podman", type=int, default=200)
    parser.add_argument("--route", choices=("direct", "scheduler"), default="direct")
    args = parser.parse_args()
    settings = get_settings()
    # The raw substrate first: podman exec, the agent alone, and Kafka records.
    raw_groups = {"podman + conmon": named("podman") + named("conmon")}
    with raw_sandbox(settings) as (container, conn):
        raw_before = cpu_seconds(raw_groups)
        podman_wall, _ = run(args.podman, 8, lambda _: container.exec_run(["true"]))
        raw_after = cpu_seconds(raw_groups)
        agent_cpu = ticks(os.getpid())
        agent_wall, _ = run(args.commands, 1, lambda _: conn.exec(["true"], timeout_s=10))
        agent_ms = (ticks(os.getpid()) - agent_cpu) / HZ / args.commands * 1000
    podman_ms = (raw_after["podman + conmon"] - raw_before["podman + conmon"]) / args.podman * 1000
    floor_client, floor_broker = kafka_records(settings, args.commands, args.in_flight)
    job = f"throughput-{uuid.uuid4().hex[:6]}"
    groups = processes(settings)
    with Client(settings, credential=tenants.local(settings, "bench"), job_id=job) as client:
        boxes = client.create_many(args.sandboxes, memory_mb=32, cpus=0.05)
        for box in boxes:  # warm every path once
            box.direct = box.direct and args.route == "direct"
            box.exec("true")
        time.sleep(1)
        before = cpu_seconds(groups)
        wall, latencies = run(
            args.commands, args.in_flight, lambda i: boxes[i % len(boxes)].exec("true")
        )
        time.sleep(0.5)  # the projector's share of the last commands
        after = cpu_seconds(groups)
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
        f"Kafka floor: {floor_client:.2f} ms CPU of the client and {floor_broker:.2f} ms"
        f" of the broker per record produced and consumed; x{RECORDS_PER_COMMAND}"
        f" records per command: {floor_client * RECORDS_PER_COMMAND:.2f} ms of clients"
    )
    print(
        f"RESULT throughput route={args.route} commands/s={rate:.0f}"
        f" p50_ms={p50:.1f} p99_ms={p99:.1f}"
        f" platform_cpu_ms={platform:.2f} broker_cpu_ms={per_command['broker']:.2f}"
        f" podman_exec_commands/s={args.podman / podman_wall:.0f}"
        f" agent_commands/s={args.commands / agent_wall:.0f}"
        f" kafka_floor_client_ms={floor_client * RECORDS_PER_COMMAND:.2f}"
        f" kafka_floor_broker_ms={floor_broker * RECORDS_PER_COMMAND:.2f}"
    )


if __name__ == "__main__":
    main()
