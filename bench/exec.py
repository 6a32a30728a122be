"""Exec round trip on one node: the in-sandbox agent against `podman exec`, same run.

    .venv/bin/python bench/exec.py [--n 300] [--podman-n 30] [--platform-n 100]

One sandbox is created on the running node's rootless Podman service (the same
secure defaults the platform uses). Then, in this order:
- agent: the host client sends EXEC of ``true`` (a command that forks) and of ``echo``
  over the sandbox's socket; p50/p99 of the round trip;
- podman exec: ``exec_run(["true"])`` through the same REST service (what most
  sandbox tools do); fewer samples, each costs ~100 ms;
- one Kafka hop: a record handed to the platform's Publisher (acknowledged) until a
  consumer with the platform's settings has it; an exec waits on three of these
  (request, the node's inbox record, reply), the floor under the platform's figure;
- platform: the same command through the whole platform from the SDK, on a sandbox
  created through it: straight to the node's inbox (the direct route: Kafka, node,
  agent, Kafka back), and through the scheduler (one hop and the scheduler more), in
  turns of ten so that both meet the same machine.
Needs `dsec up`. The last line prints the headline figures.
"""

from __future__ import annotations

import argparse

from substrate import HOPS_PER_EXEC, kafka_hop, raw_sandbox

from app.config import get_settings
from app.control import tenants
from app.sdk import Client
from app.stats import durations, percentile


def line(name: str, samples: list[float]) -> str:
    p50, p99 = percentile(samples, 50) * 1000, percentile(samples, 99) * 1000
    return f"{name:<28} n={len(samples):<4} p50={p50:8.2f} ms  p99={p99:8.2f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=300)
    parser.add_argument("--podman-n", type=int, default=30)
    parser.add_argument("--platform-n", type=int, default=100)
    args = parser.parse_args()
    settings = get_settings()
    results: dict[str, list[float]] = {}
    with raw_sandbox(settings) as (container, conn):
        results["agent: true"] = durations(args.n, lambda: conn.exec(["true"], timeout_s=10))
        results["agent: sh -c 'echo hi'"] = durations(
            args.n, lambda: conn.exec(["/bin/sh", "-c", "echo hi"], timeout_s=10)
        )
        results["podman exec: true"] = durations(
            args.podman_n, lambda: container.exec_run(["true"]), warmup=2
        )
    results["one Kafka hop"] = kafka_hop(settings, args.platform_n)
    with (
        Client(settings, credential=tenants.local(settings, "bench"), job_id="exec") as client,
        client.create() as box,
    ):
        durations(5, lambda: box.exec("true"))  # warm both routes
        box.direct = False
        durations(5, lambda: box.exec("true"))
        direct: list[float] = []
        routed: list[float] = []
        for _ in range(max(1, args.platform_n // 10)):
            box.direct = True
            direct += durations(10, lambda: box.exec("true"), warmup=0)
            box.direct = False
            routed += durations(10, lambda: box.exec("true"), warmup=0)
        box.direct = True
        results["platform (SDK): true"] = direct
        results["platform via the scheduler"] = routed
    for name, samples in results.items():
        print(line(name, samples))
    agent = percentile(results["agent: true"], 50) * 1000
    podman = percentile(results["podman exec: true"], 50) * 1000
    platform = percentile(results["platform (SDK): true"], 50) * 1000
    platform_p99 = percentile(results["platform (SDK): true"], 99) * 1000
    routed = percentile(results["platform via the scheduler"], 50) * 1000
    hop = percentile(results["one Kafka hop"], 50) * 1000
    print(
        f"Kafka floor: an exec waits on {HOPS_PER_EXEC} hops of {hop:.1f} ms p50 ="
        f" {HOPS_PER_EXEC * hop:.1f} ms before the node or the agent does anything"
    )
    print(
        f"RESULT exec p50: agent={agent:.2f}ms podman_exec={podman:.1f}ms "
        f"speedup={podman / agent:.0f}x platform_end_to_end={platform:.1f}ms"
        f" platform_p99={platform_p99:.1f}ms via_scheduler={routed:.1f}ms kafka_hop={hop:.1f}ms"
    )


if __name__ == "__main__":
    main()
