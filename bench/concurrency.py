"""Long commands in many sandboxes at once, and what a create or a short command costs
meanwhile.

    .venv/bin/python bench/concurrency.py [--n 200] [--sleep 10] [--probes 20]

Creates N sandboxes, then sends `sleep S` to all of them at once through the SDK and
times until the last answer (ideal: S), with the CPU each process spent meanwhile:
the sandboxes' own (their agents starting and reaping the commands) sets a floor
above S on these cores, printed beside it. While they run, it times `--probes` short
execs in a sandbox of its own and a few creates (each destroyed again), and compares
them with the same probes on the idle node just before. Needs `dsec up`.
"""

from __future__ import annotations

import argparse
import os
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from procstat import (
    cpu_seconds,
    kernel_threads,
    machine_seconds,
    sandboxes_cpu_seconds,
    stack_processes,
)
from rich.console import Console
from rich.table import Table

from app.config import Settings, get_settings
from app.control import tenants
from app.domain.requests import Exec
from app.sdk import Client, Sandbox
from app.stats import percentile

SHAPE = {"memory_mb": 16, "cpus": 0.005, "ttl_s": 3600}


def probes(client: Client, probe: Sandbox, n: int) -> tuple[list[float], list[float]]:
    """Milliseconds of ``n`` short execs and of ``n // 4`` creates (+ destroys)."""
    execs, creates = [], []
    for _ in range(n):
        t = time.perf_counter()
        probe.exec("true")
        execs.append((time.perf_counter() - t) * 1000)
    for _ in range(max(1, n // 4)):
        t = time.perf_counter()
        box = client.create(**SHAPE)
        creates.append((time.perf_counter() - t) * 1000)
        box.close()
    return execs, creates


def p50(values: list[float]) -> float:
    return percentile(values, 50)


def timed(what: str, fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    took = time.perf_counter() - t
    print(f"{what}: {took:.1f}s")
    return took


def burst_cpu(settings: Settings) -> dict[str, float]:
    """CPU seconds spent so far by each of the stack's processes, this one (the SDK),
    the node's sandboxes and the whole machine."""
    groups = stack_processes(settings.state_dir, settings.node_id)
    groups["kernel threads"] = kernel_threads()
    spent = cpu_seconds(groups)
    spent["client (SDK)"] = time.process_time()
    spent["sandboxes"] = sandboxes_cpu_seconds(settings.node_id)
    machine = machine_seconds()
    spent["interrupts"] = machine["interrupts"]
    spent["machine"] = sum(machine.values())
    return spent


def print_cpu(spent: dict[str, float], n: int, wall: float, sleep: float) -> float:
    """Print the burst's CPU by process; return the wall time the sandboxes' own CPU
    alone would take on this machine's cores beyond the sleep."""
    cores = os.cpu_count() or 1
    table = Table(title=f"CPU during the burst ({wall:.1f} s, {cores} cores)")
    table.add_column("process")
    table.add_column("CPU s", justify="right")
    table.add_column("ms per command", justify="right")
    named = {k: v for k, v in spent.items() if k != "machine"}
    for name, seconds in sorted(named.items(), key=lambda kv: -kv[1]):
        table.add_row(name, f"{seconds:.2f}", f"{seconds / n * 1000:.2f}")
    unnamed = spent["machine"] - sum(named.values())
    table.add_row("the rest (other processes)", f"{unnamed:.2f}", f"{unnamed / n * 1000:.2f}")
    table.add_row("machine", f"{spent['machine']:.2f}", f"{spent['machine'] / n * 1000:.2f}")
    Console().print(table)
    floor = spent["sandboxes"] / cores
    print(
        f"the machine was busy {spent['machine'] / (wall * cores):.0%} of the burst;"
        f" the sandboxes' own CPU alone needs {floor:.2f}s of every core:"
        f" a floor of {sleep + floor:.2f}s with the platform spending nothing"
    )
    return floor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--sleep", type=float, default=10.0)
    parser.add_argument("--probes", type=int, default=20)
    args = parser.parse_args()
    settings = get_settings()
    job = f"concurrency-{uuid.uuid4().hex[:6]}"
    with Client(
        settings, credential=tenants.local(settings, "bench"), job_id=job, timeout_s=600
    ) as client:
        boxes: list[Sandbox] = []

        def make() -> None:
            while len(boxes) < args.n:
                boxes.extend(client.create_many(min(50, args.n - len(boxes)), **SHAPE))

        timed(f"created {args.n} sandboxes", make)
        probe = client.create(**SHAPE)
        idle_execs, idle_creates = probes(client, probe, args.probes)
        requests = [
            Exec(**client.request_fields(b.id), command=f"sleep {args.sleep:g}", timeout_s=600)
            for b in boxes
        ]
        answered: list[float] = []
        print(f"sending {len(requests)} x sleep {args.sleep:g}", flush=True)
        before = burst_cpu(settings)
        started = time.perf_counter()
        # Each straight to its sandbox's node where it may (the direct route), as exec does.
        futures = [client.send(r, node=b.route(r)) for r, b in zip(requests, boxes, strict=True)]
        sent = time.perf_counter() - started
        for future in futures:
            # Called on the reply reader's thread: list.append is atomic.
            future.add_done_callback(lambda _f: answered.append(time.perf_counter() - started))
        busy_execs, busy_creates = probes(client, probe, args.probes)
        for request, future in zip(requests, futures, strict=True):
            client.wait(request, future, 600)
        wall = time.perf_counter() - started
        after = burst_cpu(settings)
        spent = {k: after[k] - before[k] for k in after}
        # The figures first: destroying thousands of sandboxes takes a while.
        print(f"{args.n} x sleep {args.sleep:g}: all answered after {wall:.2f}s", flush=True)
        # Where the time past the sleep went: sending, the node starting them, answering.
        answered.sort()
        print(
            f"sent in {sent:.2f}s; answers from {answered[0]:.2f}s,"
            f" p50 {percentile(answered, 50):.2f}s, to {answered[-1]:.2f}s"
        )
        print(
            f"short exec p50: idle {p50(idle_execs):.1f} ms, meanwhile {p50(busy_execs):.1f} ms;"
            f" create p50: idle {p50(idle_creates):.1f} ms,"
            f" meanwhile {p50(busy_creates):.1f} ms"
        )
        floor = print_cpu(spent, args.n, wall, args.sleep)
        outside = ("machine", "sandboxes", "broker", "kernel threads", "interrupts")
        platform = sum(v for k, v in spent.items() if k not in outside)
        print(
            f"RESULT concurrency n={args.n} sleep={args.sleep:g} wall_s={wall:.2f}"
            f" floor_s={args.sleep + floor:.2f}"
            f" sandboxes_cpu_ms={spent['sandboxes'] / args.n * 1000:.2f}"
            f" platform_cpu_ms={platform / args.n * 1000:.2f}"
            f" broker_cpu_ms={spent['broker'] / args.n * 1000:.2f}"
            f" exec_p50_ms={p50(idle_execs):.1f}/{p50(busy_execs):.1f}"
            f" create_p50_ms={p50(idle_creates):.1f}/{p50(busy_creates):.1f}",
            flush=True,
        )
        with ThreadPoolExecutor(32) as pool:
            list(pool.map(lambda box: box.close(), [probe, *boxes]))


if __name__ == "__main__":
    main()
